"""evidence/gpu_check.py: its exactness check runs anywhere (here CPU against CPU); the whole check on a GPU."""

from pathlib import Path

import pytest

from evidence import gpu_check

MODEL = Path(__file__).resolve().parents[1] / "model"


def test_exactness_check_compares_drafts_on_the_cpu():
    report = gpu_check.exactness(MODEL, "cpu")
    assert report["float32"] == {"equal_to_cpu_fp32": True, "token_agreement": 1.0, "batch_equals_alone": True}
    assert 0.0 <= report["bfloat16"]["token_agreement"] <= 1.0


@pytest.mark.gpu
def test_gpu_drafts_equal_cpu_drafts_and_latency_is_measured(tmp_path):
    report = gpu_check.main(["--device", "cuda", "--repeats", "3", "--json", str(tmp_path / "gpu.json")])
    assert report["exactness"]["float32"]["equal_to_cpu_fp32"]
    assert report["latency_qwen3_1.7b_shape"]["cold_ms"] > 0
