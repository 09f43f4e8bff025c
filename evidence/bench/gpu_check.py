"""The GPU check: do drafts on the accelerator equal the reference, does the decode loop run without host
syncs as one captured graph per batch bucket, and how long does a draft take there?

1. Exactness on model/ (or --package): the CPU in fp32 (dense, the exact path) is the reference, and
   transformers' greedy generate() on --device in fp32 is checked against it. On --device: fp32 eager,
   bf16 eager, packed INT4 (PyTorch's CUDA INT4 kernel, bf16 activations) eager and compiled
   (torch.compile + CUDA graphs, one per batch bucket); greedy 16-token drafts of the same
   prompts (lengths 1..1000) in one batch, again from the prefix cache, and each alone.
   fp32 on the device must equal the CPU token for token (exit 1 otherwise); bf16 and INT4 agreement is
   reported (a near-tie may flip in bf16), and their batch/alone and cached/cold equality.
2. The compiled loop: graphs built (one per batch bucket used), and host syncs inside the k-step loop,
   counted with torch.cuda.set_sync_debug_mode("error") around the loop (must be 0; the one transfer of
   the results after the loop is outside).
3. Latency on the Qwen3-1.7B shape (a random package, evidence/quantize/make_random_package.py; random weights time
   like trained ones): ms per 16-token draft after a 512-token prompt at batch 1, 4 and 16 for packed
   INT4 compiled and eager and dense bf16 compiled, cold and as the harness' prefix-cached follow-up;
   medians of --repeats; peak GPU memory. Goal: batch 1 compiled <= 12 ms (must: <= 21 ms), batch 16 <=
   2x batch 1.

    bash evidence/gpu_check.sh                      # the same as: python evidence/bench/gpu_check.py
    python evidence/bench/gpu_check.py --device cuda --repeats 20 --json gpu_check.json

It refuses to run without the device (exit 2). Expect 5-8 minutes, most of it writing the 1.7B package and
compiling the batch buckets of three compiled paths (eight graphs).
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import draft_model  # noqa: E402
import engine  # noqa: E402
from evidence import common  # noqa: E402
from evidence.bench.bench_draft import ACCEPTED, DRAFT_TOKENS, SHAPES, Prompts, transformers_model  # noqa: E402
from planning import SLOTS_PER_ROW  # noqa: E402

PROMPT_LENGTHS = (1, 7, 64, 300, 1000)
LATENCY_GOAL_MS, LATENCY_MUST_MS = 12.0, 21.0
LATENCY_BATCHES = (1, 4, 16)
# (name, weights, compiled): the deployed path (INT4 compiled), what compiling buys, and dense bf16 beside it.
LATENCY_PATHS = (("int4_compiled", "packed", True), ("int4_eager", "packed", False), ("bf16_compiled", "dequant", True))


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def exactness(package: Path, device: str) -> dict:
    """Drafts of the same prompts on the CPU (fp32) and on `device` (fp32, bf16, bf16 compiled), batched and
    alone; transformers' greedy tokens on `device` in fp32 against the CPU reference."""
    reference = draft_model.load_model(package, "cpu", "float32", weights="dequant", cache_slots=16)
    prompts = Prompts(reference.vocab_size, seed=1)
    rows = [prompts.rows(1, length)[0] for length in PROMPT_LENGTHS]
    expected = draft_model.draft_batch(reference, rows, DRAFT_TOKENS, stop_token_ids=[])
    report = {}
    if torch.device(device).type != "cpu":  # on the CPU the test suite checks our fp32 against transformers
        report["transformers_fp32_equal_to_cpu"] = transformers_drafts(reference, package, device, rows) == expected
    paths = [("float32", "float32", "dequant", False), ("bfloat16", "bfloat16", "dequant", False)]
    paths.append(("packed", None, "packed", False))  # the default path: packed INT4 on the device's kernel, bf16
    if torch.device(device).type == "cuda":
        paths.append(("packed_compiled", None, "packed", True))
    for name, dtype, weights, compiled in paths:
        drafter = draft_model.load_model(package, device, dtype, weights=weights, cache_slots=16, compiled=compiled)
        report[name] = compare(drafter, rows, expected)
    return report


def transformers_drafts(reference: draft_model.Drafter, package: Path, device: str, rows: list[list[int]]) -> list:
    model = transformers_model(reference, package, torch.float32).to(device)
    drafts = []
    for row in rows:
        ids = torch.tensor([row], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=DRAFT_TOKENS, do_sample=False)
        drafts.append(out[0, len(row) :].tolist())
    return drafts


