"""The CPU attention kernel (attention_kernel.py, query_attention.cpp): each query's result is its own, it
computes the attention block_attention computes, and load_model chooses it by what the CPU has."""

import pytest
import torch
from tiny_models import random_rows, write_default_path_package

import attention_kernel
import draft_model
import transformer

HEADS, KV_HEADS, HEAD_DIM, CAPACITY, SLOTS = 6, 2, 64, 320, 24


def kernel_or_skip() -> None:
    if not attention_kernel.wants_query_kernel("auto", torch.device("cpu"), torch.bfloat16):
        pytest.skip("the attention kernel cannot run on this CPU (it needs AVX512F and a C++ compiler)")


def random_cache(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values, (SLOTS, KV_HEADS, CAPACITY, HEAD_DIM) bf16, of trained-like scale."""
    generator = torch.Generator().manual_seed(seed)
    shape = (SLOTS, KV_HEADS, CAPACITY, HEAD_DIM)
    return (torch.randn(shape, generator=generator) * 2).bfloat16(), torch.randn(shape, generator=generator).bfloat16()


def random_queries(rows: int, queries: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (rows, queries, HEADS, HEAD_DIM) bf16, distinct slots (rows,) and positions (rows, queries)."""
    generator = torch.Generator().manual_seed(seed)
    q = (torch.randn(rows, queries, HEADS, HEAD_DIM, generator=generator) * 2).bfloat16()
    slots = torch.randperm(SLOTS, generator=generator)[:rows]
    positions = torch.randint(0, CAPACITY - 64, (rows, queries), generator=generator)
    return q, slots, positions


@pytest.mark.parametrize("rows", range(1, 18))
def test_each_row_gets_the_bits_it_gets_alone(rows):
    kernel_or_skip()
    keys, values = random_cache(seed=rows)
    q, slots, positions = random_queries(rows, 1, seed=100 + rows)
    together = attention_kernel.query_attention(q, keys, values, slots, positions)
    for row in range(rows):
        alone = attention_kernel.query_attention(
            q[row : row + 1], keys, values, slots[row : row + 1], positions[row : row + 1]
        )
        assert torch.equal(together[row], alone[0]), f"row {row} of {rows}"


def test_threads_and_what_lies_past_each_query_change_nothing():
    kernel_or_skip()
    keys, values = random_cache(seed=1)
    q, slots, positions = random_queries(5, 7, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention_kernel.query_attention(q, keys, values, slots, positions)
        torch.set_num_threads(2)
        two = attention_kernel.query_attention(q, keys, values, slots, positions)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    # Each query alone, with everything past its own position replaced by NaN: never read.
    for row in range(5):
        for t in range(7):
            stop = int(positions[row, t]) + 1
            poisoned_keys, poisoned_values = keys.clone(), values.clone()
            poisoned_keys[slots[row], :, stop:] = float("nan")
            poisoned_values[slots[row], :, stop:] = float("nan")
            alone = attention_kernel.query_attention(
                q[row : row + 1, t : t + 1],
                poisoned_keys,
                poisoned_values,
                slots[row : row + 1],
                positions[row : row + 1, t : t + 1],
            )
            assert torch.equal(alone[0, 0], one[row, t]), f"row {row}, query {t}"


# (query heads, kv heads, head_dim): the tests' shape, SmolLM2-135M's, Qwen3-1.7B's (the Qwen3-8B drafter), no
# GQA, and a group of 8.
SHAPES = [(HEADS, KV_HEADS, HEAD_DIM), (9, 3, 64), (16, 8, 128), (4, 4, 128), (32, 4, 128)]


@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_it_computes_softmax_attention_as_block_attention_does(heads, kv_heads, head_dim):
    kernel_or_skip()
    generator = torch.Generator().manual_seed(heads * head_dim)
    shape = (SLOTS, kv_heads, CAPACITY, head_dim)
    keys, values = ((torch.randn(shape, generator=generator) * 2).bfloat16() for _ in range(2))
    q = (torch.randn(4, 9, heads, head_dim, generator=generator) * 2).bfloat16()
    slots = torch.randperm(SLOTS, generator=generator)[:4]
    positions = torch.randint(0, CAPACITY - 64, (4, 9), generator=generator)
    ours = attention_kernel.query_attention(q, keys, values, slots, positions).double()
    window = CAPACITY - 64
    theirs = transformer.block_attention(q, keys[slots, :, :window], values[slots, :, :window], positions).double()
    exact = torch.empty_like(ours)
    group = heads // kv_heads
    for row, slot in enumerate(slots.tolist()):
        for t, position in enumerate(positions[row].tolist()):
            for head in range(heads):
                k = keys[slot, head // group, : position + 1].double()
                v = values[slot, head // group, : position + 1].double()
                weights = torch.softmax(k @ q[row, t, head].double() / head_dim**0.5, dim=0)
                exact[row, t, head] = weights @ v
    bf16_step = exact.abs().clamp(min=2**-8) * 2**-7  # one bf16 rounding of the result
    assert ((ours - exact).abs() <= bf16_step).all()
    assert ((theirs - exact).abs() <= bf16_step).all()


def test_auto_takes_the_kernel_only_where_it_runs(monkeypatch):
    cpu = torch.device("cpu")
    assert not attention_kernel.wants_query_kernel("auto", cpu, torch.float32)
    assert not attention_kernel.wants_query_kernel("torch", cpu, torch.bfloat16)
    monkeypatch.setattr(attention_kernel, "cpu_flags", lambda: frozenset({"avx2"}))
    assert not attention_kernel.wants_query_kernel("auto", cpu, torch.bfloat16)
    with pytest.raises(ValueError) as refused:
        attention_kernel.wants_query_kernel("query-kernel", cpu, torch.bfloat16)
    message = str(refused.value)
    assert "\n" not in message and "avx512f" in message and "choose auto or torch" in message
    with pytest.raises(ValueError, match="choose one of auto, query-kernel, torch"):
        attention_kernel.wants_query_kernel("flash", cpu, torch.bfloat16)


def test_drafts_are_the_same_with_the_kernel_or_without(tmp_path):
    kernel_or_skip()
    package = write_default_path_package(tmp_path / "package")
    with_kernel = draft_model.load_model(package, device="cpu", cache_slots=32)
    without = draft_model.load_model(package, device="cpu", cache_slots=32, attention_kernel="torch")
    assert with_kernel.kernel()["attention"] == "query-kernel" and without.kernel()["attention"] == "torch"
    rows = random_rows([5, 70, 130, 200], seed=7)
    assert draft_model.draft_batch(with_kernel, rows, 8) == draft_model.draft_batch(without, rows, 8)


def test_load_model_refuses_a_forced_kernel_in_one_line(tmp_path):
    package = write_default_path_package(tmp_path / "package")
    with pytest.raises(draft_model.ModelLoadError) as refused:
        draft_model.load_model(package, device="cpu", weights="dequant", attention_kernel="query-kernel")
    assert "\n" not in str(refused.value) and "bf16" in str(refused.value)
