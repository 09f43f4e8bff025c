"""Time each shipped CPU kernel for INT4 layers (int4.CPU_KERNELS) by the number of rows in the call.

For one layer shape at a time (a model's fused q|k|v, o, gate|up, down and lm_head; random 4-bit
weights time exactly like trained ones), it times the few-row product each kernel gives a decode step at
M = 1, 2, 4, 8, 16 rows, and the many-row product of a prefill's complete chunks (the packed kernels'
unpacked matmul, the dense kernels' resident matmul) at 64, 512 and 2048 rows; then one layer's attention
for a decode step of 1-16 rows, a 40-query prefill tail and a complete 64-query chunk, 512 keys behind each
query, by PyTorch (operators; SDPA for the chunk) and by the CPU attention kernels (attention_kernel.py) where
they run. Medians of --repeats, all in one process; with several --threads, each repeat times every thread count
in turn, so a busy moment of a shared machine falls on all of them alike. The CPU and the kernel `auto` chooses
are printed first. Kernels this CPU lacks are left out, by name.

Reads nothing. Writes a table to stdout (and with --json the figures).

    python -m evidence.bench.bench_kernels --shape qwen3-180m --threads 1
    python -m evidence.bench.bench_kernels --shape smollm2-135m --threads 1 2   # a second core, side by side
"""

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
import attention_kernel  # noqa: E402
import int4  # noqa: E402
import transformer  # noqa: E402
from planning import CHUNK  # noqa: E402

SHAPES = {  # (hidden, intermediate, q heads x head dim, kv heads x head dim, vocab) of the benchmarked models
    "qwen3-180m": (512, 2048, 512, 256, 151936),
    "qwen3-0.6b": (1024, 3072, 2048, 1024, 151936),
    "smollm2-135m": (576, 1536, 576, 192, 49152),
}
GROUP = 32
FEW_ROWS = (1, 2, 4, 8, 16)
MANY_ROWS = (64, 512, 2048)
HEADS = {"qwen3-180m": (4, 2, 128), "qwen3-0.6b": (16, 8, 128), "smollm2-135m": (9, 3, 64)}  # query, kv, head_dim
CONTEXT = 512  # keys behind each query in the attention timings


def layers(shape: str) -> dict[str, tuple[int, int]]:
    hidden, intermediate, q, kv, vocab = SHAPES[shape]
    return {
        "qkv": (hidden, q + 2 * kv),
        "o": (q, hidden),
        "gate_up": (hidden, 2 * intermediate),
        "down": (intermediate, hidden),
        "lm_head": (hidden, vocab),
    }


