"""HTTP draft server: POST /draft returns greedy draft tokens from the drafter in a model package.

Reads a model package (or a plain Hugging Face checkpoint directory) with `draft_model.load_model`;
writes nothing but logs. Concurrent requests are grouped by one asyncio batcher and drafted by
`draft_model.draft_batch` in a single worker thread. Endpoints: POST /draft, GET /health,
GET /metrics (Prometheus text), GET /docs (OpenAPI). See README.md for the API and every error.

    python server.py --model-dir model --host 127.0.0.1 --port 8000

Operators normally start it through ./serve.sh, which maps environment variables to these flags.
"""

import argparse
import asyncio
import functools
import hmac
import logging
import math
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import fastapi
import prometheus_client
import torch
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

import draft_model

log = logging.getLogger("draft_server")

RETRY_AFTER_SECONDS = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up first: counted in /metrics, never sent
AUTHENTICATED_PATHS = ("/draft",)  # /health, /metrics and /docs stay open: they carry no secrets


@dataclass(frozen=True)
class ServerSettings:
    model_dir: Path
    max_batch_size: int = 16
    max_wait_ms: float = 2.0
    max_queue: int = 256
    max_draft_tokens: int = 64
    min_confidence: float = 0.0  # adaptive draft length for requests that do not choose; 0: always max_tokens
    lookup_min_match: int = 0  # hybrid drafting for requests that do not choose; 0: always the model
    cache_slots: int | None = None  # None: 2 * max_batch_size
    max_context: int | None = None  # None: the model's own limit (draft_model caps it at 4096)
    device: str = "auto"
    dtype: str = "auto"
    weights: str = "auto"  # draft_model's weight path: "packed" INT4 kernel, "dequant" dense, "auto" packs when it can
    api_key: str | None = None
    max_body_bytes: int = 1 << 20

    @property
    def slots(self) -> int:
        return self.cache_slots if self.cache_slots is not None else 2 * self.max_batch_size


# ----------------------------------------------------------------------------- request / response


def draft_request_model(max_draft_tokens: int) -> type[BaseModel]:
    """The /draft body schema; built per app so the max_tokens bound in /docs is the server's own."""

    class DraftRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        token_ids: list[StrictInt] = Field(
            description="Token ids of the conversation so far: 1..max_context ids, each in 0..vocab_size-1.",
            examples=[[151644, 872, 198]],
        )
        max_tokens: StrictInt = Field(
            default=min(16, max_draft_tokens), ge=1, le=max_draft_tokens, description="Most draft tokens to return."
        )
        return_logprobs: StrictBool = Field(
            default=False, description="Also return the drafter's log-probability of each draft token."
        )
        min_confidence: float | None = Field(
            default=None,
            ge=0.0,
            le=1.0,
            description="Adaptive draft length: stop after a draft token whose probability is below this "
            "(that token is still returned). Default: the server's --min-confidence.",
        )
        lookup_min_match: StrictInt | None = Field(
            default=None,
            ge=0,
            le=draft_model.LOOKUP_MAX_MATCH,
            description="Hybrid drafting: when token_ids end in an n-gram of at least this many tokens that occurred "
            "earlier in token_ids, return what followed it (source 'lookup') instead of a model draft; 0: off. "
            "Default: the server's --lookup-min-match.",
        )

    return DraftRequest


class DraftResponse(BaseModel):
    draft_token_ids: list[int] = Field(
        description="Greedy draft tokens; fewer than max_tokens at EOS or the context limit."
    )
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the prefix cache.")
    logprobs: list[float] | None = Field(
        description="Log-probability of each draft token, if asked for (null for a lookup draft: no model ran)."
    )
    source: Literal["model", "lookup"] = Field(
        description="'model': the drafter's greedy tokens; 'lookup': copied from token_ids (hybrid drafting)."
    )


class ErrorResponse(BaseModel):
    detail: str


