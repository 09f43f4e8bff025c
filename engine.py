"""The engine: prefill, and greedy decoding as a fixed-shape step, over the KV-cache pool.

Every token's keys, values and logits are computed the same way whichever call computes it, so a row's
draft depends only on its own tokens and settings, never on its batch-mates or on the cache:

* a prefill cuts positions into chunks aligned to absolute positions (planning.py). A complete chunk
  takes the dense-weight path and chunk attention (the CPU chunk kernel, else SDPA in the model's dtype);
  the positions of a sequence's last, incomplete chunk take the INT4 kernel and the few-query attention
  (the CPU query kernel, else block_attention: transformer.py), exactly as a decode step computes a token,
  so the cache can reuse a draft the previous call fed.
* the cache reuses a prefix only where it was computed the way this request would compute it
  (KVCache.reusable).
* a decode step runs in fixed shapes: every row feeds one token, finished and padding rows stay in the
  batch with their writes sent to the scratch slot, and all bookkeeping (positions, budgets, stops,
  confidence) is device tensors. Nothing in the k-step loop reads a value on the host, so on a GPU the
  loop never waits, and a step compiled for its batch bucket (torch.compile, CUDA graphs on CUDA) serves
  every call of that bucket.

    first_logits = prefill(model, cache, rows, slots, reused)
    result = decoder.decode(first_logits, rows, slots, budgets, thresholds, stop_ids, want_logprobs)
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kv_cache import KVCache
from planning import (
    BATCH_BUCKETS,
    Piece,
    batch_bucket,
    chunk_end,
    exact_window,
    prefill_pieces,
    waves,
    window_bucket,
)
from transformer import KEY_BLOCK, Outputs, Plan, Segment, StepPlan, Transformer

PREFILL_TOKENS = 8192  # tokens per prefill forward: bounds its temporaries; each forward unpacks every INT4 layer once


def plan_for(
    pieces: list[Piece], slots: list[int], capacity: int, device: torch.device, wanted: list[bool] | None = None
) -> Plan:
    """A forward over `pieces`, one attention segment each, the complete chunks' tokens first. wanted: which
    pieces' final hidden states the caller reads (the forward then returns only theirs); None: every token's."""
    positions, write_slots, segments = [], [], []
    for piece in pieces:
        start = len(positions)
        positions += range(piece.start, piece.stop)
        write_slots += [slots[piece.row]] * (piece.stop - piece.start)
        window = chunk_end(piece.start, capacity)
        segments.append(Segment(start, len(positions), slots[piece.row], piece.start, window, piece.complete))
    dense_rows = sum(piece.stop - piece.start for piece in pieces if piece.complete)
    outputs = None
    if wanted is not None and any(wanted):  # a forward that ends no row computes its last layer whole
        kept = [segment for segment, want in zip(segments, wanted) if want]
        rows = torch.tensor([t for segment in kept for t in range(segment.start, segment.stop)], device=device)
        outputs = Outputs(rows, sum(s.stop - s.start for s in kept if s.complete_chunk))
    return Plan(
        torch.tensor(positions, device=device),
        torch.tensor(write_slots, device=device),
        segments,
        dense_rows,
        outputs=outputs,
    )


def prefill(
    model: Transformer, cache: KVCache, rows: list[list[int]], slots: list[int], reused: list[int]
) -> torch.Tensor:
    """Run each row's uncached positions through the model; the logits after each row's last token (B, vocab)."""
    device = model.norm.weight.device
    last_hidden: list[torch.Tensor | None] = [None] * len(rows)
    for wave in waves(prefill_pieces([len(row) for row in rows], reused), PREFILL_TOKENS):
        ends_row = [piece.stop == len(rows[piece.row]) for piece in wave]
        plan = plan_for(wave, slots, cache.capacity, device, ends_row)
        token_ids = torch.tensor(
            [t for piece in wave for t in rows[piece.row][piece.start : piece.stop]], device=device
        )
        hidden = model(token_ids, cache, plan)  # (M, hidden): the tokens of the pieces that end their rows
        end = 0
        for piece, ends in zip(wave, ends_row):
            if ends:
                end += piece.stop - piece.start
                last_hidden[piece.row] = hidden[end - 1]
    return model.logits(torch.stack(last_hidden))


def forward_step(model: Transformer, cache: KVCache, plan: StepPlan, tokens: torch.Tensor) -> torch.Tensor:
    """One decode step: tokens (B,) -> logits (B, vocab). The function a decoder compiles per bucket."""
    return model.logits(model(tokens, cache, plan))


@dataclass
class Decoded:
    """A decode call's result, on the host (one transfer): per row its draft tokens and their logprobs."""

    tokens: list[list[int]]
    logprobs: list[list[float]] | None


