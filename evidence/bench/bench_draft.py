"""Draft latency of our drafter (packed INT4 and dequantized) against transformers generate(), same weights, one run.

For each model shape it writes a random GPTQ package with evidence/quantize/make_random_package.py (random
weights time exactly like trained ones), loads it two or three ways, and times 16-token greedy drafts:

  ours packed    draft_model, GPTQ linears kept at 4 bits on the packed kernel auto picks (bf16 activations:
                 int4-bf16dot where the CPU has AVX512-BF16, else PyTorch's int4pack)
  ours int4pack  the same on PyTorch's int4pack kernel whatever the CPU (the baseline of int4-bf16dot)
  ours torch-attention  ours packed with a decode step's queries attended by PyTorch operators
                 (transformer.block_attention) instead of the CPU attention kernel auto picks
  ours packed+q-head   the same with the lm_head rounded to INT4 at load (quantize_lm_head); only for
                 packages whose tied table is bf16 (with --embedding-group-size the head already is INT4)
  ours dequant   draft_model, weights dequantized to fp32 (the exact path; the dense-fp32 kernel)
  ours dense-bf16  draft_model, weights dequantized to bf16 (the dense-bf16 kernel)
  hf bf16        transformers generate() on the same dequantized weights (LoRA merged) in bf16,
                 its fastest dtype on these CPUs (--hf-dtypes adds float32)

at each batch size and context length: "cold" on fresh prompts, and "cached" on the harness'
follow-up (the previous prompt + 8 accepted draft tokens + a bonus token), which our prefix cache
serves by prefilling 9 tokens; transformers has no cross-call cache and recomputes everything.
Every cell is the median of --repeats runs on new prompts, the paths taking turns run by run. Ratios are hf bf16 time / ours.
--ours picks which of ours to time (all but dense-bf16 by default). Also printed: the CPU and the INT4
kernel auto chooses on it, resident weight bytes per path, how often packed and dequantized drafts agree,
and with --profile where each of our cold calls' time goes, by phase (prefill, decode) and part of the
forward (INT4 linears by path, LoRA, attention, norms, head, the rest).

Reads nothing (or --package DIR, e.g. model/, benchmarked as a further shape). Writes a table to
stdout and, with --json, the figures to a file.

    python evidence/bench/bench_draft.py --shapes qwen3-180m,qwen3-0.6b --json bench_draft.json
    python -m evidence.bench.bench_draft --shapes qwen3-180m --batch-sizes 1,8 --contexts 512 --ours packed --profile
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import draft_model  # noqa: E402
import engine  # noqa: E402
import int4  # noqa: E402
import transformer  # noqa: E402
from attention_kernel import cpu_choice, norm_choice  # noqa: E402
from planning import SLOTS_PER_ROW  # noqa: E402

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
        [sys.executable, str(REPO / "evidence" / "quantize" / "make_random_package.py"), *flags],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return output


def transformers_model(dense: draft_model.Drafter, package: Path, dtype: torch.dtype) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.from_pretrained(package)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dense.hf_state_dict(), strict=False)  # a tied lm_head arrives as the embedding
    return model.to(dtype).eval()


class Prompts:
    """Fresh random prompts on every call, so a 'cold' call never finds its prefix in the cache."""

    def __init__(self, vocab_size: int, seed: int):
        self.vocab_size, self.generator = vocab_size, torch.Generator().manual_seed(seed)

    def rows(self, batch: int, length: int) -> list[list[int]]:
        return torch.randint(0, self.vocab_size, (batch, length), generator=self.generator).tolist()


def seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def round_of_ours(drafter: draft_model.Drafter, prompts: Prompts, batch: int, context: int) -> dict:
    """One cold call on fresh prompts, then the harness' follow-up of each row, timed."""
    rows = prompts.rows(batch, context)
    drafts = []
    cold = seconds(lambda: drafts.extend(draft_model.draft_batch(drafter, rows, DRAFT_TOKENS, stop_token_ids=[])))
    follow_ups = [row + draft[:ACCEPTED] + [draft[ACCEPTED]] for row, draft in zip(rows, drafts)]
    cached = seconds(lambda: draft_model.draft_batch(drafter, follow_ups, DRAFT_TOKENS, stop_token_ids=[]))
    return {"cold": cold, "cached": cached}


def round_of_transformers(model: transformers.PreTrainedModel, prompts: Prompts, batch: int, context: int) -> dict:
    """generate() on a prompt and on the follow-up's length: transformers has no cache to reuse across calls."""

    def generate(length: int) -> None:
        ids = torch.tensor(prompts.rows(batch, length))
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=DRAFT_TOKENS,
                min_new_tokens=DRAFT_TOKENS,
                do_sample=False,
            )

    return {"cold": seconds(lambda: generate(context)), "cached": seconds(lambda: generate(context + ACCEPTED + 1))}


