"""A row's draft depends only on its tokens, the weights and its own settings, on every CPU kernel shipped
for INT4 layers (int4.CPU_KERNELS: int4pack, int4-bf16dot and dense-bf16 where the CPU has bf16 hardware,
dense-fp32), and with either attention for a decode step's queries (attention_kernel's CPU kernel, which the
bf16 paths take where it runs, or PyTorch's operators).

Each case drafts the same rows several ways (alone on a fresh pool, again from the prefix cache, in
batches with neighbours of other lengths, as batched harness follow-ups) and requires the drafts and
their log-probabilities to be bit-identical: equal log-probabilities mean every logit along the way
was computed the same, so no near-tie could flip either. Weights at the usual 0.02 scale make near-ties
common; prompt lengths straddle the engine's 64-position chunks.
"""

import random

import pytest
import torch
from tiny_models import forward_all, write_default_path_package

import draft_model
import engine
import int4
from transformer import block_attention

LENGTHS = [1, 7, 63, 64, 65, 100, 127, 128, 130, 200]


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return write_default_path_package(tmp_path_factory.mktemp("invariance") / "package")


def rows_of(lengths: list[int], seed: int) -> list[list[int]]:
    generator = random.Random(seed)
    return [[generator.randrange(256) for _ in range(n)] for n in lengths]


def drafts(drafter, rows: list[list[int]], max_tokens=12) -> list[tuple[list[int], list[float]]]:
    made = draft_model.draft_batch(drafter, rows, max_tokens=max_tokens, return_logprobs=True, stop_token_ids=[])
    return [(list(d), d.logprobs) for d in made]


# Every CPU kernel shipped for INT4 layers (int4.CPU_KERNELS), as load_model takes it.
KERNELS = {
    name: {
        "weights": kernel.weights,
        "dtype": kernel.dtype,
        "int4_kernel": name if kernel.weights == "packed" else "auto",
    }
    for name, kernel in int4.CPU_KERNELS.items()
}
# The bf16 kernels attend with the CPU attention kernel where it runs (auto); this one with PyTorch's operators.
KERNELS["int4pack+torch-attention"] = KERNELS["int4pack"] | {"attention_kernel": "torch"}


def load(package, kernel: str, cache_slots: int) -> draft_model.Drafter:
    try:
        int4.choose_cpu_kernel(kernel.split("+")[0])
    except ValueError as lacking:
        pytest.skip(str(lacking))
    return draft_model.load_model(package, cache_slots=cache_slots, **KERNELS[kernel])


def alone(package, rows: list[list[int]], kernel: str, max_tokens=12) -> list[tuple[list[int], list[float]]]:
    return [drafts(load(package, kernel, cache_slots=2), [row], max_tokens)[0] for row in rows]


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_batches_of_every_size_draft_what_each_row_drafts_alone(package, kernel):
    rows = rows_of(LENGTHS * 2, seed=1)
    expected = alone(package, rows, kernel)
    drafter = load(package, kernel, cache_slots=64)
    # + int4pack for layers too narrow for int4-bf16dot
    assert drafter.kernel()["name"].split("+")[0] == kernel.split("+")[0]
    shuffled = random.Random(2)
    for size in (2, 3, 5, 8, 16):
        order = shuffled.sample(range(len(rows)), size)
        fresh = load(package, kernel, cache_slots=64)
        assert drafts(fresh, [rows[i] for i in order]) == [expected[i] for i in order], f"batch of {size}"
    # The same rows again, now with prefixes in the cache, in a batch of all of them.
    assert drafts(drafter, rows) == expected
    assert drafts(drafter, rows) == expected


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_harness_follow_ups_draft_what_a_cold_call_drafts(package, kernel):
    rows = rows_of(LENGTHS, seed=3)
    drafter = load(package, kernel, cache_slots=32)
    follow_ups = rows
    for turn in range(4):
        made = drafts(drafter, follow_ups)
        assert made == alone(package, follow_ups, kernel), f"turn {turn}"
        # The harness loop: keep some drafted tokens, add the target's bonus token, send it again.
        follow_ups = [
            row + tokens[: (turn * 5 + i) % 9] + [(i + turn) % 256]
            for i, (row, (tokens, _)) in enumerate(zip(follow_ups, made))
        ]
    assert any(d.cached_tokens for d in draft_model.draft_batch(drafter, follow_ups)), "follow-ups reuse the cache"


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_one_thread_and_two_draft_the_same(package, kernel):
    """The server drafts on every core by default and THREADS sets another count: replicas with different
    counts, or one restarted with another, must draft the same. This project's kernels split a product's
    columns and a cache's rows and heads between threads, never a sum; the library's products are held to
    it here, on this CPU."""
    rows = rows_of(LENGTHS, seed=5)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = alone(package, rows, kernel)
        torch.set_num_threads(2)
        drafter = load(package, kernel, cache_slots=32)
        assert drafts(drafter, rows) == expected  # cold, in one batch
        assert drafts(drafter, rows) == expected  # from the prefix cache
    finally:
        torch.set_num_threads(saved)