class Decoder:
    """Greedy decoding of a batch in fixed shapes, eager or compiled once per batch bucket.

    Compiled, a batch is padded to its bucket: the step's graph is built once per batch bucket, with the
    window as its one dynamic size. On CUDA it is replayed as a CUDA graph, one per window size, so the keys
    a step reads are padded to a window bucket (planning.py); on the CPU the window is the chunks the rows
    need. Eager, the batch keeps its size and the window is the rows' own need (the same bits either way:
    see block_attention)."""

    def __init__(
        self, model: Transformer, cache: KVCache, buckets: tuple[int, ...] = BATCH_BUCKETS, compiled: bool = False
    ):
        self.model, self.cache, self.buckets, self.compiled = model, cache, buckets, compiled
        self.device = model.norm.weight.device
        self.steps: dict[int, object] = {}  # batch bucket -> its compiled step
        if compiled and self.device.type == "cuda":
            for pool in cache.keys + cache.values:
                torch._dynamo.mark_static_address(pool)  # CUDA graphs read and write the pool in place

    def step(self, batch: int):
        """The step function for a padded batch of `batch` rows."""
        if not self.compiled:
            return forward_step
        if batch not in self.steps:
            # Rounding every intermediate to the model's dtype where eager does keeps the compiled step's bits
            # equal to the eager step's and to a prefill's, so the cache may reuse either.
            options = {"emulate_precision_casts": True}
            if self.device.type == "cuda":
                options["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets: replay as a CUDA graph
            self.steps[batch] = torch.compile(forward_step, fullgraph=True, dynamic=False, options=options)
        return self.steps[batch]

    def may_read_host(self) -> bool:
        """Whether the loop may stop when every row has finished: that reads a device value, which on the CPU
        is free and on a GPU would wait for the step (and break a CUDA graph's replay)."""
        return self.device.type == "cpu"

    def shapes(self, rows: list[list[int]], budgets: list[int]) -> tuple[int, int]:
        """(batch rows, keys per step) of a call: compiled, the batch bucketed and the window too on CUDA."""
        keys = max(len(row) + budget - 1 for row, budget in zip(rows, budgets))  # the last position fed, plus one
        if not self.compiled:
            return len(rows), chunk_end(keys - 1, self.cache.capacity)
        window_of = window_bucket if self.device.type == "cuda" else exact_window  # a CUDA graph per window size
        return batch_bucket(len(rows), self.buckets), window_of(keys, self.cache.capacity)

    def decode(
        self,
        logits: torch.Tensor,
        rows: list[list[int]],
        slots: list[int],
        budgets: list[int],
        thresholds: list[float],
        stop_ids: Sequence[int],
        want_logprobs: bool,
    ) -> Decoded:
        """Greedy drafts from each row's first logits (n, vocab): up to budgets[b] tokens for row b, stopping
        after a stop id or a token whose probability is below thresholds[b]."""
        n, device = len(rows), self.device
        batch, window = self.shapes(rows, budgets)
        pad, steps = batch - n, max(*budgets, 1)
        # Everything the loop reads, on the device before it starts. Padding rows are finished from the start.
        slot = self._to_device(slots + [self.cache.scratch] * pad)
        position = self._to_device([len(row) for row in rows] + [0] * pad)  # where each row feeds its next token
        budget = self._to_device(budgets + [0] * pad)
        threshold = self._to_device(thresholds + [0.0] * pad, torch.float32) if any(thresholds) else None
        stop = self._to_device(list(stop_ids))
        logits = torch.nn.functional.pad(logits, (0, 0, 0, pad))
        live = budget > 0
        counts = torch.zeros(batch, dtype=torch.long, device=device)
        tokens, logprobs = [], []
        step_fn = self.step(batch)
        key_positions = torch.arange(window, device=device).view(-1, KEY_BLOCK)
        if self.compiled:
            torch._dynamo.mark_dynamic(key_positions, 0)  # one graph serves every window of the bucket
        for step in range(steps):
            token = logits.max(dim=-1).indices  # (batch,): the first maximum, as argmax, which is slower on bf16
            tokens.append(token)
            if want_logprobs:
                logprobs.append(logits.float().log_softmax(dim=-1).gather(1, token[:, None])[:, 0])
            counts += live
            live = live & ~torch.isin(token, stop) & (budget > step + 1)
            if threshold is not None:
                live &= logits.float().softmax(dim=-1).amax(dim=-1) >= threshold
            if step + 1 == steps or (self.may_read_host() and not live.any()):
                break
            plan = StepPlan(position, torch.where(live, slot, self.cache.scratch), slot, key_positions)
            if self.compiled and device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs are consumed
            logits = step_fn(self.model, self.cache, plan, token)
            position = position + live
        return self._to_host(torch.stack(tokens, dim=1)[:n], counts[:n], logprobs, n)

    def _to_device(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """A host list on the device; to a GPU from pinned memory, so the copy does not make the host wait."""
        tensor = torch.tensor(values, dtype=dtype)
        return tensor.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else tensor

    @staticmethod
    def _to_host(tokens: torch.Tensor, counts: torch.Tensor, logprobs: list[torch.Tensor], n: int) -> Decoded:
        """The call's one device -> host transfer: counts (n,), tokens (n, steps) and, when asked for, their
        logprobs (n, steps), as one float64 tensor (exact for token ids and fp32 logprobs alike)."""
        steps = tokens.shape[1]
        columns = [counts[:, None], tokens] + ([torch.stack(logprobs, dim=1)[:n]] if logprobs else [])
        host = torch.cat([column.double() for column in columns], dim=1).tolist()
        counted = [int(row[0]) for row in host]
        drafted = [[int(t) for t in row[1 : 1 + count]] for row, count in zip(host, counted)]
        if not logprobs:
            return Decoded(drafted, None)
        return Decoded(drafted, [row[1 + steps : 1 + steps + count] for row, count in zip(host, counted)])