def time_cell(ours: dict, theirs: dict, prompts: Prompts, batch: int, context: int, repeats: int) -> dict:
    """Median seconds per path, the paths taking turns round by round so that a change in the machine's load
    (it is shared) falls on all of them alike; the first round warms up and is dropped."""
    rounds = {path: [] for path in [*ours, *theirs]}
    for _ in range(repeats + 1):
        for path, drafter in ours.items():
            rounds[path].append(round_of_ours(drafter, prompts, batch, context))
        for path, model in theirs.items():
            rounds[path].append(round_of_transformers(model, prompts, batch, context))
    return {
        path: {kind: statistics.median(r[kind] for r in runs[1:]) for kind in ("cold", "cached")}
        for path, runs in rounds.items()
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


class PartTimer:
    """Where one draft_batch call's time goes: the wall time of each part of our forward, by phase.

    Forward hooks on the model's modules record each module's self time (its time less that of its timed
    children), filed under a part; the phases are engine.prefill and the decoder's decode, wrapped; what
    the modules do not cover (planning, the cache's bookkeeping, sampling) is the phase's "rest". The
    hooks cost a few microseconds per module call, which lands in the parts they wrap."""

    def __init__(self, drafter: draft_model.Drafter):
        self.drafter, self.model = drafter, drafter.model
        self.times: dict[tuple[str, str], float] = defaultdict(float)
        self.phase = "outside"
        self.stack: list[list[float]] = []  # per open module: [start, seconds of its timed children]
        self.handles = []
        for module in self.model.modules():
            if not isinstance(module, (nn.ModuleList, transformer.Concat)):
                self.handles.append(module.register_forward_pre_hook(self._enter))
                self.handles.append(module.register_forward_hook(self._leave))
        self.model.logits = self._timed("lm_head (logits)", self.model.logits)
        self.drafter.decoder.decode = self._phase("decode", self.drafter.decoder.decode)
        self.prefill = engine.prefill
        engine.prefill = self._phase("prefill", engine.prefill)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        del self.model.logits, self.drafter.decoder.decode  # the instance attributes that shadow the methods
        engine.prefill = self.prefill

    def part(self, module: nn.Module, args: tuple) -> str:
        if isinstance(module, int4.Int4Linear):
            rows = args[0].numel() // module.in_features
            dense = min(args[1] if len(args) > 1 and module.dense_prefill else 0, rows)
            return {rows: "INT4 linears: unpacked (dense) rows", 0: "INT4 linears: kernel rows"}.get(
                dense, "INT4 linears: dense + kernel rows"
            )
        names = {
            nn.Linear: "dense linears",
            transformer.LoRALinear: "LoRA side matmuls and add",
            transformer.Attention: "attention (q/k norm, RoPE, cache, scores)",
            transformer.MLP: "SiLU(gate) * up",
            transformer.RMSNorm: "RMSNorm",
            transformer.Block: "residual adds",
            transformer.Transformer: "embedding, RoPE tables",
            nn.Embedding: "embedding, RoPE tables",
        }
        return names.get(type(module), type(module).__name__)

    def _enter(self, module, args) -> None:
        self.stack.append([time.perf_counter(), 0.0])

    def _leave(self, module, args, output) -> None:
        self._close(self.part(module, args))

    def _close(self, part: str) -> None:
        start, children = self.stack.pop()
        spent = time.perf_counter() - start
        self.times[self.phase, part] += spent - children
        if self.stack:
            self.stack[-1][1] += spent

    def _timed(self, part: str, function):
        def timed(*args, **kwargs):
            self.stack.append([time.perf_counter(), 0.0])
            result = function(*args, **kwargs)
            self._close(part)
            return result

        return timed

    def _phase(self, phase: str, function):
        def timed(*args, **kwargs):
            self.phase = phase
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.times[phase, "total"] += time.perf_counter() - start
            self.phase = "outside"
            return result

        return timed


def profile_parts(drafter: draft_model.Drafter, prompts: Prompts, batch: int, context: int, repeats: int) -> dict:
    """Per phase and part, the median over `repeats` cold calls (after one warm-up) of its milliseconds."""
    draft_model.draft_batch(drafter, prompts.rows(batch, context), DRAFT_TOKENS, stop_token_ids=[])
    timer, calls = PartTimer(drafter), []
    try:
        for _ in range(repeats):
            timer.times.clear()
            draft_model.draft_batch(drafter, prompts.rows(batch, context), DRAFT_TOKENS, stop_token_ids=[])
            times = dict(timer.times)
            for phase in ("prefill", "decode"):
                parts = sum(t for (p, part), t in times.items() if p == phase and part != "total")
                times[phase, "rest (planning, cache bookkeeping, sampling)"] = times[phase, "total"] - parts
            calls.append(times)
    finally:
        timer.close()
    keys = sorted({key for call in calls for key in call})
    return {
        f"{phase}: {part}": statistics.median(c.get((phase, part), 0.0) for c in calls) * 1e3 for phase, part in keys
    }


def print_profile(shape: str, path: str, batch: int, context: int, parts: dict) -> None:
    print(f"{shape} {path} B={batch} ctx={context}: where a cold call's time goes (median ms)", flush=True)
    for phase in ("prefill", "decode"):
        total = parts[f"{phase}: total"]
        rows = sorted(
            ((k, v) for k, v in parts.items() if k.startswith(phase) and not k.endswith("total")), key=lambda kv: -kv[1]
        )
        print(f"  {phase:8s} {total:9.1f} ms", flush=True)
        for key, ms in rows:
            print(f"    {key.removeprefix(phase + ': '):48s} {ms:9.1f} ms  {ms / total:6.1%}", flush=True)


OUR_PATHS = {  # --ours: each path's load_model arguments
    "packed": {},
    "int4pack": {"int4_kernel": "int4pack"},
    "torch-attention": {"attention_kernel": "torch"},
    "packed+q-head": {"quantize_lm_head": True},
    "dequant": {"weights": "dequant"},
    "dense-bf16": {"weights": "dequant", "dtype": "bfloat16"},
}


def load_ours(package: Path, args: argparse.Namespace) -> tuple[dict, draft_model.Drafter]:
    """Our drafters on the paths asked for (--ours), and the dense fp32 one the transformers models copy."""
    max_context = max(args.contexts) + DRAFT_TOKENS + ACCEPTED + 1
    slots = SLOTS_PER_ROW * max(*args.batch_sizes, AGREEMENT_ROWS)
    ours = {
        f"ours {path}": draft_model.load_model(package, cache_slots=slots, max_context=max_context, **OUR_PATHS[path])
        for path in args.ours
    }
    head = ours.get("ours packed+q-head")
    if head is not None and isinstance(head.model.lm_head, int4.Int4Linear) and "ours packed" in ours:
        if isinstance(ours["ours packed"].model.lm_head, int4.Int4Linear):
            del ours["ours packed+q-head"]  # the INT4 table already is the head: the same drafter twice
    dense = ours.get("ours dequant") or draft_model.load_model(
        package, cache_slots=slots, max_context=max_context, weights="dequant"
    )
    return ours, dense


def bench_shape(name: str, package: Path, args: argparse.Namespace) -> dict:
    ours, dense = load_ours(package, args)
    theirs = {f"hf {dtype}": transformers_model(dense, package, getattr(torch, dtype)) for dtype in args.hf_dtypes}
    memory = {path: drafter.weight_bytes() for path, drafter in ours.items()}
    memory.update(
        {path: sum(p.numel() * p.element_size() for p in model.parameters()) for path, model in theirs.items()}
    )
    prompts = Prompts(dense.vocab_size, seed=0)
    result = {"shape": name, "weight_bytes": memory, "cells": [], "profiles": []}
    if "ours packed" in ours and "ours dequant" in ours:
        result["packed_dequant_agreement"] = agreement(ours["ours packed"], dense, prompts)
    for context in args.contexts:
        for batch in args.batch_sizes:
            if batch * context > args.max_batch_tokens:
                continue
            cell = {"batch": batch, "context": context} | time_cell(ours, theirs, prompts, batch, context, args.repeats)
            result["cells"].append(cell)
            print_cell(name, cell, args.hf_dtypes[0])
            if args.profile:
                for path, drafter in ours.items():
                    parts = profile_parts(drafter, prompts, batch, context, args.repeats)
                    print_profile(name, path, batch, context, parts)
                    result["profiles"].append({"path": path, "batch": batch, "context": context, "ms": parts})
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
    parser.add_argument(
        "--ours",
        default="packed,packed+q-head,dequant",
        help="comma-separated paths of ours to time: packed (the packed kernel auto picks), int4pack (PyTorch's "
        "INT4 kernel), torch-attention (packed, without the attention kernel), packed+q-head (skipped where "
        "the head already is INT4), dequant (dense fp32: the dense-fp32 kernel), dense-bf16 (dense bf16 weights)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print where each of our cold calls' time goes, by phase and part of the forward",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, one per core)")
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
    args.ours = [path for path in args.ours.split(",") if path]
    if not args.ours or any(path not in OUR_PATHS for path in args.ours):
        parser.error(f"--ours takes some of {', '.join(OUR_PATHS)}, got {','.join(args.ours) or 'nothing'}")
    args.hf_dtypes = args.hf_dtypes.split(",")
    if any(d not in ("bfloat16", "float32") for d in args.hf_dtypes):
        parser.error("--hf-dtypes takes bfloat16 and/or float32")
    return args


def cpu_line() -> str:
    """The CPU and the instruction sets the matmul kernels care about, as /proc/cpuinfo and torch see them."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return (
        f"CPU {model}, {', '.join(f for f in wanted if f in flags) or 'none of AVX2/AVX512/AMX'}; "
        f"torch capability {torch.backends.cpu.get_cpu_capability()}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"{cpu_line()}; INT4 kernel auto: {int4.choose_cpu_kernel('auto')}; attention auto: {cpu_choice()}; "
        f"norm auto: {norm_choice()}",
        flush=True,
    )
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
            agreement = result.get("packed_dequant_agreement")
            agree = "" if agreement is None else f"; packed/dequant draft agreement {agreement:.1%}"
            print(f"{shape}: resident weights {gib}{agree}", flush=True)
            results.append(result)
    if args.json:
        temporary = args.json.with_name(args.json.name + ".tmp")
        temporary.write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=1))
        temporary.rename(args.json)


if __name__ == "__main__":
    main()
