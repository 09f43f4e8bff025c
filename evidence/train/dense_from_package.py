"""Turn a model package back into a dense Hugging Face checkpoint, to continue distillation from it.

A package holds INT4 weights and a LoRA adapter, not the student it was quantized from; when that student
is gone (another machine, another sitting), this rebuilds the closest one: the INT4 weights dequantized
with the LoRA merged, exactly the weights the server drafts with, in fp32, beside the package's tokenizer
files. Pass the output as train_drafter's or run_pipeline's --base.

    python -m evidence.train.dense_from_package --package model --out BASE_DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evidence import common, packages


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", type=Path, required=True, help="model package directory (model/ format)")
    parser.add_argument("--out", type=Path, required=True, help="output Hugging Face checkpoint directory")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not packages.is_package(args.package):
        raise common.UserError(f"--package {args.package} is not a model package: it has no quant_config.json")
    logger = common.setup_logging(common.log_path_beside(args.out, "dense_from_package"), "dense_from_package")
    logger.info(
        "command: python -m evidence.train.dense_from_package %s", " ".join(sys.argv[1:] if argv is None else argv)
    )
    tokenizer = args.package if (args.package / "tokenizer.json").is_file() else None
    report = {"package": str(args.package), "out": str(args.out), "tokenizer": tokenizer is not None}
    report["parameters"] = packages.save_dense(args.package, args.out, tokenizer)
    logger.info("wrote %s (%d parameters)", args.out, report["parameters"])
    return report


if __name__ == "__main__":
    common.run_cli(main)
