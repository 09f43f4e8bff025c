"""The GPU check: do drafts on the accelerator equal drafts on the CPU, and how long does a draft take there?

1. Exactness: model/ (or --package) loaded on the CPU in fp32 (dense, the exact path) and on --device in
   fp32 and in bf16; greedy 16-token drafts of the same prompts (lengths 1..1000, one batch, then each
   alone). fp32 on the device must equal the CPU token for token (exit 1 otherwise); bf16 agreement is
   reported (a near-tie may flip in bf16).
2. Latency: a random package of the Qwen3-1.7B shape with an INT4 table (evidence/make_random_package.py;
   random weights time like trained ones) on --device in bf16: batch 1, 16 draft tokens after a 512-token
   prompt, cold and as the harness' prefix-cached follow-up; medians of --repeats, against the 25 ms goal.

    bash evidence/gpu_check.sh                      # the same as: python evidence/gpu_check.py
    python evidence/gpu_check.py --device cuda --repeats 20 --json gpu_check.json

It refuses to run without the device (exit 2). Expect about 2-4 minutes, most of it writing the 1.7B package.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import draft_model  # noqa: E402
from evidence import common  # noqa: E402
from evidence.bench_draft import ACCEPTED, DRAFT_TOKENS, SHAPES, Prompts  # noqa: E402

PROMPT_LENGTHS = (1, 7, 64, 300, 1000)
LATENCY_GOAL_MS = 25.0


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def exactness(package: Path, device: str) -> dict:
    """Drafts of the same prompts on the CPU (fp32) and on `device` (fp32, bf16), batched and alone."""
    reference = draft_model.load_model(package, "cpu", "float32", weights="dequant", cache_slots=16)
    prompts = Prompts(reference.vocab_size, seed=1)
    rows = [prompts.rows(1, length)[0] for length in PROMPT_LENGTHS]
    expected = draft_model.draft_batch(reference, rows, DRAFT_TOKENS, stop_token_ids=[])
    report = {}
    for dtype in ("float32", "bfloat16"):
        drafter = draft_model.load_model(package, device, dtype, weights="dequant", cache_slots=16)
        report[dtype] = compare(drafter, rows, expected)
    if torch.device(device).type == "cpu":  # the default path here: packed INT4 in bf16
        report["packed"] = compare(draft_model.load_model(package, device, cache_slots=16), rows, expected)
    return report


def compare(drafter: draft_model.Drafter, rows: list[list[int]], expected: list[list[int]]) -> dict:
    """Drafts of `rows` in one batch, again (now from the prefix cache), and each alone on a fresh pool."""
    batched = draft_model.draft_batch(drafter, rows, DRAFT_TOKENS, stop_token_ids=[])
    again = draft_model.draft_batch(drafter, rows, DRAFT_TOKENS, stop_token_ids=[])
    weights = "packed" if drafter.weights == "packed" else "dequant"
    alone = []
    for row in rows:
        fresh = draft_model.load_model(drafter.source, drafter.device, drafter.dtype, weights=weights, cache_slots=2)
        alone += draft_model.draft_batch(fresh, [row], DRAFT_TOKENS, stop_token_ids=[])
    same = sum(a == b for got, want in zip(batched, expected) for a, b in zip(got, want))
    return {
        "equal_to_cpu_fp32": batched == expected,
        "token_agreement": same / sum(map(len, expected)),
        "batch_equals_alone": batched == alone,
        "cached_equals_cold": again == batched,
    }


def latency(device: str, repeats: int, scratch: Path) -> dict:
    """Batch-1 16-token draft after a 512-token prompt on the Qwen3-1.7B shape, cold and cached (ms)."""
    package = scratch / "qwen3-1.7b"
    flags = SHAPES["qwen3-1.7b"].split() + ["--group-size", "128", "--embedding-group-size", "128", "--lora-rank", "0"]
    subprocess.run(
        [sys.executable, str(REPO / "evidence" / "make_random_package.py"), *flags, "--output", str(package)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    drafter = draft_model.load_model(package, device, "bfloat16", cache_slots=4, max_context=1024)
    prompts = Prompts(drafter.vocab_size, seed=2)
    cold, cached = [], []
    for _ in range(repeats + 1):  # the first round warms up kernels and allocations and is dropped
        row = prompts.rows(1, 512)[0]
        synchronize(device)
        start = time.perf_counter()
        draft = draft_model.draft_batch(drafter, [row], DRAFT_TOKENS, stop_token_ids=[])[0]
        synchronize(device)
        cold.append(time.perf_counter() - start)
        follow_up = row + draft[:ACCEPTED] + [draft[ACCEPTED]]
        start = time.perf_counter()
        draft_model.draft_batch(drafter, [follow_up], DRAFT_TOKENS, stop_token_ids=[])
        synchronize(device)
        cached.append(time.perf_counter() - start)
    return {
        "cold_ms": 1000 * statistics.median(cold[1:]),
        "cached_ms": 1000 * statistics.median(cached[1:]),
        "goal_ms": LATENCY_GOAL_MS,
        "weights": drafter.weights,
        "weight_bytes": drafter.weight_bytes(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="the accelerator to check (default cuda)")
    parser.add_argument(
        "--package", type=Path, default=REPO / "model", help="package for the exactness check (default model/)"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed drafts per figure (median reported)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise common.UserError(
            "no CUDA device here: run this on the machine with the GPU (or give --device cpu to try the script)"
        )
    if args.repeats < 1:
        raise common.UserError(f"--repeats must be at least 1, got {args.repeats}")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    with tempfile.TemporaryDirectory() as scratch:
        report = {
            "device": name,
            "torch": torch.__version__,
            "exactness": exactness(args.package, args.device),
            "latency_qwen3_1.7b_shape": latency(args.device, args.repeats, Path(scratch)),
        }
    print(json.dumps(report, indent=2))
    if args.json is not None:
        common.atomic_write_json(args.json, report)
    if not report["exactness"]["float32"]["equal_to_cpu_fp32"]:
        print(f"FAILED: fp32 drafts on {args.device} differ from the CPU's", file=sys.stderr)
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    common.run_cli(main)
