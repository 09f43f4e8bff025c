"""What every evidence script shares: `python -m evidence.STAGE.NAME --help` works and names the command, and
records are written into shared JSON files under their own (dotted) key."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evidence import common

ROOT = Path(__file__).resolve().parents[1]


def evidence_scripts() -> list[str]:
    """Every script in evidence/ and its stage folders (a module that runs as __main__), by module name
    below evidence (`gen_data` in evidence/teacher/ is `teacher.gen_data`)."""
    return sorted(
        ".".join(path.relative_to(ROOT / "evidence").with_suffix("").parts)
        for path in (ROOT / "evidence").glob("**/*.py")
        if 'if __name__ == "__main__":' in path.read_text()
    )


HELP_RUNNER = """
import contextlib, io, json, runpy, sys
results = {}
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module("evidence." + name, run_name="__main__", alter_sys=True)  # what python -m does
        code = None
    except SystemExit as exit:
        code = exit.code
    results[name] = [code, out.getvalue()]
print(json.dumps(results))
"""


def test_every_script_has_help():
    """`python -m evidence.NAME --help` for every script (run as python -m runs it, from the repo root, in
    one fresh process so torch is imported once): exit status 0 and the docstring with the script's command."""
    scripts = evidence_scripts()
    assert {"run_pipeline", "teacher.gen_data", "measure.measure_tau", "bench.bench_draft"} <= set(
        scripts
    )  # the glob found them
    result = subprocess.run(
        [sys.executable, "-c", HELP_RUNNER, *scripts], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for name, (code, out) in json.loads(result.stdout.splitlines()[-1]).items():
        assert code == 0, (name, code)
        assert f"evidence.{name}" in out or f"evidence/{name.replace('.', '/')}.py" in out, (
            name
        )  # the command to run it


def test_records_nest_under_a_dotted_key():
    record = {"shipped_package": {"model_bytes": 1}}
    common.set_dotted(record, "shipped_package.measured_tau", {"tau": 1.5})
    common.set_dotted(record, "full_scale.evidence_pipeline", {"k": 16})
    assert record == {
        "shipped_package": {"model_bytes": 1, "measured_tau": {"tau": 1.5}},
        "full_scale": {"evidence_pipeline": {"k": 16}},
    }
    with pytest.raises(common.UserError, match="not a JSON object"):
        common.set_dotted(record, "shipped_package.model_bytes.x", 2)
