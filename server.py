"""HTTP draft server: POST /draft returns greedy draft tokens from the drafter in a model package.

Reads a model package (or a plain Hugging Face checkpoint directory) with `draft_model.load_model`;
writes nothing but logs. Concurrent requests are grouped by one asyncio batcher (batcher.py) and drafted
by `draft_model.draft_batch` in a single worker thread. Endpoints: POST /draft, POST /draft/batch,
GET /health, GET /metrics (Prometheus text), GET /docs (OpenAPI). See README.md for the API and every error.

    python server.py --model-dir model --host 127.0.0.1 --port 8000

Operators normally start it through ./serve.sh, which maps environment variables to these flags.
SIGTERM drains: new drafts and /health answer 503, queued requests are answered, then the server exits 0.
"""

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Literal

import fastapi
import torch
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

import draft_model
import server_settings
from batcher import Batcher, DraftFailed, PendingDraft, Unavailable
from http_guards import (
    Metrics,
    add_response_header,
    describe_validation_errors,
    limit_body_size,
    measure_requests,
    replica_name,
    require_api_key,
)
from server_settings import ConfigError, ServerSettings

log = logging.getLogger("draft_server")

RETRY_AFTER_SECONDS = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up first: counted in /metrics, never sent
REPLICA_HEADER = "X-Draft-Replica"
HEALTH_LIMITS = ("max_draft_tokens", "max_batch_size", "max_wait_ms", "max_queue", "queue_deadline_s", "max_body_bytes")


# ----------------------------------------------------------------------------- request / response


