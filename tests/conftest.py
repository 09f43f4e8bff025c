"""Shared fixtures: the repository root, a tiny random Qwen3 checkpoint written once per session, what the
tests that run server.py over HTTP share (tests/live_server.py holds the helpers themselves), and the evidence
pipeline's inputs and its one tiny run, shared by test_pipeline.py and test_pipeline_sources.py
(tests/pipeline_fixtures.py holds their helpers)."""

from pathlib import Path

import pytest
import torch
from live_server import RunningServer, start_server, stop_server
from pipeline_fixtures import perturbed_copy, pipeline_argv, write_eval_prompts, write_mirror, write_tokenizer
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


# ---------------------------------------------------------------------------------------------------
# The evidence pipeline at tiny scale, run once for test_pipeline.py and test_pipeline_sources.py


@pytest.fixture(scope="session")
def pipeline_inputs(tmp_path_factory) -> dict[str, Path]:
    """Mirror + locked manifest, tokenizer, a tiny random Qwen3 teacher, and a base model that is a
    perturbed copy of it (as a small model of the same family would be)."""
    root = tmp_path_factory.mktemp("pipeline-inputs")
    write_mirror(root / "mirror", root / "manifest.json")
    teacher = make_hf_model("qwen3", seed=1)
    write_hf_checkpoint(teacher, root / "teacher")
    write_hf_checkpoint(perturbed_copy(teacher, noise=0.3, seed=2), root / "base")
    write_tokenizer(root / "tokenizer")
    return {
        "root": root,
        "mirror": root / "mirror",
        "manifest": root / "manifest.json",
        "teacher": root / "teacher",
        "base": root / "base",
        "tokenizer": root / "tokenizer",
        "eval_prompts": write_eval_prompts(root / "tokenizer", root / "eval.jsonl"),
    }


@pytest.fixture(scope="session")
def pipeline_run(pipeline_inputs, tmp_path_factory) -> dict:
    from evidence import run_pipeline  # here, not at the top: only the pipeline tests pay for its imports

    work, out = tmp_path_factory.mktemp("work"), tmp_path_factory.mktemp("out") / "package"
    record = run_pipeline.main(pipeline_argv(pipeline_inputs, work, out))
    return {"record": record, "work": work, "out": out}
