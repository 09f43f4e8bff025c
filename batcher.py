"""The asyncio batching queue between the HTTP handlers and the model.

Handlers `submit` requests into a bounded queue and `wait` for their drafts; one task takes up to
max_batch_size queued requests (waiting at most max_wait_ms for more once it has one, and up to
regroup_wait_ms while it holds fewer than the last few batches did) and runs the draft function on them in
the drafting thread, so the model drafts one batch at a time.
"""

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import draft_model
from metrics import Metrics

log = logging.getLogger("draft_server")

RECENT_BATCHES = 4  # batches whose largest size a new batch waits (regroup_wait_ms) to reach


def drafting_thread() -> ThreadPoolExecutor:
    """The one thread that runs the model in the server, from its load to its last batch.

    torch's CPU operators run their threads through OpenMP, and libgomp gives every thread that starts
    parallel work a pool of its own. An idle pool still counts against the cores: when the pools hold more
    threads than there are cores, libgomp's threads stop spin-waiting between parallel regions and sleep,
    and each of a step's many small operators then pays for waking them. Loading on one thread and drafting
    on another made two drafting threads on two cores slower than one (evidence/RESULTS.md); so the thread
    that loads the model is the thread that drafts, and nothing else in the server runs torch's operators."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-worker")


class Unavailable(Exception):
    """The batcher cannot take or keep a request now (queue full, queue deadline passed, draining): a 503."""


class DraftFailed(Exception):
    """draft_batch raised for the batch this request was in: a 500."""


@dataclass(frozen=True)
class DraftRequest:
    """What one request asks of the model, checked against it and with the server's defaults filled in."""

    token_ids: tuple[int, ...]
    max_tokens: int
    min_confidence: float  # stop after a draft token less likely than this (0: never)
    lookup_min_match: int  # copy what followed an earlier n-gram of at least this many tokens (0: off)
    return_logprobs: bool


@dataclass
class PendingDraft:
    request: DraftRequest
    future: asyncio.Future = field(repr=False)
    taken: bool = False  # in a batch the worker is drafting: past the point where the deadline can refuse it


# What the drafting thread runs on a batch: one Draft per request, in order (the server's: draft_requests on
# its drafter).
DraftFn = Callable[[list[DraftRequest]], list[draft_model.Draft]]


def draft_requests(drafter: draft_model.Drafter, requests: list[DraftRequest]) -> list[draft_model.Draft]:
    """draft_model.draft_batch on a batch of requests, each with its own limits. Logprobs are computed for
    all rows when any request wants them (one decode serves the batch); the server returns them only to those."""
    return draft_model.draft_batch(
        drafter,
        [request.token_ids for request in requests],
        [request.max_tokens for request in requests],
        any(request.return_logprobs for request in requests),
        min_confidence=[request.min_confidence for request in requests],
        lookup_min_match=[request.lookup_min_match for request in requests],
    )


