"""evidence/bench/soak.py against a server on the tiny checkpoint: mixed valid, invalid and abandoned requests at
concurrency 32. Slow (minutes): run with `pytest -m slow tests/test_server_soak.py`."""

import json
from pathlib import Path

import pytest

from evidence.bench import soak


@pytest.mark.slow
def test_soak_has_no_500_flat_memory_health_throughout_and_drafts_equal_alone(tiny_checkpoint: Path, tmp_path: Path):
    report_path = tmp_path / "soak.json"
    argv = ["--model-dir", str(tiny_checkpoint), "--duration-s", "120", "--concurrency", "32"]
    report = soak.main([*argv, "--json", str(report_path)])
    assert report["passed"], report
    assert json.loads(report_path.read_text()) == report
    kinds = {key.rsplit(" ", 1)[0] if key[-1].isdigit() else key for key in report["statuses"]}
    assert {"valid", "invalid", "hang-up", "stalled upload"} <= kinds, report["statuses"]
    assert {"invalid 400", "invalid 413", "invalid 422"} <= set(report["statuses"]), report["statuses"]
    assert report["verified_alone"] == soak.VERIFY_SAMPLE
