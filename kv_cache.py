"""The KV-cache pool: slots allocated once, written by index, matched by exact token prefix, LRU eviction.

A slot holds the keys and values of one sequence and the tokens they came from; a request reuses the
longest prefix any slot holds, matched by token equality (never by a hash), and KV beyond the matched
prefix is never read.
"""

import torch

from planning import CHUNK, SLOTS_PER_ROW, round_up

# Keys and values are computed CHUNK positions at a time: a complete chunk on the dense-weight path, the
# positions of a sequence's last, incomplete chunk (and its drafts) on the INT4 kernel. A prefix is
# reused only where the cached positions took the path this request's own positions would take, so a
# cached prefix gives bit-identical keys and values to recomputing it.


class KVCache:
    """`num_slots` sequences of up to `max_len` tokens each, plus one scratch slot that absorbs the
    writes of padding and finished rows so they can never touch a real sequence. Each slot has room for
    `capacity` positions, max_len rounded up to a whole chunk: attention reads keys a chunk at a time."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        if num_slots < SLOTS_PER_ROW:
            raise ValueError(f"cache_slots must be at least {SLOTS_PER_ROW}, got {num_slots}")
        self.capacity = round_up(max_len, CHUNK)
        # One spare chunk past the capacity, never read: a window then never spans a whole slot, which a
        # compiled step would otherwise take as a constant size.
        shape = (num_slots + 1, num_kv_heads, self.capacity + CHUNK, head_dim)
        # A tensor per layer: a compiled step then writes each in place (a write into a view of one tensor
        # for all layers would be compiled as a copy of the whole pool). torch.empty on CPU does not touch
        # the pages, so memory is committed only as slots fill.
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.num_slots, self.max_len, self.scratch = num_slots, max_len, num_slots
        self.zeroed = [0] * num_slots  # positions 0..zeroed-1 of a slot hold numbers, not uninitialised memory
        # The tokens whose KV each slot holds, on the CPU, -1 past a slot's length (no id matches it).
        self.tokens = torch.full((num_slots, max_len), -1, dtype=torch.long)
        self.lengths = [0] * num_slots
        self.prompt_len = [0] * num_slots  # how many of them a request sent; the rest are the slot's own drafts
        self.complete = [0] * num_slots  # positions 0..complete-1 were computed as complete chunks
        self.last_used = [0] * num_slots
        self.clock = 0

    def forget(self) -> None:
        """Forget what every slot holds (the memory stays allocated): the next request of any row is cold."""
        self.tokens.fill_(-1)
        self.lengths = [0] * self.num_slots
        self.prompt_len = [0] * self.num_slots
        self.complete = [0] * self.num_slots

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots, positions (N,); k, v (N, H_kv, D)."""
        self.keys[layer][slots, :, positions] = k
        self.values[layer][slots, :, positions] = v

    def window(self, layer: int, slots: torch.Tensor | int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at positions 0..length-1 of each of `slots` (B,), (B, H_kv, length, D) copies, or
        of one slot given as an int, (H_kv, length, D) views."""
        return self.keys[layer][slots, :, :length], self.values[layer][slots, :, :length]

    def longest_prefix(self, tokens: list[int]) -> tuple[int, int]:
        """(slot, length) of the longest common prefix between `tokens` and any slot; newest slot on ties."""
        n = min(len(tokens), self.max_len)
        differs = self.tokens[:, :n] != torch.tensor(tokens[:n])  # (slots, n)
        matched = torch.where(differs.any(dim=1), differs.int().argmax(dim=1), n).tolist()  # first mismatch per slot
        length, _, slot = max(zip(matched, self.last_used, range(self.num_slots)))
        return slot, length

    def assign(self, batch: list[list[int]]) -> tuple[list[int], list[int]]:
        """Choose a slot for each row and how many of its tokens are reused from the cache.

        A row that extends the request a slot last served continues in that slot: what the slot holds
        beyond the match is its own draft, which the row's accepted tokens supersede (the harness'
        loop). Otherwise the row takes the least recently used slot that no row of this batch reads
        from, and the matched prefix's KV is copied there, so a conversation sharing only a prefix
        (a system prompt) with another keeps its own slot.
        """
        if len(batch) * SLOTS_PER_ROW > self.num_slots:
            raise ValueError(
                f"a batch of {len(batch)} needs at least {SLOTS_PER_ROW * len(batch)} cache slots, have {self.num_slots}"
            )
        matches = [self.longest_prefix(row) for row in batch]
        reuse = [self.reusable(slot, n, len(row)) for row, (slot, n) in zip(batch, matches)]
        sources = {slot for (slot, _), r in zip(matches, reuse) if r > 0}
        targets: list[int | None] = [None] * len(batch)
        for i, (slot, n) in enumerate(matches):
            if reuse[i] > 0 and n >= self.prompt_len[slot] and slot not in targets:
                targets[i] = slot
        free = sorted(
            (s for s in range(self.num_slots) if s not in sources and s not in targets), key=lambda s: self.last_used[s]
        )
        complete = [min(self.complete[slot], r) for (slot, _), r in zip(matches, reuse)]
        for i, (slot, _) in enumerate(matches):
            if targets[i] is None:
                targets[i] = free.pop(0)
                if reuse[i] > 0:
                    self.copy_prefix(slot, targets[i], reuse[i])
        for row, slot, r, c in zip(batch, targets, reuse, complete):
            # Until the forward finishes, only the reused prefix of a target slot is known to be valid.
            self.hold(slot, row[:r], prompt_len=r)
            self.complete[slot] = c
        return targets, reuse

    def reusable(self, slot: int, matched: int, length: int) -> int:
        """How many leading tokens of a `length`-token row to take from `slot`, whose tokens match its first
        `matched`: a whole-chunk prefix, or a prefix through complete chunks computed as such plus cached
        positions of the row's own last chunk. At least one token is left to produce the next logits."""
        boundary = length // CHUNK * CHUNK  # this row's positions below it form complete chunks
        reuse = min(matched, length - 1)
        if self.complete[slot] != boundary:
            reuse = min(reuse, self.complete[slot], boundary)
        return reuse if reuse >= boundary else reuse // CHUNK * CHUNK

    def clear_garbage(self, slots: list[int], length: int) -> None:
        """Zero positions below `length` of `slots` never written before. Attention reads to the end of a
        token's chunk; the keys past the token are masked, but a NaN from uninitialised memory would still
        leak through the attention weights (0 * NaN = NaN)."""
        for slot in slots:
            if self.zeroed[slot] < length:
                for keys, values in zip(self.keys, self.values):
                    keys[slot, :, self.zeroed[slot] : length] = 0
                    values[slot, :, self.zeroed[slot] : length] = 0
                self.zeroed[slot] = length

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        for keys, values in zip(self.keys, self.values):
            keys[target, :, :length] = keys[source, :, :length]
            values[target, :, :length] = values[source, :, :length]
        self.zeroed[target] = max(self.zeroed[target], length)

    def commit(self, slot: int, prompt: list[int], fed_drafts: list[int]) -> None:
        """Record that `slot` now holds the KV of exactly `prompt` followed by `fed_drafts`."""
        self.hold(slot, prompt + fed_drafts, prompt_len=len(prompt))
        self.complete[slot] = len(prompt) // CHUNK * CHUNK
        self.clock += 1
        self.last_used[slot] = self.clock

    def hold(self, slot: int, tokens: list[int], prompt_len: int) -> None:
        self.tokens[slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        self.tokens[slot, len(tokens) : self.lengths[slot]] = -1
        self.lengths[slot], self.prompt_len[slot] = len(tokens), prompt_len
