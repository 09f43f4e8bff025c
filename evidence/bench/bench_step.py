"""What one decode step costs: operators per step (torch.profiler) and milliseconds, eager beside compiled.

Loads a package (default: the shipped model/) on the CPU, prefills --batch random prompts of
--prompt-tokens tokens, and drafts --k tokens, once per mode (and per packed kernel of --int4-kernels):

  eager     the fixed-shape step run op by op
  compiled  the same step compiled for its batch bucket (inductor on the CPU; what --compile on runs)

Operators per step come from torch.profiler: the top-level non-view operators (one called inside another,
such as the .item() inside PyTorch's CPU INT4 matmul, is not counted) and inductor's fused kernels, of a
k-token draft minus those of a 1-token draft, over k - 1 steps, so the prefill and the one-off work of a
call cancel out. Times are medians of --repeats follow-up calls
(each cold: a fresh prompt), ms per k-token draft and per step. Prints the CPU and the kernels chosen;
writes nothing but --json.

    python -m evidence.bench.bench_step --model model --batch 1 16 --k 16 --threads 1
    python -m evidence.bench.bench_step --model model --weights dequant --dtype bfloat16 --attention-kernel torch
    python -m evidence.bench.bench_step --model model --int4-kernels int4pack --attention-kernel torch   # CUDA's layouts
    python -m evidence.bench.bench_step --model model --batch 1 8 16 --int4-kernels int4pack int4-bf16dot
"""

import argparse
import platform
import random
import statistics
import time
from pathlib import Path

import torch
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile

import attention_kernel
import draft_model
import int4
from evidence import common
from planning import SLOTS_PER_ROW

VIEW_OPS = {
    "aten::view",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::_unsafe_view",
    "aten::as_strided",
    "aten::slice",
    "aten::select",
    "aten::expand",
    "aten::transpose",
    "aten::t",
    "aten::permute",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::alias",
    "aten::detach",
    "aten::unbind",
    "aten::split",
    "aten::split_with_sizes",
    "aten::chunk",
    "aten::narrow",
    "aten::lift_fresh",
    "aten::view_as",
    "aten::expand_as",
    "aten::resolve_conj",
    "aten::resolve_neg",
}


def cpu_description() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "")
    features = [f for f in ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx512f", "avx2") if f" {f}" in flags]
    return (
        f"{model or platform.processor()} ({', '.join(features) or 'no AVX2'}); torch {torch.__version__}, "
        f"capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} thread(s)"
    )


def is_operator(name: str) -> bool:
    return "::" in name  # aten::mm, quantized::int4mm_packed_weight_cpu; not profiler scopes


def is_counted(event) -> bool:
    """A top-level non-view operator (not one called inside another) or a fused kernel: what a step launches."""
    name = event.name
    if "cpp_fused" in name or "triton_" in name:
        return True
    parent = event.cpu_parent
    while parent is not None and not is_operator(parent.name):
        parent = parent.cpu_parent
    return is_operator(name) and name not in VIEW_OPS and parent is None


def count_operators(drafter, rows: list[list[int]], max_tokens: int) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        draft_model.draft_batch(drafter, rows, max_tokens=max_tokens, stop_token_ids=[])
    return sum(is_counted(event) for event in prof.events())


def prompts(batch: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    generator = random.Random(seed)
    return [[generator.randrange(vocab) for _ in range(tokens)] for _ in range(batch)]


def measure(drafter, args: argparse.Namespace, batch: int) -> dict:
    vocab = drafter.vocab_size
    draft_model.draft_batch(drafter, prompts(batch, args.prompt_tokens, vocab, 0), max_tokens=args.k)  # warm-up
    first, full = (
        count_operators(drafter, prompts(batch, args.prompt_tokens, vocab, seed), tokens)
        for seed, tokens in ((1, 1), (2, args.k))
    )
    per_step = (full - first) / (args.k - 1)
    times, prefill_times = [], []
    for repeat in range(args.repeats):
        rows = prompts(batch, args.prompt_tokens, vocab, 100 + repeat)
        start = time.perf_counter()
        draft_model.draft_batch(drafter, rows, max_tokens=1, stop_token_ids=[])
        prefill_times.append(time.perf_counter() - start)
        rows = prompts(batch, args.prompt_tokens, vocab, 200 + repeat)
        start = time.perf_counter()
        draft_model.draft_batch(drafter, rows, max_tokens=args.k, stop_token_ids=[])
        times.append(time.perf_counter() - start)
    draft_ms, prefill_ms = 1000 * statistics.median(times), 1000 * statistics.median(prefill_times)
    return {
        "batch": batch,
        "operators_per_step": per_step,
        "operators_per_layer": per_step / drafter.num_layers,
        "draft_ms": draft_ms,
        "step_ms": (draft_ms - prefill_ms) / (args.k - 1),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("model"), help="model package directory")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="batch sizes to measure")
    parser.add_argument("--k", type=int, default=16, help="draft tokens per call (at least 2)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    parser.add_argument(
        "--weights",
        default="auto",
        choices=("auto", "packed", "dequant"),
        help="GPTQ weights: packed INT4 with LoRA beside (the CPU default), or dequant: dense, LoRA merged (what CUDA runs)",
    )
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"), help="default: the loader's choice")
    parser.add_argument(
        "--int4-kernels",
        nargs="+",
        default=["auto"],
        choices=("auto", *int4.PACKED_CPU_KERNELS),
        help="packed CPU kernels to measure, one after the other in this run (auto: the one the loader picks)",
    )
    parser.add_argument(
        "--attention-kernel",
        default="auto",
        choices=attention_kernel.ATTENTION_KERNELS,
        help="how queries attend (torch: PyTorch's operators, the layout CUDA runs)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.k < 2:
        parser.error(f"--k must be at least 2 (a step is the cost of a token after the first), got {args.k}")
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; give a model package directory")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch._inductor.config.cpp.enable_kernel_profile = True  # fused kernels appear in the profile, to be counted
    print(f"cpu: {cpu_description()}; prefill matmuls in {int4.dense_matmul_dtype()}")
    results = {"cpu": cpu_description(), "model": str(args.model), "k": args.k, "rows": []}
    for mode, kernel in [(mode, kernel) for mode in args.modes for kernel in args.int4_kernels]:
        compiled = {"compiled": True} if mode == "compiled" else {}  # eager: what older checkouts run too
        drafter = draft_model.load_model(
            args.model,
            dtype=args.dtype,
            weights=args.weights,
            cache_slots=SLOTS_PER_ROW * max(args.batch),
            max_context=args.prompt_tokens + 2 * args.k,
            int4_kernel=kernel,
            attention_kernel=args.attention_kernel,
            **compiled,
        )
        chosen = drafter.kernel()
        name, attention, norm = chosen["name"], chosen["attention"], chosen["norm"]
        print(
            f"{mode}: weights {drafter.weights}, dtype {drafter.dtype}, kernel {name}, attention {attention}, norm {norm}, {drafter.num_layers} layers"
        )
        for batch in args.batch:
            row = {"mode": mode, "kernel": name} | measure(drafter, args, batch)
            results["rows"].append(row)
            print(
                f"  batch {batch:>3}: {row['operators_per_step']:7.0f} operators per step "
                f"({row['operators_per_layer']:5.1f} per layer), {row['step_ms']:7.2f} ms per step, "
                f"{row['draft_ms']:8.1f} ms per {args.k}-token draft"
            )
    if args.json:
        common.atomic_write_json(args.json, results)
    return results


if __name__ == "__main__":
    common.run_cli(main)
