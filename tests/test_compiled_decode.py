"""The fixed-shape decode step: planning, no host reads inside the k-step loop, and the compiled step (inductor
on the CPU) built once per batch bucket and drafting exactly what the eager step drafts."""

import random

import pytest
import torch
from tiny_models import write_default_path_package
from torch._dynamo.utils import counters

import draft_model
import engine
import planning

# ---- planning


def test_batch_buckets_must_be_increasing_powers_of_two():
    assert planning.bucket_problem((1, 2, 4, 8, 16)) is None
    assert planning.bucket_problem((4,)) is None
    for bad in [(), (1, 3), (2, 1), (1, 1, 2), (0, 1)]:
        assert "powers of two" in planning.bucket_problem(bad), bad


def test_a_batch_takes_the_smallest_bucket_that_holds_it_and_larger_ones_are_split():
    buckets = (1, 2, 4, 8, 16)
    assert [planning.batch_bucket(n, buckets) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError, match="split"):
        planning.batch_bucket(17, buckets)
    assert planning.rows_per_call(cache_slots=64, buckets=buckets) == 16
    assert planning.rows_per_call(cache_slots=10, buckets=buckets) == 5


def test_windows_are_two_chunks_times_a_power_of_two_within_the_capacity():
    assert [planning.window_bucket(k, 4096) for k in (1, 128, 129, 300, 1000, 4096)] == [128, 128, 256, 512, 1024, 4096]
    assert planning.window_bucket(1000, 640) == 640
    assert planning.chunk_end(63, 4096) == 64 and planning.chunk_end(64, 4096) == 128


def test_a_compiled_cpu_step_reads_the_chunks_its_rows_need_and_at_least_two():
    assert [planning.exact_window(k, 4096) for k in (1, 128, 129, 300, 1000, 4096)] == [128, 128, 192, 320, 1024, 4096]
    assert planning.exact_window(1, 64) == 64


def test_a_slot_holds_the_model_context_up_to_the_default_cap():
    assert planning.default_context(2048) == 2048
    assert planning.default_context(40960) == planning.DEFAULT_MAX_CONTEXT == 4096


# ---- the loop


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return write_default_path_package(tmp_path_factory.mktemp("compiled") / "package")


def rows_spread_over_the_context(capacity: int, count: int, seed: int) -> list[list[int]]:
    generator = random.Random(seed)
    lengths = [1 + (capacity - 40) * i // (count - 1) for i in range(count)]  # 1 .. near the end of the context
    generator.shuffle(lengths)
    return [[generator.randrange(256) for _ in range(n)] for n in lengths]


def drafts(drafter, rows: list[list[int]], max_tokens: int = 15) -> list[tuple[list[int], list[float]]]:
    made = draft_model.draft_batch(drafter, rows, max_tokens=max_tokens, return_logprobs=True, stop_token_ids=[])
    return [(list(d), d.logprobs) for d in made]


def test_nothing_inside_the_k_step_loop_reads_a_device_value_on_the_host(package, monkeypatch):
    drafter = draft_model.load_model(package, cache_slots=8)
    rows = rows_spread_over_the_context(drafter.cache.capacity, 3, seed=0)
    expected = drafts(drafter, rows)
    monkeypatch.setattr(engine.Decoder, "may_read_host", lambda self: False)  # the CPU-only early exit
    to_host = engine.Decoder._to_host
    syncing = ["item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"]
    originals = {name: getattr(torch.Tensor, name) for name in syncing}

    def refuse(name):
        def method(*args, **kwargs):
            raise AssertionError(f"the decode loop read a tensor on the host (Tensor.{name})")

        return method

    def decode_without_host_reads(self, *args, **kwargs):
        for name in syncing:
            monkeypatch.setattr(torch.Tensor, name, refuse(name))
        try:
            return decode(self, *args, **kwargs)
        finally:
            for name, original in originals.items():
                monkeypatch.setattr(torch.Tensor, name, original)

    def restore_then_transfer(*args):
        for name, original in originals.items():
            monkeypatch.setattr(torch.Tensor, name, original)
        return to_host(*args)

    decode = engine.Decoder.decode
    monkeypatch.setattr(engine.Decoder, "decode", decode_without_host_reads)
    monkeypatch.setattr(engine.Decoder, "_to_host", staticmethod(restore_then_transfer))
    fresh = draft_model.load_model(package, cache_slots=8)
    assert drafts(fresh, rows) == expected


@pytest.fixture(scope="module")
def compiled(package):
    torch._dynamo.reset()
    counters.clear()
    return draft_model.load_model(package, cache_slots=64, compiled=True)


def test_the_compiled_step_is_one_graph_per_batch_bucket_and_drafts_what_eager_drafts(package, compiled):
    eager = draft_model.load_model(package, cache_slots=64)
    rows = rows_spread_over_the_context(compiled.cache.capacity, 16, seed=1)
    for size in (1, 2, 3, 5, 16):  # every bucket: 1, 2, 4, 8, 16; 15 steps; windows of 128 keys to the context
        for start in range(0, 16, size):
            part = rows[start : start + size]
            assert drafts(compiled, part) == drafts(eager, part), f"batch of {size} from row {start}"
    assert sorted(compiled.decoder.steps) == [1, 2, 4, 8, 16]
    assert counters["stats"]["unique_graphs"] == 5, dict(counters["stats"])
    assert not counters["recompiles"] and not counters["graph_break"]


def test_a_compiled_step_on_the_cpu_pads_the_batch_to_its_bucket_and_reads_the_chunks_it_needs(compiled):
    capacity = compiled.cache.capacity
    assert compiled.decoder.shapes([[1] * 130, [1] * 7], [16, 16]) == (2, planning.exact_window(145, capacity))
    assert compiled.decoder.shapes([[1] * 3] * 3, [4] * 3) == (4, 2 * planning.CHUNK)


def test_compiled_follow_ups_from_the_cache_draft_what_a_cold_call_drafts(package, compiled):
    rows = rows_spread_over_the_context(compiled.cache.capacity, 5, seed=2)
    for turn in range(3):
        made = drafts(compiled, rows)
        # Cold and eager: equal bits to the compiled step (above), so any difference is the cache's.
        assert made == drafts(draft_model.load_model(package, cache_slots=64), rows), f"turn {turn}"
        rows = [
            row + tokens[: (turn * 5 + i) % 9] + [(i + turn) % 256]
            for i, (row, (tokens, _)) in enumerate(zip(rows, made))
        ]


def test_the_layout_cuda_runs_compiles_on_the_cpu_and_drafts_what_eager_drafts(package):
    """Dense bf16 weights with the LoRA merged and PyTorch's attention (what WEIGHTS=dequant runs on a GPU): its
    compiled step, traced on the CPU, drafts what the same layout drafts eagerly, follow-ups from the cache too."""
    layout = {"weights": "dequant", "dtype": torch.bfloat16, "attention_kernel": "torch", "cache_slots": 32}
    compiled, eager = (draft_model.load_model(package, compiled=on, **layout) for on in (True, False))
    rows = rows_spread_over_the_context(compiled.cache.capacity, 5, seed=3)
    for turn in range(2):
        made = drafts(compiled, rows)
        assert made == drafts(eager, rows), f"turn {turn}"
        rows = [row + tokens[:3] + [i] for i, (row, (tokens, _)) in enumerate(zip(rows, made))]
