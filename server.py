"""HTTP draft server: POST /draft returns greedy draft tokens from the drafter in a model package.

Reads a model package (or a plain Hugging Face checkpoint directory) with `draft_model.load_model`;
writes nothing but logs. Concurrent requests are grouped by one asyncio batcher (batcher.py) and drafted
by `draft_model.draft_batch` on the drafting thread, the thread that loaded the model. Endpoints: POST /draft,
POST /draft/batch, GET /health, GET /metrics (Prometheus text), GET /docs (OpenAPI). See README.md for the API
and every error.

    python server.py --model-dir model --host 127.0.0.1 --port 8000

Operators normally start it through ./serve.sh, which maps environment variables to these flags.
SIGTERM drains: new drafts and /health answer 503, queued requests are answered, then the server exits 0.
"""

import asyncio
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import fastapi
import torch
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline

import draft_model
import server_settings
from api_schema import BatchItemResult, BatchResponse, DraftResponse, ErrorResponse, request_models
from batcher import Batcher, DraftFailed, DraftRequest, PendingDraft, Unavailable, draft_requests, drafting_thread
from http_guards import (
    add_response_header,
    describe_validation_errors,
    limit_body_size,
    measure_requests,
    replica_name,
    require_api_key,
)
from metrics import Metrics
from server_settings import ConfigError, ServerSettings

log = logging.getLogger("draft_server")

RETRY_AFTER_SECONDS = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up first: counted in /metrics, never sent
REPLICA_HEADER = "X-Draft-Replica"
HEALTH_LIMITS = (
    "max_draft_tokens",
    "max_batch_size",
    "max_wait_ms",
    "regroup_wait_ms",
    "max_queue",
    "queue_deadline_s",
    "max_body_bytes",
)


# ----------------------------------------------------------------------------- request / response