def random_layer(in_features: int, out_features: int) -> int4.Int4Linear:
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (out_features, in_features), generator=generator)
    zeros = torch.full((in_features // GROUP, out_features), 8)
    scales = torch.full((in_features // GROUP, out_features), 0.01)
    g_idx = torch.arange(in_features) // GROUP
    packed = int4.gptq_pack(q, zeros, scales, g_idx)
    layer = int4.Int4Linear(in_features, out_features, GROUP, bias=False)
    layer.load_state_dict(
        int4.Int4Linear.pack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], g_idx, "gptq")
    )
    return layer


def median_ms(run, x: torch.Tensor, repeats: int, threads: list[int]) -> dict[int, float]:
    """Per thread count, the median milliseconds of run(x), the thread counts taking turns within each repeat."""
    times = {count: [] for count in threads}
    for count in threads:
        torch.set_num_threads(count)
        run(x)
    for _ in range(repeats):
        for count in threads:
            torch.set_num_threads(count)
            start = time.perf_counter()
            run(x)
            times[count].append(time.perf_counter() - start)
    return {count: statistics.median(seconds) * 1e3 for count, seconds in times.items()}


def by_threads(cells: dict[str, dict[int, float]]) -> dict[int, dict[str, float]]:
    """{cell: {threads: ms}} -> {threads: {cell: ms}}, one table row per thread count."""
    counts = next(iter(cells.values())).keys()
    return {count: {cell: figures[count] for cell, figures in cells.items()} for count in counts}


@torch.inference_mode()
def time_kernel(name: str, layer: int4.Int4Linear, repeats: int, threads: list[int]) -> dict[int, dict[str, float]]:
    """Milliseconds per call of kernel `name` on `layer`: few rows (a decode step) and many (complete chunks)."""
    kernel = int4.CPU_KERNELS[name]
    if kernel.weights == "packed":
        layer.use_cpu_kernel(name)
        few = lambda x: layer(x)  # noqa: E731
        many = lambda x: layer(x, x.shape[0])  # noqa: E731
    else:
        weight = layer.dense_weight(dtype=torch.float32).to(kernel.dtype)
        few = lambda x: transformer.row_invariant_linear(x, weight)  # noqa: E731
        many = lambda x: transformer.row_invariant_linear(x, weight, dense_rows=x.shape[0])  # noqa: E731
    dtype = kernel.dtype
    figures = {}
    for rows in FEW_ROWS:
        x = torch.randn(rows, layer.in_features).to(dtype)
        figures[f"M={rows}"] = median_ms(few, x, repeats, threads)
    for rows in MANY_ROWS:
        x = torch.randn(rows, layer.in_features).to(dtype)
        figures[f"M={rows} (chunks)"] = median_ms(many, x, max(1, repeats // 3), threads)
    return by_threads(figures)


def gathered_attention(q, keys, values, slots, positions, window: int) -> torch.Tensor:
    """block_attention as the model calls it without the kernel: each row's window gathered from the cache."""
    return transformer.block_attention(q, keys[slots, :, :window], values[slots, :, :window], positions)


def sdpa_chunk(q, keys, values, slots, positions) -> torch.Tensor:
    """A complete chunk as the model attends it without the kernels: SDPA over a view of its slot, masked."""
    segment = transformer.Segment(0, q.shape[1], int(slots[0]), int(positions[0, 0]), int(positions[0, -1]) + 1, True)
    keys, values = keys[segment.slot, :, : segment.window], values[segment.slot, :, : segment.window]
    return transformer.chunk_attention_sdpa(q[0], keys, values, segment.mask(q.device))


@torch.inference_mode()
def time_attention(shape: str, repeats: int, threads: list[int]) -> dict[str, dict[int, dict[str, float]]]:
    """Milliseconds per layer call of a decode step's attention (rows of one query), of a prefill tail (one row of
    40 queries) and of a complete chunk (64 queries), CONTEXT keys behind each: by PyTorch (transformer.block_attention
    on the gathered window; SDPA for the chunk) and, where they run, by the CPU kernels reading the cache in place."""
    heads, kv_heads, head_dim = HEADS[shape]
    window = CONTEXT + 64
    generator = torch.Generator().manual_seed(0)
    cache = [torch.randn(33, kv_heads, window + 64, head_dim, generator=generator).bfloat16() for _ in range(2)]
    query_kernel = attention_kernel.wants_query_kernel("auto", torch.device("cpu"), torch.bfloat16)
    chunk_kernel = attention_kernel.wants_chunk_kernel(query_kernel)
    figures = {"torch": {}, "query-kernel": {}, "chunk-kernel": {}}
    for rows, queries in [*((rows, 1) for rows in FEW_ROWS), (1, 40), (1, CHUNK)]:
        q = torch.randn(rows, queries, heads, head_dim, generator=generator).bfloat16()
        slots = torch.arange(rows)
        positions = torch.arange(CONTEXT - queries, CONTEXT).expand(rows, queries)
        label = f"M={rows}" if queries == 1 else f"tail of {queries}" if queries < CHUNK else "chunk"
        where = {"keys": cache[0], "values": cache[1], "slots": slots, "positions": positions}
        torch_way = sdpa_chunk if queries == CHUNK else functools.partial(gathered_attention, window=window)
        figures["torch"][label] = median_ms(functools.partial(torch_way, **where), q, repeats, threads)
        if query_kernel:
            figures["query-kernel"][label] = median_ms(
                functools.partial(attention_kernel.query_attention, **where), q, repeats, threads
            )
        if chunk_kernel and queries == CHUNK:
            figures["chunk-kernel"][label] = median_ms(
                functools.partial(attention_kernel.chunk_attention, **where), q, repeats, threads
            )
    return {name: by_threads(cells) for name, cells in figures.items() if cells}


def print_rows(label: str, figures: dict[int, dict[str, float]]) -> None:
    for count, cells in figures.items():
        row = "  ".join(f"{rows} {ms:7.2f}" for rows, ms in cells.items())
        print(f"{label} {count} thread(s) ms: {row}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-180m", choices=list(SHAPES), help="the model whose layers to time")
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch thread counts, timed in turn")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per cell (median reported)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if min(args.threads) < 1 or args.repeats < 1:
        parser.error("--threads and --repeats must be at least 1")
    threads = list(dict.fromkeys(args.threads))
    print(
        f"CPU flags: {int4.cpu_description()}; threads {', '.join(map(str, threads))}; auto chooses {int4.choose_cpu_kernel('auto')}; "
        f"attention auto: {attention_kernel.cpu_choice()}; norm auto: {attention_kernel.norm_choice()}"
    )
    shipped = []
    for name in int4.CPU_KERNELS:
        try:
            shipped.append(int4.choose_cpu_kernel(name))
        except ValueError as lacking:
            print(f"left out: {lacking}")
    results = {}
    for layer_name, (in_features, out_features) in layers(args.shape).items():
        layer = random_layer(in_features, out_features)
        for name in shipped:
            results[f"{layer_name} {name}"] = figures = time_kernel(name, layer, args.repeats, threads)
            print_rows(f"{args.shape} {layer_name:8s} {in_features}x{out_features} {name:10s}", figures)
    for name, figures in time_attention(args.shape, args.repeats, threads).items():
        results[f"attention {name}"] = figures
        print_rows(f"{args.shape} attention over {CONTEXT} keys {name:12s}", figures)
    if args.json:
        temporary = args.json.with_name(args.json.name + ".tmp")
        temporary.write_text(json.dumps({"argv": sys.argv[1:], "cpu": int4.cpu_description(), "ms": results}))
        temporary.rename(args.json)


if __name__ == "__main__":
    main()
