"""The CPU attention kernels (attention_kernel.py, query_attention.cpp) and RMSNorm's beside them (rms_norm.cpp):
each query's and row's result is its own, they compute what PyTorch computes, and load_model chooses them by what
the CPU has."""

import pytest
import torch
from tiny_models import random_rows, write_default_path_package

import attention_kernel
import draft_model
import transformer
from planning import CHUNK

HEADS, KV_HEADS, HEAD_DIM, CAPACITY, SLOTS = 6, 2, 64, 320, 24


def kernel_or_skip() -> None:
    if not attention_kernel.wants_query_kernel("auto", torch.device("cpu"), torch.bfloat16):
        pytest.skip("the attention kernel cannot run on this CPU (it needs AVX512F and a C++ compiler)")


def chunk_kernel_or_skip() -> None:
    kernel_or_skip()
    if not attention_kernel.wants_chunk_kernel(True):
        pytest.skip("the chunk kernel cannot run on this CPU (it needs AVX512-BF16)")


def norm_kernel_or_skip() -> None:
    kernel_or_skip()
    if not attention_kernel.wants_norm_kernel(True):
        pytest.skip(f"RMSNorm's kernel could not be built: {attention_kernel.norm_build_problem()}")


def random_cache(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values, (SLOTS, KV_HEADS, CAPACITY, HEAD_DIM) bf16, of trained-like scale."""
    generator = torch.Generator().manual_seed(seed)
    shape = (SLOTS, KV_HEADS, CAPACITY, HEAD_DIM)
    return (torch.randn(shape, generator=generator) * 2).bfloat16(), torch.randn(shape, generator=generator).bfloat16()


def on_threads(threads: int, kernel, *arguments) -> torch.Tensor:
    """kernel(*arguments) computed on `threads` torch threads."""
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return kernel(*arguments)
    finally:
        torch.set_num_threads(saved)


def alone_with_nan_past(kernel, q, keys, values, slots, positions, row: int, t: int) -> torch.Tensor:
    """Query t of row `row` computed alone, with NaN in its slot past its position: what it must never read."""
    poisoned_keys, poisoned_values = keys.clone(), values.clone()
    poisoned_keys[slots[row], :, int(positions[row, t]) + 1 :] = float("nan")
    poisoned_values[slots[row], :, int(positions[row, t]) + 1 :] = float("nan")
    one = slice(row, row + 1), slice(t, t + 1)
    return kernel(q[one], poisoned_keys, poisoned_values, slots[row : row + 1], positions[one])[0, 0]


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
    one, two = (on_threads(n, attention_kernel.query_attention, q, keys, values, slots, positions) for n in (1, 2))
    assert torch.equal(one, two)
    # Each query alone, with everything past its own position replaced by NaN: never read.
    for row in range(5):
        for t in range(7):
            alone = alone_with_nan_past(attention_kernel.query_attention, q, keys, values, slots, positions, row, t)
            assert torch.equal(alone, one[row, t]), f"row {row}, query {t}"


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
    exact = exact_attention(q, keys, values, slots, positions)
    bf16_step = exact.abs().clamp(min=2**-8) * 2**-7  # one bf16 rounding of the result
    assert ((ours - exact).abs() <= bf16_step).all()
    assert ((theirs - exact).abs() <= bf16_step).all()


def exact_attention(q, keys, values, slots, positions) -> torch.Tensor:
    """Softmax attention of q (G, T, H, D) at positions (G, T) in fp64, one query head at a time."""
    exact = torch.empty(q.shape, dtype=torch.float64)
    group, head_dim = q.shape[2] // keys.shape[1], q.shape[3]
    for row, slot in enumerate(slots.tolist()):
        for t, position in enumerate(positions[row].tolist()):
            for head in range(q.shape[2]):
                k = keys[slot, head // group, : position + 1].double()
                v = values[slot, head // group, : position + 1].double()
                weights = torch.softmax(k @ q[row, t, head].double() / head_dim**0.5, dim=0)
                exact[row, t, head] = weights @ v
    return exact


def random_chunks(chunks: int, seed: int, heads: int = HEADS, head_dim: int = HEAD_DIM):
    """q (chunks, CHUNK, heads, head_dim) bf16 of complete chunks at random chunk starts of distinct slots (chunks,),
    and their positions (chunks, CHUNK)."""
    generator = torch.Generator().manual_seed(seed)
    q = (torch.randn(chunks, CHUNK, heads, head_dim, generator=generator) * 2).bfloat16()
    slots = torch.randperm(SLOTS, generator=generator)[:chunks]
    starts = torch.randint(0, CAPACITY // CHUNK, (chunks, 1), generator=generator) * CHUNK
    return q, slots, starts + torch.arange(CHUNK)


@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_each_query_of_a_chunk_gets_the_bits_it_gets_alone(chunks):
    """Chunks together, each alone, each query alone with NaN past its position, and with 1 or 2 threads."""
    chunk_kernel_or_skip()
    keys, values = random_cache(seed=chunks)
    q, slots, positions = random_chunks(chunks, seed=50 + chunks)
    one, together = (on_threads(n, attention_kernel.chunk_attention, q, keys, values, slots, positions) for n in (1, 2))
    assert torch.equal(one, together)
    for row in range(chunks):
        alone = attention_kernel.chunk_attention(
            q[row : row + 1], keys, values, slots[row : row + 1], positions[row : row + 1]
        )
        assert torch.equal(together[row], alone[0]), f"chunk {row} of {chunks}"
        for t in (0, 1, 17, CHUNK - 1):
            alone = alone_with_nan_past(attention_kernel.chunk_attention, q, keys, values, slots, positions, row, t)
            assert torch.equal(alone, together[row, t]), f"chunk {row}, query {t}"


@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
def test_the_chunk_kernel_computes_softmax_attention(heads, kv_heads, head_dim):
    chunk_kernel_or_skip()
    generator = torch.Generator().manual_seed(heads * head_dim)
    shape = (SLOTS, kv_heads, CAPACITY, head_dim)
    keys, values = ((torch.randn(shape, generator=generator) * 2).bfloat16() for _ in range(2))
    q, slots, positions = random_chunks(3, seed=heads + head_dim, heads=heads, head_dim=head_dim)
    ours = attention_kernel.chunk_attention(q, keys, values, slots, positions).double()
    exact = exact_attention(q, keys, values, slots, positions)
    assert ((ours - exact).abs() <= exact.abs().clamp(min=2**-8) * 2**-7).all()  # within one bf16 rounding


@pytest.mark.parametrize("dim", [64, 576, 72])  # 72: a row that does not fill its last vector
def test_the_norm_kernel_normalises_each_row_on_its_own(dim):
    """Fast against naive (PyTorch's RMSNorm in fp32), and each row's bits its own: alone or among others, on one
    thread or two."""
    norm_kernel_or_skip()
    x = (torch.randn(40, dim, generator=torch.Generator().manual_seed(dim)) * 3).bfloat16()
    ours = on_threads(2, torch.ops.draft_server_rms_norm.rms_norm, x, 1e-6)
    exact = torch.nn.functional.rms_norm(x.double(), (dim,), eps=1e-6)
    assert ((ours.double() - exact).abs() <= exact.abs() * 2**-8).all()  # within one bf16 rounding
    assert torch.equal(on_threads(1, torch.ops.draft_server_rms_norm.rms_norm, x, 1e-6), ours)
    for row in (0, 17, 39):
        assert torch.equal(torch.ops.draft_server_rms_norm.rms_norm(x[row : row + 1], 1e-6), ours[row : row + 1])


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
    monkeypatch.setattr(attention_kernel, "cpu_flags", lambda: frozenset({"avx512f"}))
    assert not attention_kernel.wants_chunk_kernel(True)  # complete chunks then take query_attention
    monkeypatch.setattr(attention_kernel, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert attention_kernel.wants_chunk_kernel(True) and not attention_kernel.wants_chunk_kernel(False)
    with pytest.raises(ValueError, match="choose one of auto, query-kernel, torch"):
        attention_kernel.wants_query_kernel("flash", cpu, torch.bfloat16)


def test_drafts_are_the_same_with_the_kernels_or_without(tmp_path, monkeypatch):
    kernel_or_skip()
    package = write_default_path_package(tmp_path / "package")
    with_kernels = draft_model.load_model(package, device="cpu", cache_slots=32)
    without = draft_model.load_model(package, device="cpu", cache_slots=32, attention_kernel="torch")
    assert with_kernels.kernel()["attention"] == attention_kernel.cpu_choice()
    norm = attention_kernel.norm_name(attention_kernel.wants_norm_kernel(True))
    assert with_kernels.kernel()["norm"] == norm and without.kernel()["norm"] == "torch"
    monkeypatch.setattr(attention_kernel, "cpu_flags", lambda: frozenset({"avx512f"}))
    query_kernel_only = draft_model.load_model(package, device="cpu", cache_slots=32)
    assert query_kernel_only.kernel()["attention"] == "query-kernel" and without.kernel()["attention"] == "torch"
    rows = random_rows([5, 70, 130, 200], seed=7)
    drafts = draft_model.draft_batch(without, rows, 8)
    assert draft_model.draft_batch(with_kernels, rows, 8) == drafts
    assert draft_model.draft_batch(query_kernel_only, rows, 8) == drafts


def test_load_model_refuses_a_forced_kernel_in_one_line(tmp_path):
    package = write_default_path_package(tmp_path / "package")
    with pytest.raises(draft_model.ModelLoadError) as refused:
        draft_model.load_model(package, device="cpu", weights="dequant", attention_kernel="query-kernel")
    assert "\n" not in str(refused.value) and "bf16" in str(refused.value)