def token_ids_problem(
    token_ids: list[int], vocab_size: int, max_context: int, vocabulary: str | None = None
) -> str | None:
    """Why the model cannot take `token_ids` (naming the offending position and the limit), or None.
    `vocabulary` (the model card's) names the tokenizer, since ids from another one are the likely cause."""
    if not token_ids:
        return "token_ids is empty: send at least one token id"
    if len(token_ids) > max_context:
        return f"token_ids has {len(token_ids)} tokens; the context limit is {max_context}"
    for position, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            tokenizer = (
                f" (this drafter reads {vocabulary}; ids from another tokenizer do not fit)" if vocabulary else ""
            )
            return f"token_ids[{position}] = {token_id} is outside the vocabulary: ids must be in 0..{vocab_size - 1}{tokenizer}"
    return None


# ----------------------------------------------------------------------------- metrics


class Metrics:
    """Prometheus metrics in a registry of their own, so two apps in one process never collide."""

    def __init__(self, max_batch_size: int):
        self.registry = prometheus_client.CollectorRegistry()
        r = self.registry
        self.requests = prometheus_client.Counter(
            "draft_server_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.latency = prometheus_client.Histogram(
            "draft_server_request_latency_seconds",
            "Time from request arrival to response, by endpoint",
            ["endpoint"],
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        batch_buckets = sorted({2**i for i in range(int(math.log2(max_batch_size)) + 1)} | {max_batch_size})
        self.batch_size = prometheus_client.Histogram(
            "draft_server_batch_size", "Requests per draft_batch call", registry=r, buckets=batch_buckets
        )
        self.batch_seconds = prometheus_client.Histogram(
            "draft_server_batch_seconds",
            "Time spent inside draft_batch per batch",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.failed_batches = prometheus_client.Counter(
            "draft_server_failed_batches", "draft_batch calls that raised", registry=r
        )
        self.prompt_tokens = prometheus_client.Counter(
            "draft_server_prompt_tokens",
            "Prompt tokens of the requests the model drafted (not lookup drafts)",
            registry=r,
        )
        self.cached_tokens = prometheus_client.Counter(
            "draft_server_cached_tokens", "Prompt tokens whose KV came from the prefix cache", registry=r
        )
        self.cached_ratio = prometheus_client.Gauge(
            "draft_server_cached_token_ratio", "cached_tokens / prompt_tokens since start", registry=r
        )
        self.draft_tokens = prometheus_client.Counter("draft_server_draft_tokens", "Draft tokens returned", registry=r)
        self.lookup_drafts = prometheus_client.Counter(
            "draft_server_lookup_drafts", "Drafts copied from the request's own tokens (hybrid drafting)", registry=r
        )
        self.queue_depth = prometheus_client.Gauge(
            "draft_server_queue_depth", "Requests waiting for the batcher", registry=r
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


# ----------------------------------------------------------------------------- batcher


class Unavailable(Exception):
    """The batcher cannot take a request now (queue full, or shutting down): a 503."""


class DraftFailed(Exception):
    """draft_batch raised for the batch this request was in: a 500."""


async def draft_unless_client_leaves(future: asyncio.Future, request: fastapi.Request) -> draft_model.Draft | None:
    """The draft, or None when the client disconnects first: then its future is cancelled, so a
    request still queued is skipped by the batcher instead of costing a draft nobody reads."""
    # The body has been read; the only message left to receive is http.disconnect.
    client_left = asyncio.ensure_future(request.receive())
    try:
        done, _ = await asyncio.wait({future, client_left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        client_left.cancel()
    if future in done:
        return future.result()
    future.cancel()
    return None


@dataclass
class PendingDraft:
    token_ids: list[int]
    max_tokens: int
    min_confidence: float
    lookup_min_match: int
    return_logprobs: bool
    future: asyncio.Future = field(repr=False)


# draft_fn(batch, max_tokens, min_confidence, lookup_min_match, return_logprobs) -> one Draft per row:
# draft_model.draft_batch bound to a model, with one max_tokens, min_confidence and lookup_min_match per row.
DraftFn = Callable[[list[list[int]], list[int], list[float], list[int], bool], list[draft_model.Draft]]


class Batcher:
    """Groups queued requests into batches and drafts each batch in one worker thread.

    The model runs one batch at a time; requests that arrive meanwhile wait in the bounded queue and
    form the next batch. A batch that raises fails only its own requests.
    """

    def __init__(self, draft_fn: DraftFn, max_batch_size: int, max_wait_ms: float, max_queue: int, metrics: Metrics):
        self.draft_fn = draft_fn
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self.metrics = metrics
        self.queue: asyncio.Queue[PendingDraft] = asyncio.Queue(maxsize=max_queue)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-worker")
        self.task: asyncio.Task | None = None
        self.accepting = False
        metrics.queue_depth.set_function(self.queue.qsize)

    def start(self) -> None:
        self.accepting = True
        self.task = asyncio.create_task(self._run(), name="batcher")

    async def stop(self) -> None:
        """Refuse new work, draft everything already queued, then stop the task and the worker thread."""
        self.accepting = False
        await self.queue.join()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.worker.shutdown(wait=True)

    def submit(
        self, token_ids: list[int], max_tokens: int, min_confidence: float, lookup_min_match: int, return_logprobs: bool
    ) -> asyncio.Future:
        if not self.accepting:
            raise Unavailable("the server is shutting down")
        future = asyncio.get_running_loop().create_future()
        pending = PendingDraft(token_ids, max_tokens, min_confidence, lookup_min_match, return_logprobs, future)
        try:
            self.queue.put_nowait(pending)
        except asyncio.QueueFull:
            raise Unavailable(
                f"the draft queue is full ({self.queue.maxsize} waiting, the --max-queue limit)"
            ) from None
        return pending.future

    async def _run(self) -> None:
        while True:
            batch = await self._next_batch()
            try:
                # A client that went away cancelled its future; drafting for it would be wasted work.
                live = [pending for pending in batch if not pending.future.cancelled()]
                if live:
                    await self._draft(live)
            finally:
                for _ in batch:
                    self.queue.task_done()

    async def _next_batch(self) -> list[PendingDraft]:
        """Wait for one request, then take more until the batch is full or max_wait has passed."""
        batch = [await self.queue.get()]
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch_size:
            try:
                batch.append(self.queue.get_nowait())
                continue
            except asyncio.QueueEmpty:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), remaining))
            except TimeoutError:
                break
        return batch

    async def _draft(self, batch: list[PendingDraft]) -> None:
        prompts = [pending.token_ids for pending in batch]
        max_tokens = [pending.max_tokens for pending in batch]
        min_confidence = [pending.min_confidence for pending in batch]
        lookup_min_match = [pending.lookup_min_match for pending in batch]
        want_logprobs = any(pending.return_logprobs for pending in batch)
        call = functools.partial(self.draft_fn, prompts, max_tokens, min_confidence, lookup_min_match, want_logprobs)
        started = time.perf_counter()
        try:
            drafts = await asyncio.get_running_loop().run_in_executor(self.worker, call)
            if len(drafts) != len(batch):
                raise RuntimeError(f"draft_batch returned {len(drafts)} drafts for {len(batch)} sequences")
            self.metrics.record_batch(prompts, drafts, time.perf_counter() - started)
        except Exception as error:
            self.metrics.failed_batches.inc()
            log.exception("draft_batch failed for a batch of %d requests", len(batch))
            message = f"drafting failed for this request's batch: {type(error).__name__}: {error}"
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(DraftFailed(message))
            return
        for pending, draft in zip(batch, drafts, strict=True):
            if not pending.future.done():  # done = cancelled by a client that disconnected mid-batch
                pending.future.set_result(draft)


# ----------------------------------------------------------------------------- ASGI guards


async def send_error(
    scope: dict, receive: Callable, send: Callable, status: int, detail: str, headers: dict[str, str] | None = None
) -> None:
    await JSONResponse({"detail": detail}, status_code=status, headers=headers)(scope, receive, send)


def limit_body_size(app: Callable, max_bytes: int) -> Callable:
    """413 for a body over max_bytes: by its Content-Length, and by the bytes actually received."""

    async def guarded(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
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


def measure_requests(app: Callable, metrics: Metrics) -> Callable:
    """Count every response by endpoint and status, and time it; unknown paths share one label."""
    known = {"/draft", "/health", "/metrics"}

    async def measured(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in known else "other"
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


# ----------------------------------------------------------------------------- app


def create_app(settings: ServerSettings) -> fastapi.FastAPI:
    """The FastAPI app; the model loads in its lifespan, so building the app is cheap."""
    metrics = Metrics(settings.max_batch_size)
    state: dict = {}  # "drafter" and "batcher", set in the lifespan

    @asynccontextmanager
    async def lifespan(app: fastapi.FastAPI):
        started = time.perf_counter()
        try:
            drafter = await asyncio.to_thread(
                draft_model.load_model,
                settings.model_dir,
                settings.device,
                settings.dtype,
                cache_slots=settings.slots,
                max_context=settings.max_context,
                weights=settings.weights,
            )
        except draft_model.ModelLoadError as error:
            log.error("cannot load the model: %s", error)
            raise SystemExit(1) from None
        # One tiny draft now, so a broken model fails at startup and the first client is not the warm-up.
        await asyncio.to_thread(draft_model.draft_batch, drafter, [[0]], max_tokens=1)
        load_seconds = time.perf_counter() - started

        def draft_fn(
            batch: list[list[int]],
            max_tokens: list[int],
            min_confidence: list[float],
            lookup_min_match: list[int],
            return_logprobs: bool,
        ) -> list[draft_model.Draft]:
            return draft_model.draft_batch(
                drafter,
                batch,
                max_tokens,
                return_logprobs,
                min_confidence=min_confidence,
                lookup_min_match=lookup_min_match,
            )

        batcher = Batcher(draft_fn, settings.max_batch_size, settings.max_wait_ms, settings.max_queue, metrics)
        state.update(drafter=drafter, batcher=batcher)
        batcher.start()
        log.info("%s", startup_summary(drafter.describe(), settings, load_seconds))
        yield
        # uvicorn calls this after in-flight requests have been answered; drain whatever is still queued.
        await batcher.stop()
        log.info("batcher stopped; all queued requests answered")

    app = fastapi.FastAPI(
        title="Draft server",
        version="1",
        description="Greedy draft tokens from a small drafter, for speculative decoding.",
        lifespan=lifespan,
    )
    DraftRequest = draft_request_model(settings.max_draft_tokens)
    error_responses = {
        code: {"model": ErrorResponse, "description": text}
        for code, text in {
            400: "Token ids outside the vocabulary, empty, or longer than the context",
            401: "Missing or wrong API key (only when the server has one)",
            413: "Request body too large",
            422: "Body does not fit the schema",
            500: "Drafting failed for this request's batch",
            503: "Queue full or shutting down; retry after Retry-After seconds",
        }.items()
    }

    @app.post("/draft", response_model=DraftResponse, responses=error_responses)
    async def draft(request: DraftRequest, http_request: fastapi.Request) -> DraftResponse | Response:  # type: ignore[valid-type]
        drafter = state["drafter"]
        problem = token_ids_problem(
            request.token_ids, drafter.vocab_size, drafter.max_context, drafter.model_card.get("vocabulary")
        )
        if problem:
            raise fastapi.HTTPException(400, problem)
        try:
            min_confidence = settings.min_confidence if request.min_confidence is None else request.min_confidence
            min_match = settings.lookup_min_match if request.lookup_min_match is None else request.lookup_min_match
            future = state["batcher"].submit(
                request.token_ids, request.max_tokens, min_confidence, min_match, request.return_logprobs
            )
        except Unavailable as reason:
            raise fastapi.HTTPException(
                503, f"{reason}; retry after {RETRY_AFTER_SECONDS} s", {"Retry-After": str(RETRY_AFTER_SECONDS)}
            ) from None
        try:
            result = await draft_unless_client_leaves(future, http_request)
        except DraftFailed as failure:
            raise fastapi.HTTPException(500, str(failure)) from None
        if result is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return DraftResponse(
            draft_token_ids=list(result),
            cached_tokens=result.cached_tokens,
            logprobs=list(result.logprobs) if request.return_logprobs and result.logprobs is not None else None,
            source=result.source,
        )

    @app.get("/health")
    async def health() -> dict:
        drafter, batcher = state["drafter"], state["batcher"]
        if batcher.task is None or batcher.task.done():  # nothing would ever answer /draft: say so to the balancer
            raise fastapi.HTTPException(
                503, "the batcher is not running; restart the server", {"Retry-After": str(RETRY_AFTER_SECONDS)}
            )
        return {
            "status": "ok",
            "model": drafter.describe(),
            "random_weights": bool(drafter.model_card.get("random_weights", False)),
            "queue_depth": batcher.queue.qsize(),
            "limits": {
                "vocab_size": drafter.vocab_size,
                "max_context": drafter.max_context,
                "max_draft_tokens": settings.max_draft_tokens,
                "max_batch_size": settings.max_batch_size,
                "max_wait_ms": settings.max_wait_ms,
                "max_queue": settings.max_queue,
                "max_body_bytes": settings.max_body_bytes,
            },
            "auth_required": settings.api_key is not None,
        }

    @app.get("/metrics", response_class=Response)
    async def metrics_text() -> Response:
        return Response(
            prometheus_client.generate_latest(metrics.registry), media_type=prometheus_client.CONTENT_TYPE_LATEST
        )

    @app.exception_handler(RequestValidationError)
    async def schema_error(request: fastapi.Request, error: RequestValidationError) -> JSONResponse:
        detail = describe_validation_errors(error.errors())
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and not content_type.startswith("application/json"):
            sent_as = content_type or "no content type"
            detail += f" (the body was sent as {sent_as!r}; send JSON with Content-Type: application/json)"
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(Exception)
    async def unexpected_error(request: fastapi.Request, error: Exception) -> JSONResponse:
        # Starlette re-raises after this response is sent, so uvicorn logs the traceback (server side only).
        return JSONResponse({"detail": "internal server error; the server log has the details"}, status_code=500)

    # The last middleware added runs first: count and time everything, then authenticate, then size the body.
    app.add_middleware(limit_body_size, max_bytes=settings.max_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(require_api_key, api_key=settings.api_key)
    app.add_middleware(measure_requests, metrics=metrics)
    return app


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


def startup_summary(identity: dict, settings: ServerSettings, load_seconds: float) -> str:
    """One log line: what is being served, where, and how it was configured."""
    quant = identity["quantization"]
    quant_text = f"{quant['method']} int{quant['bits']} g{quant['group_size']}" if quant else "unquantized"
    random_text = "RANDOM WEIGHTS, " if identity["model_card"].get("random_weights") else ""
    return (
        f"loaded {identity['name']} from {settings.model_dir} in {load_seconds:.2f} s: {identity['architecture']}, "
        f"{identity['num_layers']} layers, vocab {identity['vocab_size']}, {quant_text}, "
        f"lora r={identity['lora_rank']}, {random_text}device {identity['device']}, dtype {identity['dtype']}, "
        f"weights {identity['weights']}, max_context {identity['max_context']}, "
        f"cache_slots {identity['cache_slots']}, max_batch_size {settings.max_batch_size}, "
        f"threads {torch.get_num_threads()}, auth {'on' if settings.api_key else 'off'}"
    )


# ----------------------------------------------------------------------------- command line


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def tcp_port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def lookup_match(text: str) -> int:
    value = int(text)
    if not 0 <= value <= draft_model.LOOKUP_MAX_MATCH:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or 1..{draft_model.LOOKUP_MAX_MATCH}, got {text}")
    return value


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the module docstring's layout and show every flag's default."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True, help="model package or HF checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback: only this machine can connect)")
    parser.add_argument("--port", type=tcp_port, default=8000, help="TCP port")
    parser.add_argument("--max-batch-size", type=positive_int, default=16, help="most requests per draft_batch call")
    parser.add_argument(
        "--max-wait-ms", type=non_negative_float, default=2.0, help="how long a started batch waits for more requests"
    )
    parser.add_argument(
        "--max-queue", type=positive_int, default=256, help="requests that may wait for the batcher; beyond it: 503"
    )
    parser.add_argument(
        "--max-draft-tokens", type=positive_int, default=64, help="largest max_tokens a request may ask"
    )
    parser.add_argument(
        "--min-confidence",
        type=probability,
        default=0.0,
        help="adaptive draft length for requests that do not set min_confidence: stop after a draft token whose "
        "probability is below this (0: always max_tokens)",
    )
    parser.add_argument(
        "--lookup-min-match",
        type=lookup_match,
        default=0,
        help="hybrid drafting for requests that do not set lookup_min_match: when the request's tokens end in an "
        f"n-gram of at least this many tokens (1..{draft_model.LOOKUP_MAX_MATCH}) seen earlier in them, return what "
        "followed it instead of a model draft (0: off)",
    )
    parser.add_argument(
        "--cache-slots",
        type=positive_int,
        default=None,
        help="KV-cache slots for prefix reuse; at least 2 x --max-batch-size (None: exactly that)",
    )
    parser.add_argument(
        "--max-context",
        type=positive_int,
        default=None,
        help="longest token_ids accepted (None: the model's, capped at 4096)",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on cuda or with packed INT4 weights, else float32",
    )
    parser.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "packed", "dequant"],
        help="GPTQ weights: packed = INT4 kernel (cpu, bfloat16), dequant = dense; auto packs when it can",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads for drafting (default: one fewer than torch's one per core, at least 1: a core left to the "
        "HTTP event loop; on 2 cores a draft sharing both took 197 ms against 109 ms on one)",
    )
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="file holding the API key; then /draft needs 'Authorization: Bearer <key>'",
    )
    parser.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, help="largest request body in bytes")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="server log level"
    )
    parser.add_argument("--access-log", action="store_true", help="log every request (off: it costs throughput)")
    args = parser.parse_args(argv)

    if not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir}: no config.json there; is it a model package?")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device auto or cpu)")
    if args.cache_slots is not None and args.cache_slots < 2 * args.max_batch_size:
        parser.error(
            f"--cache-slots {args.cache_slots} is less than 2 x --max-batch-size ({2 * args.max_batch_size}): "
            "each batch needs a slot per row plus slots that keep earlier prefixes for reuse; "
            "raise --cache-slots or lower --max-batch-size"
        )
    if args.api_key_file is not None:
        try:
            args.api_key = args.api_key_file.read_text().strip()
        except OSError as error:
            parser.error(f"--api-key-file: {error}")
        if not args.api_key:
            parser.error(f"--api-key-file {args.api_key_file} is empty")
    else:
        args.api_key = None
    return args


def exit_after_graceful_shutdown(signum: int, frame) -> None:
    # uvicorn re-delivers SIGTERM/SIGINT once its graceful shutdown is done; by then every queued
    # request has been answered, so the stop was a clean one.
    sys.exit(0)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = ServerSettings(
        model_dir=args.model_dir,
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        max_draft_tokens=args.max_draft_tokens,
        min_confidence=args.min_confidence,
        lookup_min_match=args.lookup_min_match,
        cache_slots=args.cache_slots,
        max_context=args.max_context,
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
    )
    torch.set_num_threads(args.threads or max(1, torch.get_num_threads() - 1))
    if not draft_model.reuse_freed_memory():
        log.info("malloc is not glibc's: freed prefill buffers go back to the OS (long prefills run slower)")
    signal.signal(signal.SIGTERM, exit_after_graceful_shutdown)
    signal.signal(signal.SIGINT, exit_after_graceful_shutdown)
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_config=None,
        log_level=args.log_level,
        access_log=args.access_log,
    )


if __name__ == "__main__":
    main()
