"""The integrity manifest of a model package: checksums.json holds the sha256 of every other file in it.

The package writers (evidence/quantize/make_random_package.py, gptq_drafter.py, lora_after_gptq.py) call
`write_manifest` once the files are in place; checkpoint.load_weights calls `verify_manifest` before it
reads anything, so a flipped bit or a swapped file is refused instead of drafting from damaged weights.
After changing a file of a package by hand (a model card, say), write its manifest again:

    python package_manifest.py model
"""

import argparse
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

MANIFEST = "checksums.json"
READ_BY_LOADER = (".json", ".safetensors")  # a file of these kinds that the manifest does not list is refused
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class ManifestMismatch(ValueError):
    """The files of a package do not match its manifest; the message names the file and both hashes."""


def sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def package_files(directory: Path) -> list[Path]:
    """The files a manifest covers: every regular file but the manifest and hidden ones (temporaries)."""
    return sorted(
        path
        for path in directory.iterdir()
        if path.is_file() and path.name != MANIFEST and not path.name.startswith(".")
    )


def write_manifest(directory: Path) -> dict[str, str]:
    """Hash every file of `directory` into its checksums.json (written under a temporary name, then renamed)."""
    hashes = {path.name: sha256_file(path) for path in package_files(directory)}
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{MANIFEST}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as out:
            out.write(json.dumps({"sha256": hashes}, indent=2, sort_keys=True) + "\n")
        os.chmod(temporary, 0o644)
        os.replace(temporary, directory / MANIFEST)
    finally:
        Path(temporary).unlink(missing_ok=True)
    return hashes


def has_manifest(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def verify_manifest(directory: Path) -> bool:
    """True when every file matches the manifest, False when there is no manifest (a plain Hugging Face
    directory); raises ManifestMismatch for a damaged, missing or unlisted file or a malformed manifest."""
    path = directory / MANIFEST
    if not path.is_file():
        return False
    hashes = read_manifest(path)
    for name, expected in sorted(hashes.items()):
        if not (directory / name).is_file():
            raise ManifestMismatch(f"{directory / name}: listed in {MANIFEST} but missing")
        actual = sha256_file(directory / name)
        if actual != expected:
            raise ManifestMismatch(
                f"{directory / name}: sha256 {actual} does not match {expected} recorded in {MANIFEST}; "
                "the file is damaged or was replaced"
            )
    unlisted = [p.name for p in package_files(directory) if p.name not in hashes and p.suffix in READ_BY_LOADER]
    if unlisted:
        raise ManifestMismatch(
            f"{directory / unlisted[0]}: not listed in {MANIFEST}; rewrite the manifest if the file belongs there"
        )
    return True


def read_manifest(path: Path) -> dict[str, str]:
    try:
        hashes = json.loads(path.read_text()).get("sha256")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as error:
        raise ManifestMismatch(f"{path}: not a JSON object with a 'sha256' map ({error})") from None
    valid = isinstance(hashes, dict) and all(
        isinstance(name, str) and "/" not in name and name not in (".", "..") and SHA256_HEX.fullmatch(str(digest))
        for name, digest in hashes.items()
    )
    if not valid:
        raise ManifestMismatch(f"{path}: 'sha256' must map each file name of the package to its 64-hex-digit hash")
    return hashes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="the package whose checksums.json is written")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        parser.error(f"{args.directory} is not a directory")
    hashes = write_manifest(args.directory)
    print(f"wrote {args.directory / MANIFEST}: {len(hashes)} files")


if __name__ == "__main__":
    main()