class Batcher:
    """Groups queued requests into batches and drafts each batch on `worker` (drafting_thread(), which the
    batcher shuts down when it stops).

    The model runs one batch at a time; requests that arrive meanwhile wait in the bounded queue and
    form the next batch. A batch that raises fails only its own requests. A request still queued after
    `queue_deadline_s` is refused, so a flood costs clients a quick 503 instead of an unbounded wait.
    """

    def __init__(
        self,
        draft_fn: DraftFn,
        worker: ThreadPoolExecutor,
        *,
        max_batch_size: int,
        max_wait_ms: float,
        regroup_wait_ms: float,
        max_queue: int,
        queue_deadline_s: float,
        metrics: Metrics,
    ):
        self.draft_fn = draft_fn
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self.regroup_wait_s = regroup_wait_ms / 1000
        # The sizes of the last few batches: their clients tend to come back together, a few ms apart.
        self.recent_sizes: collections.deque[int] = collections.deque(maxlen=RECENT_BATCHES)
        self.queue_deadline_s = queue_deadline_s
        self.metrics = metrics
        self.queue: asyncio.Queue[PendingDraft] = asyncio.Queue(maxsize=max_queue)
        self.worker = worker
        self.task: asyncio.Task | None = None
        self.accepting = False
        metrics.queue_depth.set_function(self.queue.qsize)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self) -> None:
        self.accepting = True
        self.task = asyncio.create_task(self._run(), name="batcher")

    async def drain(self) -> None:
        """Refuse new work and return once everything already queued has been drafted."""
        self.accepting = False
        await self.queue.join()

    async def stop(self) -> None:
        """Drain, then stop the task and the drafting thread."""
        await self.drain()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.worker.shutdown(wait=True)

    def submit(self, request: DraftRequest) -> PendingDraft:
        if not self.accepting:
            raise Unavailable("the server is draining: it answers what it has queued, then stops")
        pending = PendingDraft(request, asyncio.get_running_loop().create_future())
        try:
            self.queue.put_nowait(pending)
        except asyncio.QueueFull:
            raise Unavailable(
                f"the draft queue is full ({self.queue.maxsize} waiting, the --max-queue limit)"
            ) from None
        return pending

    async def wait(self, pending: PendingDraft, client_left: asyncio.Future | None = None) -> draft_model.Draft | None:
        """The request's draft, or None when `client_left` completes first: then its future is cancelled,
        so a request still queued is skipped instead of costing a draft nobody reads. Raises Unavailable
        when the request is still queued after the deadline, DraftFailed when its batch failed."""
        watched = {pending.future} if client_left is None else {pending.future, client_left}
        done, _ = await asyncio.wait(watched, timeout=self.queue_deadline_s, return_when=asyncio.FIRST_COMPLETED)
        if not done and not pending.taken:
            pending.future.cancel()
            self.metrics.deadline_expired.inc()
            raise Unavailable(
                f"the request waited {self.queue_deadline_s:g} s in the draft queue (the --queue-deadline-s limit)"
            )
        if not done:  # its batch is being drafted: the answer is moments away
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if pending.future in done:
            return pending.future.result()
        pending.future.cancel()
        return None

    async def _run(self) -> None:
        while True:
            batch = await self._next_batch()
            try:
                # A client that went away (or a request past its deadline) cancelled its future.
                live = [pending for pending in batch if not pending.future.cancelled()]
                for pending in live:
                    pending.taken = True
                if live:
                    await self._draft(live)
            finally:
                for _ in batch:
                    self.queue.task_done()

    async def _next_batch(self) -> list[PendingDraft]:
        """Wait for one request, then take more until the batch is full or the wait is over: max_wait, or
        regroup_wait while the batch holds fewer than the largest of the last few. Clients answered by one
        batch send their next requests a few milliseconds apart; without the regroup wait the last of them
        miss the batch and cost a batch of their own, and a round of requests stays split from then on."""
        batch = [await self.queue.get()]
        started = time.monotonic()
        while len(batch) < self.max_batch_size:
            try:
                batch.append(self.queue.get_nowait())
                continue
            except asyncio.QueueEmpty:
                pass
            regrouping = len(batch) < max(self.recent_sizes, default=0)
            wait = max(self.max_wait_s, self.regroup_wait_s) if regrouping else self.max_wait_s
            remaining = started + wait - time.monotonic()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), remaining))
            except TimeoutError:
                break
        self.recent_sizes.append(len(batch))
        return batch

    async def _draft(self, batch: list[PendingDraft]) -> None:
        requests = [pending.request for pending in batch]
        call = functools.partial(self.draft_fn, requests)
        started = time.perf_counter()
        try:
            drafts = await asyncio.get_running_loop().run_in_executor(self.worker, call)
            if len(drafts) != len(batch):
                raise RuntimeError(f"draft_batch returned {len(drafts)} drafts for {len(batch)} sequences")
            self.metrics.record_batch(
                [request.token_ids for request in requests], drafts, time.perf_counter() - started
            )
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
