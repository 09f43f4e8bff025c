"""What wraps the draft server's routes: ASGI guards (body size, API key, the replica header) and Prometheus metrics.

Each guard is a plain ASGI middleware factory, `guard(app, **options) -> app`, added with
`app.add_middleware`; each answers its refusal as the routes answer theirs, JSON with a `detail`.
"""

import hmac
import math
import socket
import time
from collections.abc import Callable, Sequence

import prometheus_client
from fastapi.responses import JSONResponse

import draft_model

AUTHENTICATED_PATHS = ("/draft", "/draft/batch")  # /health, /metrics and /docs stay open: they carry no secrets
MEASURED_PATHS = ("/draft", "/draft/batch", "/health", "/metrics")  # every other path is counted as "other"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    """Prometheus metrics in a registry of their own, so two apps in one process never collide."""

    def __init__(self, max_batch_size: int):
        self.registry = registry = prometheus_client.CollectorRegistry()
        self.requests = prometheus_client.Counter(
            "draft_server_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=registry,
        )
        self.latency = prometheus_client.Histogram(
            "draft_server_request_latency_seconds",
            "Time from request arrival to response, by endpoint",
            ["endpoint"],
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        batch_buckets = sorted({2**i for i in range(int(math.log2(max_batch_size)) + 1)} | {max_batch_size})
        self.batch_size = prometheus_client.Histogram(
            "draft_server_batch_size", "Requests per draft_batch call", registry=registry, buckets=batch_buckets
        )
        self.batch_seconds = prometheus_client.Histogram(
            "draft_server_batch_seconds",
            "Time spent inside draft_batch per batch",
            registry=registry,
            buckets=LATENCY_BUCKETS,
        )
        self.failed_batches = prometheus_client.Counter(
            "draft_server_failed_batches", "draft_batch calls that raised", registry=registry
        )
        self.deadline_expired = prometheus_client.Counter(
            "draft_server_queue_deadline_expired",
            "Requests answered 503 because they waited in the queue longer than --queue-deadline-s",
            registry=registry,
        )
        self.prompt_tokens = prometheus_client.Counter(
            "draft_server_prompt_tokens",
            "Prompt tokens of the requests the model drafted (not lookup drafts)",
            registry=registry,
        )
        self.cached_tokens = prometheus_client.Counter(
            "draft_server_cached_tokens", "Prompt tokens whose KV came from the prefix cache", registry=registry
        )
        self.cached_ratio = prometheus_client.Gauge(
            "draft_server_cached_token_ratio", "cached_tokens / prompt_tokens since start", registry=registry
        )
        self.draft_tokens = prometheus_client.Counter(
            "draft_server_draft_tokens", "Draft tokens returned", registry=registry
        )
        self.lookup_drafts = prometheus_client.Counter(
            "draft_server_lookup_drafts",
            "Drafts copied from the request's own tokens (hybrid drafting)",
            registry=registry,
        )
        self.queue_depth = prometheus_client.Gauge(
            "draft_server_queue_depth", "Requests waiting for the batcher", registry=registry
        )
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0

    def record_batch(
        self, prompts: Sequence[Sequence[int]], drafts: Sequence[draft_model.Draft], seconds: float
    ) -> None:
        self.batch_size.observe(len(prompts))
        self.batch_seconds.observe(seconds)
        # Lookup drafts never reach the model or its cache: counting them would skew the cached share.
        prompt_tokens = sum(len(prompt) for prompt, draft in zip(prompts, drafts) if draft.source == "model")
        cached_tokens = sum(draft.cached_tokens for draft in drafts)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.draft_tokens.inc(sum(len(draft) for draft in drafts))
        self.lookup_drafts.inc(sum(draft.source == "lookup" for draft in drafts))
        self.total_prompt_tokens += prompt_tokens
        self.total_cached_tokens += cached_tokens
        if self.total_prompt_tokens:
            self.cached_ratio.set(self.total_cached_tokens / self.total_prompt_tokens)

    content_type = prometheus_client.CONTENT_TYPE_LATEST

    def text(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


async def send_error(
    scope: dict, receive: Callable, send: Callable, status: int, detail: str, headers: dict[str, str] | None = None
) -> None:
    await JSONResponse({"detail": detail}, status_code=status, headers=headers)(scope, receive, send)


def limit_body_size(app: Callable, max_bytes: int) -> Callable:
    """413 for a body over max_bytes: by its Content-Length, and by the bytes actually received."""

    async def guarded(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                invalid = declared.decode(errors="replace")
                return await send_error(scope, receive, send, 400, f"invalid Content-Length header: {invalid!r}")
            if int(declared) > max_bytes:
                detail = f"request body is {int(declared)} bytes; the limit is {max_bytes}"
                return await send_error(scope, receive, send, 413, detail)
        # Read the whole body here (it is small by construction) so a chunked upload cannot exceed the limit.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > max_bytes:
                detail = f"request body exceeds the limit of {max_bytes} bytes"
                return await send_error(scope, receive, send, 413, detail)
            if not message.get("more_body", False):
                break
        body_sent = False

        async def replay() -> dict:
            nonlocal body_sent
            if body_sent:
                return await receive()  # after the body, pass through http.disconnect
            body_sent = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        return await app(scope, replay, send)

    return guarded


def require_api_key(app: Callable, api_key: str) -> Callable:
    """401 unless `Authorization: Bearer <api_key>`; checked before the body is read or validated."""
    expected = f"Bearer {api_key}".encode()

    async def guarded(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] in AUTHENTICATED_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, expected):
                reason = "missing Authorization header" if not given else "invalid API key"
                detail = f"{reason}: send 'Authorization: Bearer <key>'"
                return await send_error(scope, receive, send, 401, detail, {"WWW-Authenticate": "Bearer"})
        return await app(scope, receive, send)

    return guarded


def add_response_header(app: Callable, name: str, value: str) -> Callable:
    """Put `name: value` on every HTTP response, the guards' refusals included (X-Draft-Replica: a router
    or a client can tell which replica answered)."""
    header = (name.lower().encode(), value.encode())

    async def with_header(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        return await app(scope, receive, send_with_header)

    return with_header


def measure_requests(app: Callable, metrics: Metrics) -> Callable:
    """Count every response by endpoint and status, and time it; unknown paths share one label."""

    async def measured(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in MEASURED_PATHS else "other"
        started = time.perf_counter()
        status = 500  # what the client sees if the app raises before starting a response

        async def send_and_record(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await app(scope, receive, send_and_record)
        finally:
            metrics.requests.labels(endpoint, str(status)).inc()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - started)

    return measured


def replica_name(host: str, port: int) -> str:
    """host:port as a router reaches this replica; a wildcard bind address says nothing, the host name does."""
    return f"{socket.gethostname() if host in ('0.0.0.0', '::', '') else host}:{port}"


def describe_validation_errors(errors: Sequence[dict], shown: int = 5) -> str:
    """pydantic errors as one line a person can act on: 'body.max_tokens: Input should be ...; ...'."""
    parts = []
    for error in errors[:shown]:
        if error["type"] == "json_invalid":
            parts.append(f"body is not valid JSON (at character {error['loc'][-1]}): {error['ctx']['error']}")
        else:
            parts.append(f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}")
    if len(errors) > shown:
        parts.append(f"... and {len(errors) - shown} more errors")
    return "; ".join(parts)
