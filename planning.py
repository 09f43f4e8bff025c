"""Planning the hot path: how positions are cut into chunks, and which fixed shapes a call runs in.

Pure functions of lengths and settings (no tensors), shared by the cache, the engine and the drafter:

* chunks: keys and values are computed CHUNK positions at a time, aligned to absolute positions, so a
  token is computed the same way whichever call computes it (engine.py says why that matters);
* buckets: the decode loop runs in a few fixed shapes, a batch padded to a batch bucket and, on CUDA, the
  keys a step reads to a window bucket, so a compiled step serves every request of its bucket.
"""

from dataclasses import dataclass

CHUNK = 64  # positions per chunk; the attention's key blocks and the INT4 kernel's 64-row blocks share it
BATCH_BUCKETS = (1, 2, 4, 8, 16)  # the batch sizes a compiled decode step is built for
# Cache slots per row of a call: each row may need a fresh slot beside the one holding its matched prefix.
SLOTS_PER_ROW = 2
DEFAULT_MAX_CONTEXT = 4096  # KV-cache length per slot when the caller does not choose one


def default_context(max_position_embeddings: int) -> int:
    """Tokens per cache slot when the caller does not choose: the model's context, capped."""
    return min(max_position_embeddings, DEFAULT_MAX_CONTEXT)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def chunk_end(position: int, capacity: int) -> int:
    """The end of the chunk holding `position`: how many keys a token at that position attends over.
    `capacity` is the cache's length per slot, a multiple of CHUNK."""
    return min((position // CHUNK + 1) * CHUNK, capacity)


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


def bucket_problem(buckets: tuple[int, ...]) -> str | None:
    """Why `buckets` cannot serve as batch buckets (they must be increasing powers of two), or None."""
    if not buckets:
        return "the batch bucket list is empty; give increasing powers of two such as 1,2,4,8,16"
    if any(b < 1 or b & (b - 1) for b in buckets) or list(buckets) != sorted(set(buckets)):
        return f"batch buckets {','.join(map(str, buckets))} are not increasing powers of two such as 1,2,4,8,16"
    return None


def batch_bucket(rows: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding `rows` rows (callers split batches larger than the largest bucket)."""
    if rows > buckets[-1]:
        raise ValueError(f"{rows} rows exceed the largest batch bucket {buckets[-1]}; split the batch")
    return next(b for b in buckets if b >= rows)


def window_bucket(keys: int, capacity: int) -> int:
    """The number of keys a decode step reads when its rows need `keys`: CHUNK times a power of two, at least
    two chunks (a compiler treats a size of 1 as a constant), at most `capacity`. A handful of windows serve
    every context length, and at most half of a window is padding."""
    window = 2 * CHUNK
    while window < keys:
        window *= 2
    return min(window, capacity)


def exact_window(keys: int, capacity: int) -> int:
    """The number of keys a compiled decode step on the CPU reads when its rows need `keys`: the chunks they
    need, at least two (a compiler treats a size of 1 as a constant) or else the whole `capacity` where that
    is smaller. Without CUDA graphs to replay, one
    graph with the window as its dynamic size serves every window, so none is padded to a power of two."""
    return max(chunk_end(keys - 1, capacity), min(2 * CHUNK, capacity))


def rows_per_call(cache_slots: int, buckets: tuple[int, ...]) -> int:
    """How many rows one engine call takes: SLOTS_PER_ROW slots each, and no more than the largest batch bucket."""
    return min(cache_slots // SLOTS_PER_ROW, buckets[-1])
