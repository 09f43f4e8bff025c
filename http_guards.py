"""What wraps the draft server's routes: ASGI guards (body size, API key, the replica header, request metrics).

Each guard is a plain ASGI middleware factory, `guard(app, **options) -> app`, added with
`app.add_middleware`; each answers its refusal as the routes answer theirs, JSON with a `detail`.
"""

import hmac
import socket
import time
from collections.abc import Callable, Sequence

from fastapi.responses import JSONResponse

from metrics import Metrics

AUTHENTICATED_PATHS = ("/draft", "/draft/batch")  # /health, /metrics and /docs stay open: they carry no secrets
MEASURED_PATHS = ("/draft", "/draft/batch", "/health", "/metrics")  # every other path is counted as "other"


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