def whole_number(value):
    """JSON Schema counts 6.0 as an integer, so the schema's promise holds only if it is accepted as 6;
    a bool or a string is still refused (no coercion to a number)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


JsonInt = Annotated[StrictInt, BeforeValidator(whole_number)]


def request_models(vocab_size: int, max_context: int, max_draft_tokens: int, max_items: int) -> tuple[type, type]:
    """The /draft and /draft/batch bodies, built for the loaded model so /openapi.json states its limits.

    The token-id bounds are checked by the handler, not by pydantic, so that an id from another
    tokenizer gets a 400 naming the drafter's vocabulary; within a batch that 400 is one item's answer,
    so the batch's item schema leaves the bounds out (a schema-valid batch is always answered 200)."""

    class DraftFields(BaseModel):
        model_config = ConfigDict(extra="forbid")
        token_ids: list[JsonInt] = Field(
            description=f"Token ids of the conversation so far: 1..{max_context} ids (more with truncate), "
            f"each in 0..{vocab_size - 1}.",
            examples=[[min(token_id, vocab_size - 1) for token_id in (1, 2, 3)]],
        )
        max_tokens: JsonInt = Field(
            default=min(16, max_draft_tokens), ge=1, le=max_draft_tokens, description="Most draft tokens to return."
        )
        return_logprobs: StrictBool = Field(
            default=False, description="Also return the drafter's log-probability of each draft token."
        )
        min_confidence: StrictFloat | None = Field(
            default=None,
            ge=0.0,
            le=1.0,
            description="Adaptive draft length: stop after a draft token whose probability is below this "
            "(that token is still returned). Default: the server's --min-confidence.",
        )
        lookup_min_match: (
            Annotated[StrictInt, Field(ge=0, le=draft_model.LOOKUP_MAX_MATCH), BeforeValidator(whole_number)] | None
        ) = Field(
            default=None,
            description="Hybrid drafting: when token_ids end in an n-gram of at least this many tokens that occurred "
            "earlier in token_ids, return what followed it (source 'lookup') instead of a model draft; 0: off. "
            "Default: the server's --lookup-min-match.",
        )
        truncate: StrictBool = Field(
            default=False,
            description=f"Accept more than {max_context} ids and draft from the most recent ones "
            "(truncated_tokens in the answer says how many were dropped from the front).",
        )
        session_id: StrictStr | None = Field(
            default=None, max_length=256, description="Conversation id for routers that hash the body; not used here."
        )

    def state_model_limits(schema: dict) -> None:
        schema["properties"]["token_ids"].update(
            minItems=1, items={"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
        )
        # At most max_context ids unless the request asks for truncation.
        schema["if"] = {"properties": {"truncate": {"const": True}}, "required": ["truncate"]}
        schema["else"] = {"properties": {"token_ids": {"maxItems": max_context}}}

    class DraftRequest(DraftFields):
        model_config = ConfigDict(extra="forbid", json_schema_extra=state_model_limits)

    class BatchItem(DraftFields):
        pass

    class BatchRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        items: list[BatchItem] = Field(
            min_length=1, max_length=max_items, description="Draft requests, answered in this order."
        )

    return DraftRequest, BatchRequest


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
    truncated_tokens: int = Field(default=0, description="Ids dropped from the front of token_ids (truncate).")


class BatchItemResult(BaseModel):
    status: int = Field(description="The status /draft would have answered for this item alone.")
    draft: DraftResponse | None = Field(default=None, description="The draft, when status is 200.")
    detail: str | None = Field(default=None, description="What went wrong, when status is not 200.")


class BatchResponse(BaseModel):
    results: list[BatchItemResult] = Field(description="One result per item, in the order of the items.")


class ErrorResponse(BaseModel):
    detail: str


class DraftError(Exception):
    """One draft request's error status; /draft raises it as an HTTP error, /draft/batch reports it per item."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


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


def create_app(settings: ServerSettings, drafter: draft_model.Drafter) -> fastapi.FastAPI:
    """The FastAPI app around a loaded drafter; the batcher starts in the lifespan (it needs the loop)."""
    metrics = Metrics(settings.max_batch_size)
    vocabulary = drafter.model_card.get("vocabulary")

    def draft_fn(batch, max_tokens, min_confidence, lookup_min_match, return_logprobs) -> list[draft_model.Draft]:
        options = {"min_confidence": min_confidence, "lookup_min_match": lookup_min_match}
        return draft_model.draft_batch(drafter, batch, max_tokens, return_logprobs, **options)

    @asynccontextmanager
    async def lifespan(app: fastapi.FastAPI):
        app.state.batcher = Batcher(
            draft_fn,
            max_batch_size=settings.max_batch_size,
            max_wait_ms=settings.max_wait_ms,
            max_queue=settings.max_queue,
            queue_deadline_s=settings.queue_deadline_s,
            metrics=metrics,
        )
        app.state.batcher.start()
        yield
        # uvicorn calls this after in-flight requests have been answered; drain whatever is still queued.
        await app.state.batcher.stop()
        log.info("batcher stopped; all queued requests answered")

    app = fastapi.FastAPI(
        title="Draft server",
        version="1",
        description=f"Greedy draft tokens from {drafter.describe()['name']}, for speculative decoding.",
        lifespan=lifespan,
    )
    DraftRequest, BatchRequest = request_models(
        drafter.vocab_size, drafter.max_context, settings.max_draft_tokens, settings.max_queue
    )
    error_responses = {
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

    def submit(request) -> tuple[PendingDraft, int]:
        """Check one request against the model and queue it; (its pending draft, ids truncated)."""
        start = kept_tokens(request.token_ids, drafter.max_context, request.max_tokens) if request.truncate else 0
        token_ids = request.token_ids[start:]
        problem = draft_model.token_ids_problem(token_ids, drafter.vocab_size, drafter.max_context, vocabulary)
        if problem:
            hint = '; send "truncate": true to draft from the most recent ids' if "context limit" in problem else ""
            raise DraftError(400, f"token_ids: {problem}{hint}")
        min_confidence = settings.min_confidence if request.min_confidence is None else request.min_confidence
        min_match = settings.lookup_min_match if request.lookup_min_match is None else request.lookup_min_match
        try:
            pending = app.state.batcher.submit(
                token_ids, request.max_tokens, min_confidence, min_match, request.return_logprobs
            )
        except Unavailable as reason:
            raise DraftError(503, f"{reason}; retry after {RETRY_AFTER_SECONDS} s") from None
        return pending, start

    async def answer(pending: PendingDraft, truncated: int, request, client_left) -> DraftResponse | None:
        """The draft of a queued request; None when the client hung up first."""
        try:
            result = await app.state.batcher.wait(pending, client_left)
        except Unavailable as reason:
            raise DraftError(503, f"{reason}; retry after {RETRY_AFTER_SECONDS} s") from None
        except DraftFailed as failure:
            raise DraftError(500, str(failure)) from None
        if result is None:
            return None
        return DraftResponse(
            draft_token_ids=list(result),
            cached_tokens=result.cached_tokens,
            logprobs=list(result.logprobs) if request.return_logprobs and result.logprobs is not None else None,
            source=result.source,
            truncated_tokens=truncated,
        )

    def http_error(error: DraftError) -> fastapi.HTTPException:
        retry = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 503 else None
        return fastapi.HTTPException(error.status, error.detail, retry)

    @app.post("/draft", response_model=DraftResponse, responses=error_responses)
    async def draft(request: DraftRequest, http_request: fastapi.Request) -> DraftResponse | Response:  # type: ignore[valid-type]
        client_left = asyncio.ensure_future(http_request.receive())  # the body is read: only a disconnect is left
        try:
            response = await answer(*submit(request), request, client_left)
        except DraftError as error:
            raise http_error(error) from None
        finally:
            client_left.cancel()
        return Response(status_code=CLIENT_CLOSED_REQUEST) if response is None else response

    @app.post("/draft/batch", response_model=BatchResponse, responses=error_responses)
    async def draft_batch(batch: BatchRequest, http_request: fastapi.Request) -> BatchResponse | Response:  # type: ignore[valid-type]
        """Several draft requests in one round trip; each item gets the status /draft would have given it."""
        client_left = asyncio.ensure_future(http_request.receive())
        queued: list[tuple[PendingDraft, int] | DraftError] = []
        for item in batch.items:  # all queued before any is awaited, so they can share a batch
            try:
                queued.append(submit(item))
            except DraftError as error:
                queued.append(error)

        async def result(item, submitted) -> BatchItemResult | None:
            if isinstance(submitted, DraftError):
                return BatchItemResult(status=submitted.status, detail=submitted.detail)
            try:
                response = await answer(*submitted, item, client_left)
            except DraftError as error:
                return BatchItemResult(status=error.status, detail=error.detail)
            return None if response is None else BatchItemResult(status=200, draft=response)

        try:
            results = await asyncio.gather(*(result(item, q) for item, q in zip(batch.items, queued, strict=True)))
        finally:
            client_left.cancel()
        if any(r is None for r in results):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return BatchResponse(results=results)

    @app.get("/health")
    async def health() -> dict:
        batcher = app.state.batcher
        if not batcher.running:  # nothing would ever answer /draft: say so to the balancer
            raise http_error(DraftError(503, "the batcher is not running; restart the server"))
        if not batcher.accepting:
            raise http_error(DraftError(503, "draining: this replica answers what it has queued, then stops"))
        return {
            "status": "ok",
            "pid": os.getpid(),
            "replica": replica,
            "model": drafter.describe(),
            "random_weights": bool(drafter.model_card.get("random_weights", False)),
            "queue_depth": batcher.queue.qsize(),
            "limits": {"vocab_size": drafter.vocab_size, "max_context": drafter.max_context}
            | {name: getattr(settings, name) for name in HEALTH_LIMITS},
            "auth_required": settings.api_key is not None,
        }

    @app.get("/metrics", response_class=Response)
    async def metrics_text() -> Response:
        return Response(metrics.text(), media_type=metrics.content_type)

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

    # The last middleware added runs first: name the replica, count and time everything, then authenticate,
    # then size the body.
    replica = replica_name(settings.host, settings.port)
    app.add_middleware(limit_body_size, max_bytes=settings.max_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(require_api_key, api_key=settings.api_key)
    app.add_middleware(measure_requests, metrics=metrics)
    app.add_middleware(add_response_header, name=REPLICA_HEADER, value=replica)
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
        )
    except draft_model.ModelLoadError as error:
        raise ConfigError(f"cannot load the model from --model-dir {settings.model_dir}: {error}") from None
    draft_model.draft_batch(drafter, [[0]], max_tokens=1)
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
    settings = server_settings.parse_args(argv, __doc__)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(settings.threads or max(1, torch.get_num_threads() - 1))
    if not draft_model.reuse_freed_memory():
        log.info("malloc is not glibc's: freed prefill buffers go back to the OS (long prefills run slower)")
    # A signal during the load, and the one uvicorn re-delivers after a forced stop, end the process at once.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(0))
    started = time.perf_counter()
    try:
        drafter = load_drafter(settings)
    except ConfigError as problem:
        refuse(str(problem), status=2)
    except Exception as error:  # the operator gets one line; --log-level debug adds the traceback
        log.debug("start-up failed", exc_info=True)
        refuse(f"cannot start: {type(error).__name__}: {error} (--log-level debug shows the traceback)", status=1)
    log.info("%s", server_settings.startup_summary(drafter.describe(), settings, time.perf_counter() - started))
    app = create_app(settings, drafter)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level,
        access_log=settings.access_log,
    )
    DrainingServer(config, drain=lambda: app.state.batcher.drain(), drain_seconds=settings.drain_seconds).run()


if __name__ == "__main__":
    main()
