"""Shared fixtures: the repository root and a tiny random Qwen3 checkpoint written once per session."""

from pathlib import Path

import pytest
from tiny_models import make_hf_model, write_hf_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3 (vocab 256, context 512) saved as a Hugging Face checkpoint directory."""
    return write_hf_checkpoint(make_hf_model("qwen3", seed=0), tmp_path_factory.mktemp("tiny-qwen3"))