def test_the_default_path_is_packed_bf16(package):
    drafter = draft_model.load_model(package)
    assert drafter.weights == "packed" and drafter.dtype.is_floating_point and str(drafter.dtype) == "torch.bfloat16"


@pytest.mark.parametrize("rows, queries, window", [(1, 1, 64), (3, 1, 320), (1, 4, 320), (2, 3, 320), (1, 63, 576)])
def test_block_attention_gives_each_query_its_own_bits_and_softmax_attention(rows, queries, window):
    """A prefill's last chunk (many queries of one row) and decode steps (one query of each of many rows) share
    the cache, so a query's result must not depend on the queries or rows beside it, nor on keys past its
    own chunk (whole blocks of them fully masked); and it is causal softmax attention."""
    generator = torch.Generator().manual_seed(rows * 100 + queries)
    q = torch.randn(rows, queries, 9, 64, generator=generator).bfloat16()  # 9 heads sharing 3 kv heads
    keys, values = (torch.randn(rows, 3, window, 64, generator=generator).bfloat16() for _ in range(2))
    starts = torch.randint(0, window - queries + 1, (rows, 1), generator=generator)
    starts[0] = min(5, window - queries)  # one row early in its window: the blocks after its own are all masked
    positions = starts + torch.arange(queries)  # (rows, queries): consecutive, as a prefill feeds them
    together = block_attention(q, keys, values, positions)
    for g in range(rows):
        for t in range(queries):
            alone = block_attention(
                q[g : g + 1, t : t + 1], keys[g : g + 1], values[g : g + 1], positions[g : g + 1, t : t + 1]
            )
            assert torch.equal(together[g : g + 1, t : t + 1], alone), f"row {g}, query {t}"
        mask = torch.arange(window)[None] <= positions[g, :, None]  # (queries, window)
        reference = torch.nn.functional.scaled_dot_product_attention(
            q[g].transpose(0, 1).float(), keys[g].float(), values[g].float(), attn_mask=mask, enable_gqa=True
        )
        torch.testing.assert_close(together[g].float(), reference.transpose(0, 1), atol=1e-2, rtol=1e-2)


def test_a_prefill_computes_the_last_layer_for_row_ends_alone_with_a_full_forwards_bits(package):
    """After its attention, a prefill's last layer computes only the segments that end their rows; their final
    logits equal those of a forward that computes every token (tiny_models.forward_all), whether a row ends in a
    complete chunk or in a tail, alone or batched."""
    drafter = draft_model.load_model(package, cache_slots=8)
    rows = rows_of([64, 130, 200, 7], seed=11)
    full = [forward_all(drafter, row)[-1] for row in rows]
    drafter.cache.forget()
    slots = list(range(len(rows)))
    pruned = engine.prefill(drafter.model, drafter.cache, rows, slots, reused=[0] * len(rows))
    for i, logits in enumerate(full):
        assert torch.equal(pruned[i], logits), f"row of {len(rows[i])} tokens"
