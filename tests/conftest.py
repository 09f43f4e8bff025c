"""Shared fixtures: the repository root, a tiny random Qwen3 checkpoint written once per session, and what the
tests that run server.py over HTTP share (tests/live_server.py holds the helpers themselves)."""

from pathlib import Path

import pytest
import torch
from live_server import RunningServer, start_server, stop_server
from tiny_models import make_hf_model, write_hf_checkpoint

import draft_model

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3 (vocab 256, context 512) saved as a Hugging Face checkpoint directory."""
    return write_hf_checkpoint(make_hf_model("qwen3", seed=0), tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Leave the cores to the servers under test; restore afterwards for other modules. Modules that start
    servers use it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path):
    """The tiny checkpoint in this process: expected(tokens, max_tokens) is the draft of that sequence alone,
    on the settings the server uses by default."""
    drafter = draft_model.load_model(tiny_checkpoint, cache_slots=2)

    def expected(tokens: list[int], max_tokens: int = 16, return_logprobs: bool = False) -> draft_model.Draft:
        return draft_model.draft_batch(drafter, [tokens], max_tokens=max_tokens, return_logprobs=return_logprobs)[0]

    return expected


@pytest.fixture
def server(repo_root: Path, tmp_path: Path):
    """start(model_dir, *flags) -> RunningServer; every server started is stopped after the test."""
    started: list[RunningServer] = []

    def start(model_dir: Path, *flags: str) -> RunningServer:
        running = start_server(repo_root, model_dir, tmp_path / f"server-{len(started)}.log", *flags)
        started.append(running)
        return running

    yield start
    for running in started:
        stop_server(running)
