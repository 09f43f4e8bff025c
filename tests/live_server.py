"""Helpers for tests that run server.py over real HTTP: start it on a free loopback port, stop it, read /metrics.

Not a test module: conftest.py builds its fixtures from these, and scripts' tests may import them.
"""

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT_S = 90


@dataclass
class RunningServer:
    process: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(
    repo_root: Path, model_dir: Path, log_path: Path, *flags: str, port: int | None = None
) -> RunningServer:
    """Start server.py (on `port`, else a free one) and wait until /health answers; fail with its log if it never
    does."""
    port = port or free_port()
    # One thread: the suite shares 2 cores with other test processes, and oversubscribed torch threads crawl.
    command = [sys.executable, str(repo_root / "server.py"), "--model-dir", str(model_dir), "--port", str(port)]
    command += ["--threads", "1", *flags]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=repo_root)
    running = RunningServer(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode} during startup:\n{running.log()}")
        try:
            if httpx.get(running.url + "/health", timeout=1).status_code == 200:
                return running
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    pytest.fail(f"server did not answer /health within {STARTUP_TIMEOUT_S} s:\n{running.log()}")


def stop_server(running: RunningServer) -> None:
    if running.process.poll() is None:
        running.process.send_signal(signal.SIGTERM)
        try:
            running.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            running.process.kill()
            running.process.wait()


def metric_samples(metrics_text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
    }


def prompt(length: int, seed: int, vocab_size: int = 256) -> list[int]:
    """A deterministic token sequence of `length` ids below vocab_size."""
    return [(seed * 7919 + i * 104729) % vocab_size for i in range(length)]
