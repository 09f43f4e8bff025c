"""The layout keeps its shape: short files, imports that point one way, no reference outside the repository."""

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Each module may import only modules to its left (evidence/ and tests/ sit above all of them).
LAYERS = [
    "planning",
    "kernel_build",
    "int4",
    "attention_kernel",
    "kv_cache",
    "transformer",
    "package_manifest",
    "checkpoint",
    "engine",
    "draft_model",
    "server_settings",
    "metrics",
    "http_guards",
    "batcher",
    "api_schema",
    "server",
]
# Modules outside the layers: they import no project module at all.
STANDALONE = {"vllm_proposer": {"httpx"}}  # the engine-side client: the standard library and these packages only
# evidence/: the shared library and the driver at the top, every script in the folder of its stage
# (evidence/README.md's table); the shared library imports no stage.
EVIDENCE_LIBRARY = {"__init__", "common", "packages", "inventory"}
EVIDENCE_DRIVER = {"run_pipeline", "pipeline_checks"}
EVIDENCE_STAGES = {"prompts", "teacher", "train", "quantize", "measure", "bench"}


def tracked_python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / line for line in listed.stdout.split()]


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_top_level_modules_import_only_the_layers_below_them():
    for rank, module in enumerate(LAYERS):
        own = imported_modules(REPO / f"{module}.py") & set(LAYERS)
        above = sorted(name for name in own if LAYERS.index(name) >= rank)
        assert not above, f"{module}.py imports {above}, which sit at or above it in {LAYERS}"


def test_no_project_module_imports_evidence_or_tests():
    for module in LAYERS:
        assert not imported_modules(REPO / f"{module}.py") & {"evidence", "tests"}, module


def test_evidence_keeps_the_library_and_the_driver_at_the_top_and_each_script_in_its_stage():
    evidence = REPO / "evidence"
    assert {path.stem for path in evidence.glob("*.py")} == EVIDENCE_LIBRARY | EVIDENCE_DRIVER
    assert {path.parent.name for path in evidence.glob("*/*.py")} == EVIDENCE_STAGES
    for stage in EVIDENCE_STAGES:  # what the stage reads and writes
        assert ast.get_docstring(ast.parse((evidence / stage / "__init__.py").read_text())), stage
    for module in EVIDENCE_LIBRARY:
        # full dotted names: `from evidence.x import y` and `from evidence import x` both name evidence.x
        imported = set()
        for node in ast.walk(ast.parse((evidence / f"{module}.py").read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        stages = sorted(
            name for name in imported if name.startswith("evidence.") and name.split(".")[1] in EVIDENCE_STAGES
        )
        assert not stages, f"evidence/{module}.py imports the stage modules {stages}"


def test_every_top_level_module_is_in_the_layers_or_standalone():
    top_level = {path.stem for path in REPO.glob("*.py")}
    assert top_level == set(LAYERS) | set(STANDALONE)


def test_the_package_installs_every_top_level_module():
    """pyproject.toml lists the flat layout's modules by name: a module missing there imports in a checkout
    and fails in an installed copy."""
    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["py-modules"]
    assert sorted(listed) == sorted(set(LAYERS) | set(STANDALONE))


@pytest.mark.parametrize("module", sorted(STANDALONE))
def test_standalone_modules_import_only_the_standard_library_and_their_packages(module):
    imported = imported_modules(REPO / f"{module}.py")
    third_party = {name for name in imported if name not in sys.stdlib_module_names and name != "__future__"}
    assert third_party <= STANDALONE[module], f"{module}.py imports {sorted(third_party - STANDALONE[module])}"


@pytest.mark.parametrize("path", tracked_python_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_source_files_stay_short(path):
    limit = 450 if path.name in ("draft_model.py", "server.py") else 600
    assert len(path.read_text().splitlines()) <= limit


def test_every_document_a_file_names_ships_with_the_repository():
    """A reader can open every markdown document the code and docs point to: none lives outside the repo."""
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    shipped = {name for name in listed if name.endswith(".md")}
    for name in listed:
        path = REPO / name
        if path.suffix not in (".py", ".md", ".json", ".sh", ".toml") or not path.is_file():
            continue
        for cited in re.findall(r"[\w./-]+\.md\b", path.read_text()):
            resolved = Path(os.path.relpath((path.parent / cited).resolve(), REPO.resolve())).as_posix()
            assert (
                resolved in shipped
                or cited in shipped
                or any(shipped_name.endswith("/" + cited) for shipped_name in shipped)
            ), f"{name} names {cited}, which the repository does not ship"
