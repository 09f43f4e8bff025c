"""The engine: prefill and greedy decoding of a batch of sequences over the KV-cache pool.

Every token's keys, values and logits are computed the same way whichever call computes it, so a row's
draft depends only on its own tokens and settings, never on its batch-mates or on the cache:

* positions are computed in CHUNKs aligned to absolute positions. A complete chunk takes the dense-weight
  path and bf16 flash attention; the positions of a sequence's last, incomplete chunk and its drafts take
  the INT4 kernel and exact fp32 attention. Both ways compute a row independently of the other rows.
* a token attends over its slot through the end of its own chunk (later keys masked), so the number of
  keys a reduction runs over does not depend on the longest row of the batch.
* the cache reuses a prefix only where it was computed the way this request would compute it
  (KVCache.reusable).

    first_logits = prefill(model, cache, rows, slots, reused)
    tokens, counts, logprobs = decode(model, cache, first_logits, rows, slots, budgets, ...)
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kv_cache import CHUNK, KVCache
from transformer import Plan, Segment, Transformer

PREFILL_TOKENS = 2048  # tokens per prefill forward: bounds the size of its temporaries


def chunk_end(position: int, max_len: int) -> int:
    """The end of the chunk holding `position`: how many keys a token at that position attends over."""
    return min((position // CHUNK + 1) * CHUNK, max_len)


@dataclass(frozen=True)
class Piece:
    """Positions start..stop-1 of row `row`: a complete chunk, or the positions of its last chunk."""

    row: int
    start: int
    stop: int
    complete: bool


def prefill_pieces(lengths: list[int], reused: list[int]) -> list[Piece]:
    """Each row's uncached positions cut at chunk boundaries: complete chunks first (in position order,
    so a chunk's predecessors come no later), then every row's incomplete last chunk."""
    complete, tails = [], []
    for row, (length, start) in enumerate(zip(lengths, reused)):
        boundary = length // CHUNK * CHUNK
        complete += [Piece(row, s, s + CHUNK, True) for s in range(start, boundary, CHUNK)]
        if max(start, boundary) < length:
            tails.append(Piece(row, max(start, boundary), length, False))
    return sorted(complete, key=lambda piece: piece.start) + tails


def waves(pieces: list[Piece], max_tokens: int) -> list[list[Piece]]:
    """Consecutive runs of pieces holding at most max_tokens tokens each (a piece is never split)."""
    runs, current, size = [], [], 0
    for piece in pieces:
        if current and size + piece.stop - piece.start > max_tokens:
            runs.append(current)
            current, size = [], 0
        current.append(piece)
        size += piece.stop - piece.start
    return runs + [current] if current else runs


def plan_for(pieces: list[Piece], slots: list[int], max_len: int, device: torch.device) -> Plan:
    """A forward over `pieces`, one attention segment each, the complete chunks' tokens first."""
    positions, write_slots, segments = [], [], []
    for piece in pieces:
        start = len(positions)
        positions += range(piece.start, piece.stop)
        write_slots += [slots[piece.row]] * (piece.stop - piece.start)
        window = chunk_end(piece.start, max_len)
        segments.append(Segment(start, len(positions), slots[piece.row], piece.start, window, piece.complete))
    dense_rows = sum(piece.stop - piece.start for piece in pieces if piece.complete)
    return Plan(torch.tensor(positions, device=device), torch.tensor(write_slots, device=device), segments, dense_rows)


def prefill(
    model: Transformer, cache: KVCache, rows: list[list[int]], slots: list[int], reused: list[int]
) -> torch.Tensor:
    """Run each row's uncached positions through the model; the logits after each row's last token (B, vocab)."""
    device = model.norm.weight.device
    last_hidden: list[torch.Tensor | None] = [None] * len(rows)
    for wave in waves(prefill_pieces([len(row) for row in rows], reused), PREFILL_TOKENS):
        plan = plan_for(wave, slots, cache.max_len, device)
        token_ids = torch.tensor(
            [t for piece in wave for t in rows[piece.row][piece.start : piece.stop]], device=device
        )
        hidden = model(token_ids, cache, plan)  # (N, hidden)
        for piece, segment in zip(wave, plan.segments):
            if piece.stop == len(rows[piece.row]):
                last_hidden[piece.row] = hidden[segment.stop - 1]
    return model.logits(torch.stack(last_hidden))


def decode(
    model: Transformer,
    cache: KVCache,
    logits: torch.Tensor,
    rows: list[list[int]],
    slots: list[int],
    budgets: list[int],
    thresholds: list[float],
    stop_ids: Sequence[int],
    want_logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Greedy decoding: each step feeds every live row its newest token. Rows that finish leave the batch,
    which changes nothing for the others. Which rows live is read on the host each step: free on the CPU,
    a synchronisation on a GPU, where the step is not captured as a graph.

    Returns draft tokens (B, steps), how many of them each row drafted (B,), and their logprobs.
    """
    device = logits.device
    B, steps = len(rows), max(max(budgets), 1)
    stop = torch.tensor(list(stop_ids), device=device, dtype=torch.long)
    min_confidence = torch.tensor(thresholds, device=device) if any(thresholds) else None
    tokens = torch.zeros(B, steps, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, steps, device=device) if want_logprobs else None
    counts = torch.zeros(B, dtype=torch.long, device=device)
    budget = torch.tensor(budgets, device=device)
    live = (budget > 0).nonzero()[:, 0]  # the rows still drafting
    logits = logits[live]
    for step in range(steps):
        token = logits.max(dim=-1).indices  # (live,): the first maximum, as argmax, which is slower on bf16 rows
        tokens[live, step] = token
        if want_logprobs:
            logprobs[live, step] = logits.float().log_softmax(dim=-1).gather(1, token[:, None])[:, 0]
        counts[live] += 1
        going = ~torch.isin(token, stop) & (budget[live] > step + 1)
        if min_confidence is not None:
            going &= logits.float().softmax(dim=-1).amax(dim=-1) >= min_confidence[live]
        live, token = live[going], token[going]
        if step + 1 == steps or len(live) == 0:
            break
        plan = decode_plan(live.tolist(), rows, slots, step, cache.max_len, device)
        logits = model.logits(model(token, cache, plan))
    return tokens, counts, logprobs


def decode_plan(
    live: list[int], rows: list[list[int]], slots: list[int], step: int, max_len: int, device: torch.device
) -> Plan:
    """One token per live row, at the position after its prompt and the `step` drafts fed before it."""
    positions = [len(rows[b]) + step for b in live]
    segments = [
        Segment(i, i + 1, slots[b], position, chunk_end(position, max_len), complete_chunk=False)
        for i, (b, position) in enumerate(zip(live, positions))
    ]
    return Plan(
        torch.tensor(positions, device=device), torch.tensor([slots[b] for b in live], device=device), segments, 0
    )