def compare(drafter: draft_model.Drafter, rows: list[list[int]], expected: list[list[int]]) -> dict:
    """Drafts of `rows` in one batch, again (now from the prefix cache), and each alone on a fresh pool."""
    batched = draft_model.draft_batch(drafter, rows, DRAFT_TOKENS, stop_token_ids=[])
    again = draft_model.draft_batch(drafter, rows, DRAFT_TOKENS, stop_token_ids=[])
    alone = []
    for row in rows:
        drafter.cache.forget()  # cold, and a compiled step keeps its graphs
        alone += draft_model.draft_batch(drafter, [row], DRAFT_TOKENS, stop_token_ids=[])
    same = sum(a == b for got, want in zip(batched, expected) for a, b in zip(got, want))
    return {
        "equal_to_cpu_fp32": batched == expected,
        "token_agreement": same / sum(map(len, expected)),
        "batch_equals_alone": batched == alone,
        "cached_equals_cold": again == batched,
    }


def syncs_in_the_loop(drafter: draft_model.Drafter, rows: list[list[int]]) -> str:
    """Draft `rows` with CUDA's sync debug mode set to "error" inside the k-step loop: "0", or the first sync."""
    loop, transfer = engine.Decoder.decode, engine.Decoder._to_host

    def guarded_loop(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return loop(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def transfer_after_the_loop(*args):
        torch.cuda.set_sync_debug_mode(0)
        return transfer(*args)

    engine.Decoder.decode, engine.Decoder._to_host = guarded_loop, staticmethod(transfer_after_the_loop)
    try:
        draft_model.draft_batch(drafter, rows, DRAFT_TOKENS, stop_token_ids=[])
        return "0"
    except RuntimeError as error:
        return str(error).splitlines()[0]
    finally:
        engine.Decoder.decode, engine.Decoder._to_host = loop, transfer


def timed_draft(drafter: draft_model.Drafter, rows: list[list[int]]) -> tuple[float, list]:
    """(seconds, drafts) of one draft_batch call, the device synchronised on both sides."""
    device = str(drafter.device)
    synchronize(device)
    start = time.perf_counter()
    drafts = draft_model.draft_batch(drafter, rows, DRAFT_TOKENS, stop_token_ids=[])
    synchronize(device)
    return time.perf_counter() - start, drafts


def time_batches(drafter: draft_model.Drafter, prompts: Prompts, repeats: int) -> dict:
    report = {}
    for batch in LATENCY_BATCHES:
        cold, cached = [], []
        for _ in range(repeats + 1):  # the first round builds graphs, warms kernels and allocations: dropped
            rows = prompts.rows(batch, 512)
            seconds, made = timed_draft(drafter, rows)
            cold.append(seconds)
            cached.append(timed_draft(drafter, [row + d[:ACCEPTED] + [d[ACCEPTED]] for row, d in zip(rows, made)])[0])
        report[batch] = {
            "cold_ms": 1000 * statistics.median(cold[1:]),
            "cached_ms": 1000 * statistics.median(cached[1:]),
        }
    return report


def latency(device: str, repeats: int, scratch: Path, shape: str = "qwen3-1.7b") -> dict:
    """16-token drafts after a 512-token prompt on `shape`, eager and compiled, cold and cached (ms)."""
    package = scratch / shape
    flags = SHAPES[shape].split() + ["--group-size", "128", "--embedding-group-size", "128", "--lora-rank", "0"]
    subprocess.run(
        [
            sys.executable,
            str(REPO / "evidence" / "quantize" / "make_random_package.py"),
            *flags,
            "--output",
            str(package),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    report = {}
    for name, weights, compiled in LATENCY_PATHS:
        drafter = draft_model.load_model(
            package,
            device,
            "bfloat16",
            weights=weights,
            cache_slots=SLOTS_PER_ROW * max(LATENCY_BATCHES),
            max_context=1024,
            compiled=compiled,
        )
        prompts = Prompts(drafter.vocab_size, seed=2)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for batch, figures in time_batches(drafter, prompts, repeats).items():
            report[f"{name}_batch_{batch}"] = figures
        if compiled:
            report[f"{name}_graphs"] = sorted(drafter.decoder.steps)
            if device.startswith("cuda"):
                report[f"{name}_syncs_in_the_loop"] = syncs_in_the_loop(drafter, prompts.rows(4, 300))
        if device.startswith("cuda"):
            report[f"{name}_peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        report[f"{name}_weights"], report[f"{name}_weight_bytes"] = drafter.weights, drafter.weight_bytes()
        del drafter
    report["goal_ms"], report["must_ms"] = LATENCY_GOAL_MS, LATENCY_MUST_MS
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="the accelerator to check (default cuda)")
    parser.add_argument(
        "--package", type=Path, default=REPO / "model", help="package for the exactness check (default model/)"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed drafts per figure (median reported)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument(
        "--shape", default="qwen3-1.7b", choices=sorted(SHAPES), help="random package shape timed (default 1.7B)"
    )
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
            f"latency_{args.shape}_shape": latency(args.device, args.repeats, Path(scratch), args.shape),
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