class DraftError(Exception):
    """One draft request's error status; /draft raises it as an HTTP error, /draft/batch reports it per item."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail

    def as_http(self) -> fastapi.HTTPException:
        retry = {"Retry-After": str(RETRY_AFTER_SECONDS)} if self.status == 503 else None
        return fastapi.HTTPException(self.status, self.detail, retry)


def kept_tokens(token_ids: list[int], max_context: int, max_tokens: int) -> int:
    """Where a truncated request starts: the last tokens that leave room for max_tokens drafts, cut at a
    multiple of a quarter context so that the next turns of the conversation start at the same token
    and still find their prefix in the cache (a window sliding token by token would never match)."""
    room = max(max_context - max_tokens, 1)
    if len(token_ids) <= room:
        return 0
    stride = max(max_context // 4, 1)
    start = -(-(len(token_ids) - room) // stride) * stride  # rounded up to a stride
    return min(start, len(token_ids) - 1)


# ----------------------------------------------------------------------------- app

ERROR_RESPONSES = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {
        400: "Token ids outside the vocabulary, empty, or longer than the context (without truncate)",
        401: "Missing or wrong API key (only when the server has one)",
        413: "Request body too large",
        422: "Body does not fit the schema",
        500: "Drafting failed for this request's batch",
        503: "Queue full, queue deadline passed, or draining; retry after Retry-After seconds",
    }.items()
}


class DraftService:
    """What the routes ask of the loaded drafter: check a request against the model, queue it on the batcher,
    turn its draft into an answer, report health. The batcher starts in the lifespan (it needs the loop)."""

    def __init__(self, settings: ServerSettings, drafter: draft_model.Drafter, drafting: ThreadPoolExecutor):
        self.settings, self.drafter, self.drafting = settings, drafter, drafting
        self.metrics = Metrics(settings.max_batch_size)
        self.vocabulary = drafter.model_card.get("vocabulary")
        self.replica = replica_name(settings.host, settings.port)
        self.batcher: Batcher  # set by lifespan

    @asynccontextmanager
    async def lifespan(self, app: fastapi.FastAPI):
        self.batcher = Batcher(
            functools.partial(draft_requests, self.drafter),
            self.drafting,
            max_batch_size=self.settings.max_batch_size,
            max_wait_ms=self.settings.max_wait_ms,
            regroup_wait_ms=self.settings.regroup_wait_ms,
            max_queue=self.settings.max_queue,
            queue_deadline_s=self.settings.queue_deadline_s,
            metrics=self.metrics,
        )
        self.batcher.start()
        yield
        # uvicorn calls this after in-flight requests have been answered; drain whatever is still queued.
        await self.batcher.stop()
        log.info("batcher stopped; all queued requests answered")

    def submit(self, body) -> tuple[PendingDraft, int]:
        """Check a /draft body or /draft/batch item against the model and queue it: (pending draft, ids truncated)."""
        drafter, settings = self.drafter, self.settings
        start = kept_tokens(body.token_ids, drafter.max_context, body.max_tokens) if body.truncate else 0
        token_ids = body.token_ids[start:]
        problem = draft_model.token_ids_problem(token_ids, drafter.vocab_size, drafter.max_context, self.vocabulary)
        if problem:
            hint = '; send "truncate": true to draft from the most recent ids' if "context limit" in problem else ""
            raise DraftError(400, f"token_ids: {problem}{hint}")
        min_confidence = settings.min_confidence if body.min_confidence is None else body.min_confidence
        min_match = settings.lookup_min_match if body.lookup_min_match is None else body.lookup_min_match
        queued = DraftRequest(tuple(token_ids), body.max_tokens, min_confidence, min_match, body.return_logprobs)
        try:
            pending = self.batcher.submit(queued)
        except Unavailable as reason:
            raise DraftError(503, f"{reason}; retry after {RETRY_AFTER_SECONDS} s") from None
        return pending, start

    async def answer(self, pending: PendingDraft, truncated: int, client_left) -> DraftResponse | None:
        """The draft of a queued request; None when the client hung up first."""
        try:
            result = await self.batcher.wait(pending, client_left)
        except Unavailable as reason:
            raise DraftError(503, f"{reason}; retry after {RETRY_AFTER_SECONDS} s") from None
        except DraftFailed as failure:
            raise DraftError(500, str(failure)) from None
        if result is None:
            return None
        return DraftResponse(
            draft_token_ids=list(result),
            cached_tokens=result.cached_tokens,
            logprobs=list(result.logprobs) if pending.request.return_logprobs and result.logprobs is not None else None,
            source=result.source,
            truncated_tokens=truncated,
        )

    async def batch_item_result(
        self, submitted: tuple[PendingDraft, int] | DraftError, client_left
    ) -> BatchItemResult | None:
        """One /draft/batch item's result, from what submit gave for it; None when the client hung up first."""
        if isinstance(submitted, DraftError):
            return BatchItemResult(status=submitted.status, detail=submitted.detail)
        try:
            response = await self.answer(*submitted, client_left)
        except DraftError as error:
            return BatchItemResult(status=error.status, detail=error.detail)
        return None if response is None else BatchItemResult(status=200, draft=response)

    def health(self) -> dict:
        if not self.batcher.running:  # nothing would ever answer /draft: say so to the balancer
            raise DraftError(503, "the batcher is not running; restart the server").as_http()
        if not self.batcher.accepting:
            raise DraftError(503, "draining: this replica answers what it has queued, then stops").as_http()
        return {
            "status": "ok",
            "pid": os.getpid(),
            "replica": self.replica,
            "model": self.drafter.describe(),
            "random_weights": bool(self.drafter.model_card.get("random_weights", False)),
            "queue_depth": self.batcher.queue.qsize(),
            "limits": {"vocab_size": self.drafter.vocab_size, "max_context": self.drafter.max_context}
            | {name: getattr(self.settings, name) for name in HEALTH_LIMITS},
            "auth_required": self.settings.api_key is not None,
        }


