"""evidence/bench/gpu_check.py: its exactness check runs anywhere; the whole check, GPU against CPU, on a GPU."""

from pathlib import Path

import pytest

from evidence.bench import gpu_check

MODEL = Path(__file__).resolve().parents[1] / "model"


def test_on_the_cpu_every_path_drafts_the_same_in_a_batch_alone_and_from_the_cache():
    report = gpu_check.exactness(MODEL, "cpu")
    for path in ("float32", "bfloat16", "packed"):
        assert report[path]["batch_equals_alone"] and report[path]["cached_equals_cold"], path


@pytest.mark.gpu
def test_gpu_drafts_equal_cpu_drafts_and_latency_is_measured(tmp_path):
    report = gpu_check.main(["--device", "cuda", "--repeats", "3", "--json", str(tmp_path / "gpu.json")])
    assert report["exactness"]["float32"]["equal_to_cpu_fp32"]
    assert report["exactness"]["transformers_fp32_equal_to_cpu"]
    latency = report["latency_qwen3_1.7b_shape"]
    assert latency["int4_compiled_syncs_in_the_loop"] == latency["bf16_compiled_syncs_in_the_loop"] == "0"
    assert latency["int4_compiled_weights"] == "packed" and latency["int4_compiled_batch_1"]["cold_ms"] > 0
