"""Model packages as Hugging Face models, for the evidence scripts that measure or train on them.

A package (model/ format: config.json, quant_config.json, model_int4.safetensors, optional LoRA) is read
with draft_model's own strict loader and turned into the matching transformers model on exactly the
weights draft_model computes with, so what the scripts measure is what the server drafts with; or written
out as that dense checkpoint (to continue training, or for an engine's draft model). A package leaves the
pipeline with the tokenizer it was trained with, copied byte for byte under its checksums.
Not a script: imported by the stages that measure, quantize, train or bench packages and by run_pipeline.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import checkpoint
import draft_model
import package_manifest
from evidence import common


def dequantized_model(
    package_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32, with_lora: bool = True
) -> torch.nn.Module:
    """The package as a Hugging Face model: INT4 dequantized and, when asked, the LoRA adapter merged.
    Loading is draft_model's, so it is strict and checks the package's checksums."""
    try:
        drafter = draft_model.load_model(
            package_dir, "cpu", torch.float32, weights="dequant", use_lora=with_lora, cache_slots=2, max_context=1
        )
    except draft_model.ModelLoadError as error:
        raise common.UserError(str(error)) from None
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(package_dir), dtype=torch.float32)
    model.load_state_dict(drafter.hf_state_dict())
    return model.to(device=device, dtype=dtype).eval()


def is_package(path: Path) -> bool:
    return (path / checkpoint.PACKAGE_QUANT_CONFIG).is_file()


def load_any_model(path: Path, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A Hugging Face model directory, or a model package (INT4 dequantized, LoRA merged if present)."""
    if is_package(path):
        return dequantized_model(path, device=device, dtype=dtype, with_lora=True)
    if not (path / "config.json").is_file():
        raise common.UserError(
            f"{path} is neither a model directory (config.json) nor a model package ({checkpoint.PACKAGE_QUANT_CONFIG})"
        )
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")  # the ones transformers reads


def tokenizer_files(source: Path) -> list[Path]:
    """The transformers tokenizer files in `source`; refused when it holds no tokenizer.json."""
    if not (source / "tokenizer.json").is_file():
        raise common.UserError(f"{source} holds no tokenizer.json; give the directory of a transformers tokenizer")
    return [source / name for name in TOKENIZER_FILES if (source / name).is_file()]


def copy_tokenizer(source: Path, directory: Path) -> None:
    """Copy the tokenizer files of `source`, byte for byte, into `directory`, so a package or a draft directory
    carries what an engine needs to turn text into the ids it drafts on."""
    for file in tokenizer_files(source):
        shutil.copyfile(file, directory / file.name)


def publish(package: Path, tokenizer: Path, out: Path) -> None:
    """Copy the package and the tokenizer's files to `out` in one step (all or nothing), under a manifest that
    covers both."""
    with common.atomic_directory(out) as staging:
        for file in sorted(package.iterdir()):
            shutil.copyfile(file, staging / file.name)
        copy_tokenizer(tokenizer, staging)
        package_manifest.write_manifest(staging)


def save_dense(package: Path, out: Path, tokenizer: Path | None) -> int:
    """Write the package as a dense fp32 Hugging Face checkpoint (INT4 dequantized, LoRA merged: the weights the
    server drafts with) to `out`, with `tokenizer`'s files when given; its parameter count."""
    if out.resolve() == package.resolve():
        raise common.UserError(f"--out {out} is the package itself; write the dense checkpoint elsewhere")
    model = dequantized_model(package, dtype=torch.float32, with_lora=True)
    with common.atomic_directory(out) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            copy_tokenizer(tokenizer, staging)
    return sum(parameter.numel() for parameter in model.parameters())
