"""LoRA on the frozen INT4 drafter: win back what quantization lost, with the distillation loss.

Loads the model package's INT4 weights dequantized into a Hugging Face model (frozen), adds a PEFT LoRA
adapter on the projections, trains it with train_drafter.py's loss, optimiser and schedule, keeps the
adapter with the best holdout tau (step 0, the INT4 model alone, included), and writes it into the
package as PEFT's files under the package names: `lora.safetensors` (adapter_model.safetensors keys,
e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight) and `lora_config.json`
(adapter_config.json). Reports holdout tau before and after in PACKAGE_DIR.lora_after_gptq.json (the
"after" figure is measured again on the package as written, adapter merged), log PACKAGE_DIR.lora_after_gptq.log.

    python -m evidence.quantize.lora_after_gptq --package WORK/package --data WORK/data --rank 16 --alpha 32 \
        --lr 1e-4 --epochs 1 --k 16
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

import checkpoint
import package_manifest
from evidence import common
from evidence.inventory import PROJECTIONS
from evidence.measure.tau import offline_tau
from evidence.packages import dequantized_model
from evidence.teacher.gen_data import load_split
from evidence.train.train_drafter import TrainSettings, add_train_arguments, settings_from_args, train


def add_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float, targets: list[str]) -> torch.nn.Module:
    """A PEFT model whose only trainable parameters are the LoRA matrices (B starts at zero, so step 0
    is exactly the INT4 model)."""

    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none", task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)


def write_adapter(
    peft_model: torch.nn.Module, package_dir: Path, base_name: str, store_dtype: torch.dtype = torch.bfloat16
) -> None:
    """PEFT's adapter files, renamed to the package's names, each written atomically. The LoRA matrices are
    stored in `store_dtype` (cast in place: training is over, and what is measured next is the package)."""
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.data = parameter.data.to(store_dtype)
    with tempfile.TemporaryDirectory(dir=package_dir.parent) as staging:
        peft_model.save_pretrained(staging, safe_serialization=True)
        config = json.loads((Path(staging) / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = base_name  # not the local path the weights were read from
        common.atomic_write_json(package_dir / checkpoint.PACKAGE_LORA_CONFIG, config)
        with common.atomic_path(package_dir / checkpoint.PACKAGE_LORA_WEIGHTS) as temporary:
            shutil.copyfile(Path(staging) / "adapter_model.safetensors", temporary)
    package_manifest.write_manifest(package_dir)  # the package's sha256 manifest now covers the adapter too


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--package",
        type=Path,
        required=True,
        help="model package from gptq_drafter.py (the adapter is written into it)",
    )
    parser.add_argument("--data", type=Path, required=True, help="gen_data.py output directory")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--target-modules", nargs="+", default=list(PROJECTIONS))
    parser.add_argument(
        "--store-dtype", choices=("bfloat16", "float32"), default="bfloat16", help="dtype of the stored LoRA matrices"
    )
    parser.add_argument("--device", default=None)
    add_train_arguments(parser, TrainSettings(lr=1e-4))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    settings = settings_from_args(args)
    if args.rank < 1:
        raise common.UserError(f"--rank must be at least 1, got {args.rank}")
    unknown = sorted(set(args.target_modules) - set(PROJECTIONS))
    if unknown:
        raise common.UserError(f"--target-modules {unknown} are not projections; choose from {list(PROJECTIONS)}")
    logger = common.setup_logging(common.log_path_beside(args.package, "lora_after_gptq"), "lora_after_gptq")
    logger.info(
        "command: python -m evidence.quantize.lora_after_gptq %s", " ".join(sys.argv[1:] if argv is None else argv)
    )
    if not (args.package / checkpoint.PACKAGE_WEIGHTS).is_file():
        raise common.UserError(
            f"--package {args.package} has no {checkpoint.PACKAGE_WEIGHTS}; run gptq_drafter.py first"
        )
    torch.manual_seed(settings.seed)
    device = common.pick_device(args.device)
    train_examples, holdout = load_split(args.data, settings.first_shard, settings.last_shard)
    model = dequantized_model(args.package, device=device, with_lora=False).requires_grad_(False)
    peft_model = add_lora(model, args.rank, args.alpha, args.dropout, args.target_modules)
    result = train(peft_model, train_examples, holdout, settings, logger)
    card = common.read_json(args.package / checkpoint.PACKAGE_MODEL_CARD, "model card")
    write_adapter(peft_model, args.package, card.get("name", "drafter-int4"), getattr(torch, args.store_dtype))
    written = dequantized_model(args.package, device=device, with_lora=True)
    after = offline_tau(written, holdout, settings.k, settings.eval_batch_size, progress=False)
    report = {
        "lora": {
            "r": args.rank,
            "lora_alpha": args.alpha,
            "lora_dropout": args.dropout,
            "target_modules": args.target_modules,
            "store_dtype": args.store_dtype,
        },
        "settings": asdict(settings),
        **result,
        "holdout_tau_before": result["history"][0]["holdout_tau"],
        "holdout_tau_after": after.tau,
        "holdout_after": asdict(after),
    }
    common.atomic_write_json(common.log_path_beside(args.package, "lora_after_gptq").with_suffix(".json"), report)
    logger.info(
        "holdout tau: INT4 %.4f -> INT4 + LoRA %.4f (package as written)", report["holdout_tau_before"], after.tau
    )
    return report


if __name__ == "__main__":
    common.run_cli(main)