def add_draft_routes(app: fastapi.FastAPI, service: DraftService) -> None:
    """POST /draft and POST /draft/batch, their bodies built for the loaded model's limits."""
    drafter, settings = service.drafter, service.settings
    DraftBody, BatchBody = request_models(
        drafter.vocab_size, drafter.max_context, settings.max_draft_tokens, settings.max_queue
    )

    @app.post("/draft", response_model=DraftResponse, responses=ERROR_RESPONSES)
    async def draft(request: DraftBody, http_request: fastapi.Request) -> DraftResponse | Response:  # type: ignore[valid-type]
        client_left = asyncio.ensure_future(http_request.receive())  # the body is read: only a disconnect is left
        try:
            response = await service.answer(*service.submit(request), client_left)
        except DraftError as error:
            raise error.as_http() from None
        finally:
            client_left.cancel()
        return Response(status_code=CLIENT_CLOSED_REQUEST) if response is None else response

    @app.post("/draft/batch", response_model=BatchResponse, responses=ERROR_RESPONSES)
    async def draft_batch(batch: BatchBody, http_request: fastapi.Request) -> BatchResponse | Response:  # type: ignore[valid-type]
        """Several draft requests in one round trip; each item gets the status /draft would have given it."""
        client_left = asyncio.ensure_future(http_request.receive())
        queued: list[tuple[PendingDraft, int] | DraftError] = []
        for item in batch.items:  # all queued before any is awaited, so they can share a batch
            try:
                queued.append(service.submit(item))
            except DraftError as error:
                queued.append(error)
        answers = (service.batch_item_result(submitted, client_left) for submitted in queued)
        try:
            results = await asyncio.gather(*answers)
        finally:
            client_left.cancel()
        if any(r is None for r in results):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return BatchResponse(results=results)


def add_status_routes(app: fastapi.FastAPI, service: DraftService) -> None:
    """GET /health for load balancers and GET /metrics for Prometheus."""

    @app.get("/health")
    async def health() -> dict:
        return service.health()

    @app.get("/metrics", response_class=Response)
    async def metrics_text() -> Response:
        return Response(service.metrics.text(), media_type=service.metrics.content_type)


async def schema_error(request: fastapi.Request, error: RequestValidationError) -> JSONResponse:
    detail = describe_validation_errors(error.errors())
    content_type = request.headers.get("content-type", "")
    if request.method == "POST" and not content_type.startswith("application/json"):
        sent_as = content_type or "no content type"
        detail += f" (the body was sent as {sent_as!r}; send JSON with Content-Type: application/json)"
    return JSONResponse({"detail": detail}, status_code=422)


async def unexpected_error(request: fastapi.Request, error: Exception) -> JSONResponse:
    # Starlette re-raises after this response is sent, so uvicorn logs the traceback (server side only).
    return JSONResponse({"detail": "internal server error; the server log has the details"}, status_code=500)


