"""Draft latency of our drafter (packed INT4 and dequantized) against transformers generate(), same weights, one run.

For each model shape it writes a random GPTQ package with evidence/make_random_package.py (random
weights time exactly like trained ones), loads it two or three ways, and times 16-token greedy drafts:

  ours packed    draft_model, GPTQ linears kept at 4 bits on PyTorch's CPU INT4 kernel (bf16)
  ours packed+q-head   the same with the lm_head rounded to INT4 at load (quantize_lm_head); only for
                 packages whose tied table is bf16 (with --embedding-group-size the head already is INT4)
  ours dequant   draft_model, weights dequantized to fp32 (the exact path)
  hf bf16        transformers generate() on the same dequantized weights (LoRA merged) in bf16,
                 its fastest dtype on these CPUs (--hf-dtypes adds float32)

at each batch size and context length: "cold" on fresh prompts, and "cached" on the harness'
follow-up (the previous prompt + 8 accepted draft tokens + a bonus token), which our prefix cache
serves by prefilling 9 tokens; transformers has no cross-call cache and recomputes everything.
Every cell is the median of --repeats runs on new prompts. Ratios are hf bf16 time / ours.
Also printed: resident weight bytes per path, and how often packed and dequantized drafts agree.

Reads nothing (or --package DIR, e.g. model/, benchmarked as a further shape). Writes a table to
stdout and, with --json, the figures to a file.

    python evidence/bench_draft.py --shapes qwen3-180m,qwen3-0.6b --json bench_draft.json
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import draft_model  # noqa: E402
import int4  # noqa: E402

SHAPES = {  # make_random_package.py flags; real Qwen3 vocabulary, tied embeddings, group 128
    "qwen3-180m": "--hidden-size 512 --intermediate-size 2048 --layers 24 --heads 8 --kv-heads 4 --head-dim 64",
    "qwen3-0.6b": "--hidden-size 1024 --intermediate-size 3072 --layers 28 --heads 16 --kv-heads 8 --head-dim 128",
    "qwen3-1.7b": "--hidden-size 2048 --intermediate-size 6144 --layers 28 --heads 16 --kv-heads 8 --head-dim 128",
}
DRAFT_TOKENS = 16
ACCEPTED = 8  # draft tokens the follow-up request keeps, before the target's bonus token
AGREEMENT_ROWS = 32  # prompts whose packed and dequantized drafts are compared


def make_package(shape: str, directory: Path, lora_rank: int, embedding_group_size: int | None) -> Path:
    output = directory / shape
    flags = SHAPES[shape].split() + ["--group-size", "128", "--lora-rank", str(lora_rank), "--output", str(output)]
    if embedding_group_size:
        flags += ["--embedding-group-size", str(embedding_group_size)]
    subprocess.run(
        [sys.executable, str(REPO / "evidence" / "make_random_package.py"), *flags],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return output


def transformers_model(dense: draft_model.Drafter, package: Path, dtype: torch.dtype) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.from_pretrained(package)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dense.hf_state_dict(), strict=False)  # a tied lm_head arrives as the embedding
    return model.to(dtype).eval()


def median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Prompts:
    """Fresh random prompts on every call, so a 'cold' call never finds its prefix in the cache."""

    def __init__(self, vocab_size: int, seed: int):
        self.vocab_size, self.generator = vocab_size, torch.Generator().manual_seed(seed)

    def rows(self, batch: int, length: int) -> list[list[int]]:
        return torch.randint(0, self.vocab_size, (batch, length), generator=self.generator).tolist()


def time_ours(drafter: draft_model.Drafter, prompts: Prompts, batch: int, context: int, repeats: int) -> dict:
    cold, cached = [], []
    for _ in range(repeats + 1):  # the first round warms up allocations and is dropped
        rows = prompts.rows(batch, context)
        start = time.perf_counter()
        drafts = draft_model.draft_batch(drafter, rows, DRAFT_TOKENS, stop_token_ids=[])
        cold.append(time.perf_counter() - start)
        follow_ups = [row + draft[:ACCEPTED] + [draft[ACCEPTED]] for row, draft in zip(rows, drafts)]
        start = time.perf_counter()
        draft_model.draft_batch(drafter, follow_ups, DRAFT_TOKENS, stop_token_ids=[])
        cached.append(time.perf_counter() - start)
    return {"cold": statistics.median(cold[1:]), "cached": statistics.median(cached[1:])}


def time_transformers(
    model: transformers.PreTrainedModel, prompts: Prompts, batch: int, context: int, repeats: int
) -> dict:
    def generate(length: int) -> None:
        ids = torch.tensor(prompts.rows(batch, length))
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=DRAFT_TOKENS,
            min_new_tokens=DRAFT_TOKENS,
            do_sample=False,
        )

    generate(context)  # warm-up
    with torch.inference_mode():
        return {
            "cold": median_seconds(lambda: generate(context), repeats),
            "cached": median_seconds(lambda: generate(context + ACCEPTED + 1), repeats),  # no cache to reuse
        }


def agreement(
    packed: draft_model.Drafter, dense: draft_model.Drafter, prompts: Prompts, rows: int = AGREEMENT_ROWS
) -> float:
    """Fraction of draft positions where packed (bf16) and dequantized (fp32) drafts give the same token."""
    batch = prompts.rows(rows, 64)
    same = total = 0
    for p, d in zip(
        draft_model.draft_batch(packed, batch, DRAFT_TOKENS, stop_token_ids=[]),
        draft_model.draft_batch(dense, batch, DRAFT_TOKENS, stop_token_ids=[]),
    ):
        same += sum(a == b for a, b in zip(p, d))
        total += DRAFT_TOKENS
    return same / total


def bench_shape(name: str, package: Path, args: argparse.Namespace) -> dict:
    max_context = max(args.contexts) + DRAFT_TOKENS + ACCEPTED + 1
    slots = 2 * max(*args.batch_sizes, AGREEMENT_ROWS)
    ours = {"ours packed": draft_model.load_model(package, cache_slots=slots, max_context=max_context)}
    if not isinstance(ours["ours packed"].model.lm_head, int4.Int4Linear):  # else the INT4 table already is the head
        ours["ours packed+q-head"] = draft_model.load_model(
            package, cache_slots=slots, max_context=max_context, quantize_lm_head=True
        )
    ours["ours dequant"] = draft_model.load_model(
        package, cache_slots=slots, max_context=max_context, weights="dequant"
    )
    dense = ours["ours dequant"]
    theirs = {f"hf {dtype}": transformers_model(dense, package, getattr(torch, dtype)) for dtype in args.hf_dtypes}
    memory = {path: drafter.weight_bytes() for path, drafter in ours.items()}
    memory.update(
        {path: sum(p.numel() * p.element_size() for p in model.parameters()) for path, model in theirs.items()}
    )
    prompts = Prompts(dense.vocab_size, seed=0)
    result = {
        "shape": name,
        "weight_bytes": memory,
        "packed_dequant_agreement": agreement(ours["ours packed"], dense, prompts),
        "cells": [],
    }
    for context in args.contexts:
        for batch in args.batch_sizes:
            if batch * context > args.max_batch_tokens:
                continue
            cell = {"batch": batch, "context": context}
            for path, drafter in ours.items():
                cell[path] = time_ours(drafter, prompts, batch, context, args.repeats)
            for path, model in theirs.items():
                cell[path] = time_transformers(model, prompts, batch, context, args.repeats)
            result["cells"].append(cell)
            print_cell(name, cell, args.hf_dtypes[0])
    return result


def print_cell(shape: str, cell: dict, baseline_dtype: str) -> None:
    baseline = cell[f"hf {baseline_dtype}"]
    paths = [p for p in cell if p not in ("batch", "context")]
    for kind in ("cold", "cached"):
        times = "  ".join(f"{p} {cell[p][kind] * 1e3:8.1f} ms" for p in paths)
        ratios = "  ".join(f"{p}: {baseline[kind] / cell[p][kind]:5.2f}x" for p in paths if p.startswith("ours"))
        print(
            f"{shape:12s} B={cell['batch']:<3d} ctx={cell['context']:<5d} {kind:6s} | {times} | vs hf {baseline_dtype}: {ratios}",
            flush=True,
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-180m,qwen3-0.6b", help=f"comma-separated, from {list(SHAPES)}")
    parser.add_argument(
        "--package", type=Path, action="append", default=[], help="also benchmark this model package (repeatable)"
    )
    parser.add_argument("--batch-sizes", default="1,4,16", help="comma-separated batch sizes")
    parser.add_argument("--contexts", default="64,512,2000", help="comma-separated prompt lengths")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=8192,
        help="skip cells with batch x context above this (transformers is slow there)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell (median reported)")
    parser.add_argument(
        "--hf-dtypes",
        default="bfloat16",
        help="comma-separated transformers dtypes; the first is the baseline of the ratios",
    )
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA rank of the random packages (0: none)")
    parser.add_argument(
        "--embedding-group-size",
        type=int,
        default=None,
        help="random packages store the tied embedding as INT4 in groups of G",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape {unknown[0]!r}; choose from {list(SHAPES)}")
    for package in args.package:
        if not (package / "config.json").is_file():
            parser.error(f"--package {package}: no config.json there")
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        args.contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        parser.error("--batch-sizes and --contexts take comma-separated integers, e.g. 1,4,16")
    args.hf_dtypes = args.hf_dtypes.split(",")
    if any(d not in ("bfloat16", "float32") for d in args.hf_dtypes):
        parser.error("--hf-dtypes takes bfloat16 and/or float32")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    allocator = (
        "glibc malloc keeps freed blocks" if draft_model.reuse_freed_memory() else "default allocator"
    )  # as the server
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, {allocator}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        targets = [
            (shape, make_package(shape, Path(scratch), args.lora_rank, args.embedding_group_size))
            for shape in args.shapes
        ]
        for shape, package in targets + [(p.name, p) for p in args.package]:
            result = bench_shape(shape, package, args)
            gib = {path: f"{n / 2**20:.1f} MiB" for path, n in result["weight_bytes"].items()}
            print(
                f"{shape}: resident weights {gib}; packed/dequant draft agreement {result['packed_dequant_agreement']:.1%}",
                flush=True,
            )
            results.append(result)
    if args.json:
        temporary = args.json.with_name(args.json.name + ".tmp")
        temporary.write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=1))
        temporary.rename(args.json)


if __name__ == "__main__":
    main()
