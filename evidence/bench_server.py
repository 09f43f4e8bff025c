"""Benchmark a live draft server: N concurrent clients, each replaying a speculative-decoding loop over HTTP.

Reads nothing but the server (GET /health for its identity and vocabulary, POST /draft). Prints one table
row per concurrency level: requests (drafts) per second, draft tokens per second, latency p50/p95/p99, the
share of prompt tokens served from the prefix cache, and errors. --json also writes the figures to a file.

Each client behaves like the benchmark harness: it starts a conversation from --prompt-tokens random ids,
asks for --max-tokens drafts, then extends the conversation by --accept of those drafts plus one bonus
token and asks again, so follow-up requests hit the server's prefix cache; a conversation restarts once it
passes --conversation-tokens. Token ids are seeded, so every run sends the same requests.

Start a server first (another terminal), then:

    ./serve.sh
    .venv/bin/python evidence/bench_server.py --url http://127.0.0.1:8000 --concurrency 1 4 16 64 --requests 512
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    seconds: float
    drafts_per_s: float
    draft_tokens_per_s: float
    latency_p50_ms: float
    latency_p95_ms: float
    latency_p99_ms: float
    cached_token_share: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_client(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    vocab_size: int,
    seed: int,
    remaining: list[int],
    latencies: list[float],
    totals: dict[str, int],
) -> None:
    """One harness-like client: keep drafting and extending a conversation until the shared budget is spent."""
    rng = random.Random(seed)

    def fresh_prompt() -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(args.prompt_tokens)]

    conversation = fresh_prompt()
    while remaining[0] > 0:
        remaining[0] -= 1
        started = time.perf_counter()
        response = await client.post("/draft", json={"token_ids": conversation, "max_tokens": args.max_tokens})
        latencies.append(time.perf_counter() - started)
        if response.status_code != 200:
            totals["errors"] += 1
            continue
        body = response.json()
        totals["draft_tokens"] += len(body["draft_token_ids"])
        totals["prompt_tokens"] += len(conversation)
        totals["cached_tokens"] += body["cached_tokens"]
        accepted = body["draft_token_ids"][: args.accept]
        conversation = conversation + accepted + [rng.randrange(vocab_size)]
        if len(conversation) > args.conversation_tokens:
            conversation = fresh_prompt()


async def run_level(args: argparse.Namespace, concurrency: int, vocab_size: int, headers: dict) -> LevelResult:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits) as client:
        warmup_budget, warmup_latencies = [concurrency], []
        warmup_totals = {"errors": 0, "draft_tokens": 0, "prompt_tokens": 0, "cached_tokens": 0}
        await asyncio.gather(
            *(
                run_client(client, args, vocab_size, 10_000 + i, warmup_budget, warmup_latencies, warmup_totals)
                for i in range(concurrency)
            )
        )
        remaining, latencies = [args.requests], []
        totals = {"errors": 0, "draft_tokens": 0, "prompt_tokens": 0, "cached_tokens": 0}
        started = time.perf_counter()
        await asyncio.gather(
            *(
                run_client(client, args, vocab_size, args.seed * 1000 + i, remaining, latencies, totals)
                for i in range(concurrency)
            )
        )
        seconds = time.perf_counter() - started
    succeeded = len(latencies) - totals["errors"]
    return LevelResult(
        concurrency=concurrency,
        requests=len(latencies),
        errors=totals["errors"],
        seconds=round(seconds, 3),
        drafts_per_s=round(succeeded / seconds, 1),
        draft_tokens_per_s=round(totals["draft_tokens"] / seconds, 1),
        latency_p50_ms=round(1000 * statistics.median(latencies), 1),
        latency_p95_ms=round(1000 * percentile(latencies, 0.95), 1),
        latency_p99_ms=round(1000 * percentile(latencies, 0.99), 1),
        cached_token_share=round(totals["cached_tokens"] / max(1, totals["prompt_tokens"]), 3),
    )


def print_table(results: list[LevelResult]) -> None:
    header = (
        f"{'clients':>7} {'requests':>8} {'errors':>6} {'drafts/s':>9} {'tokens/s':>9} "
        f"{'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'cached':>7}"
    )
    print(header)
    for r in results:
        print(
            f"{r.concurrency:>7} {r.requests:>8} {r.errors:>6} {r.drafts_per_s:>9.1f} {r.draft_tokens_per_s:>9.1f} "
            f"{r.latency_p50_ms:>8.1f} {r.latency_p95_ms:>8.1f} {r.latency_p99_ms:>8.1f} {r.cached_token_share:>7.1%}"
        )


def write_json_atomically(path: Path, content: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(handle, "w") as file:
        json.dump(content, file, indent=2)
        file.write("\n")
    os.replace(temporary, path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], help="clients per level")
    parser.add_argument("--requests", type=int, default=512, help="timed requests per level (after a warm-up)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="length of a conversation's first prompt")
    parser.add_argument("--conversation-tokens", type=int, default=1024, help="restart a conversation past this")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (k)")
    parser.add_argument("--accept", type=int, default=3, help="draft tokens a client keeps before the bonus token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120, help="seconds per request")
    parser.add_argument("--api-key-file", type=Path, default=None, help="sent as 'Authorization: Bearer <key>'")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures and server identity here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    headers = {"Authorization": f"Bearer {args.api_key_file.read_text().strip()}"} if args.api_key_file else {}
    try:
        health = httpx.get(args.url + "/health", timeout=30).raise_for_status().json()
    except httpx.HTTPError as error:
        raise SystemExit(
            f"bench_server: no healthy server at {args.url} ({error}); start one with ./serve.sh"
        ) from None
    vocab_size = health["limits"]["vocab_size"]
    model = health["model"]
    print(
        f"server {args.url}: {model['name']} ({model['architecture']}, {model['num_layers']} layers, "
        f"{model['device']}/{model['dtype']}, weights {model.get('weights')}), max_batch_size "
        f"{health['limits']['max_batch_size']}; prompt {args.prompt_tokens} tokens, k={args.max_tokens}, "
        f"accept {args.accept} + bonus"
    )
    results = [asyncio.run(run_level(args, n, vocab_size, headers)) for n in args.concurrency]
    print_table(results)
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key_file"}
        write_json_atomically(
            args.json, {"settings": settings, "server": health, "results": [asdict(r) for r in results]}
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