def create_app(settings: ServerSettings, drafter: draft_model.Drafter, drafting: ThreadPoolExecutor) -> fastapi.FastAPI:
    """The FastAPI app around a drafter loaded on `drafting` (batcher.drafting_thread()), which drafts its
    batches; the batcher starts in the lifespan (it needs the loop)."""
    service = DraftService(settings, drafter, drafting)
    app = FastAPIOffline(  # FastAPI serving /docs' Swagger UI files itself: the page works with no network
        title="Draft server",
        version="1",
        description=f"Greedy draft tokens from {drafter.describe()['name']}, for speculative decoding.",
        lifespan=service.lifespan,
        exception_handlers={RequestValidationError: schema_error, Exception: unexpected_error},
    )
    app.state.service = service  # main drains its batcher on SIGTERM
    add_draft_routes(app, service)
    add_status_routes(app, service)
    # The last middleware added runs first: name the replica, count and time everything, then authenticate,
    # then size the body.
    app.add_middleware(limit_body_size, max_bytes=settings.max_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(require_api_key, api_key=settings.api_key)
    app.add_middleware(measure_requests, metrics=service.metrics)
    app.add_middleware(add_response_header, name=REPLICA_HEADER, value=service.replica)
    return app


# ----------------------------------------------------------------------------- start-up and shutdown


def load_drafter(settings: ServerSettings) -> draft_model.Drafter:
    """Check that the configuration fits in memory, load the model and draft once (a broken model fails
    here, and the first client is not the warm-up). Raises ConfigError with one line for the operator."""
    try:
        problem = server_settings.port_problem(settings.host, settings.port) or server_settings.memory_problem(settings)
        if problem:
            raise ConfigError(problem)
        drafter = draft_model.load_model(
            settings.model_dir,
            settings.device,
            settings.dtype,
            cache_slots=settings.slots,
            max_context=settings.max_context,
            weights=settings.weights,
            verify_integrity=not settings.skip_integrity_check,
            compiled=settings.compiled,
            batch_buckets=settings.batch_buckets,
            int4_kernel=settings.int4_kernel,
            attention_kernel=settings.attention_kernel,
        )
    except draft_model.ModelLoadError as error:
        raise ConfigError(f"cannot load the model from --model-dir {settings.model_dir}: {error}") from None
    try:
        drafter.warm_up(settings.max_batch_size)
    except Exception as error:  # a compiler failure can be of any type; the operator needs one line
        if not settings.compiled:
            raise
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"compiling the decode step failed ({reason}); start with --compile off (COMPILE=0)"
        ) from None
    return drafter


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM or SIGINT drains before uvicorn's graceful shutdown begins:
    /health and new drafts answer 503 while everything queued is answered, for at least drain_seconds
    so that routers' health checks see this replica leave; then uvicorn stops listening and exits."""

    def __init__(self, config: uvicorn.Config, drain: Callable, drain_seconds: float):
        super().__init__(config)
        self.drain, self.drain_seconds, self.draining = drain, drain_seconds, False

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.draining or not self.started:
            return super().handle_exit(sig, frame)  # a second signal, or one during start-up: uvicorn's own way
        self.draining = True
        log.info("signal %d: draining (new requests get 503; queued ones are answered)", sig)
        self.loop.call_soon_threadsafe(self.loop.create_task, self.drain_then_exit())

    async def drain_then_exit(self) -> None:
        await asyncio.gather(self.drain(), asyncio.sleep(self.drain_seconds))
        self.should_exit = True


def refuse(message: str, status: int) -> None:
    print(f"server.py: error: {message}", file=sys.stderr)
    sys.exit(status)


def main(argv: Sequence[str] | None = None) -> None:
    # A signal during start-up, and the one uvicorn re-delivers after a forced stop, end the process: at once
    # while the kernels build on this thread (unwinding, so torch removes its build lock), or once the load in
    # hand returns on the drafting thread, which cannot be interrupted (and may be building a kernel too).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(0))
    settings = server_settings.parse_args(argv, __doc__)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if not draft_model.reuse_freed_memory():
        log.info("malloc is not glibc's: freed prefill buffers go back to the OS (long prefills run slower)")
    started = time.perf_counter()
    drafting = drafting_thread()
    try:
        drafter = drafting.submit(load_drafter, settings).result()
    except ConfigError as problem:
        refuse(str(problem), status=2)
    except Exception as error:  # the operator gets one line; --log-level debug adds the traceback
        log.debug("start-up failed", exc_info=True)
        refuse(f"cannot start: {type(error).__name__}: {error} (--log-level debug shows the traceback)", status=1)
    log.info("%s", server_settings.startup_summary(drafter.describe(), settings, time.perf_counter() - started))
    app = create_app(settings, drafter, drafting)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level,
        access_log=settings.access_log,
    )
    DrainingServer(config, drain=lambda: app.state.service.batcher.drain(), drain_seconds=settings.drain_seconds).run()


if __name__ == "__main__":
    main()
