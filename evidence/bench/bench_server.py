"""Benchmark a live draft server, or a router in front of replicas: N concurrent clients, each replaying a
speculative-decoding loop over HTTP.

Reads nothing but the server (GET /health for its identity and vocabulary, POST /draft). Prints one table
row per concurrency level: requests (drafts) per second, draft tokens per second, latency p50/p95/p99, the
share of prompt tokens served from the prefix cache, errors, and how many replicas answered (from the
X-Draft-Replica response header, where the server sends it). --json also writes the figures to a file.

Each client behaves like the benchmark harness: it starts a conversation from --prompt-tokens random ids,
asks for --max-tokens drafts, then extends the conversation by --accept of those drafts plus one bonus
token and asks again, so follow-up requests hit the server's prefix cache; a conversation restarts once it
passes --conversation-tokens. Every request names its conversation in an X-Session-ID header (unless
--no-session-id), so a router hashing that header keeps a conversation on one replica. Each level first
sends every client's opening turn (the warm-up: cold prefills, not timed); the timed requests continue
those conversations. Token ids are seeded, so every run sends the same requests.

With a router (`REPLICAS=N ./serve.sh`, vllm-router), /health is the router's own; the server's identity
then comes from the first replica that the router's GET /list_workers names.

Start a server first (another terminal), then:

    ./serve.sh
    .venv/bin/python evidence/bench/bench_server.py --url http://127.0.0.1:8000 --concurrency 1 4 16 64 --requests 512
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
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
    replicas: dict[str, int]  # X-Draft-Replica -> timed requests it answered ({} where the server sends none)
    sessions_on_several_replicas: int  # conversations answered by more than one replica (affinity misses)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Conversation:
    """One client's conversation, kept across the warm-up and the timed requests."""

    def __init__(self, args: argparse.Namespace, vocab_size: int, seed: int):
        self.args, self.vocab_size, self.seed = args, vocab_size, seed
        self.rng = random.Random(seed)
        self.restarts = -1
        self.restart()

    def restart(self) -> None:
        self.restarts += 1
        self.session = f"bench-{self.seed}-{self.restarts}"
        self.token_ids = [self.rng.randrange(self.vocab_size) for _ in range(self.args.prompt_tokens)]

    def extend(self, draft: list[int]) -> None:
        self.token_ids = self.token_ids + draft[: self.args.accept] + [self.rng.randrange(self.vocab_size)]
        if len(self.token_ids) > self.args.conversation_tokens:
            self.restart()


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    draft_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replicas: Counter = field(default_factory=Counter)
    session_replicas: dict[str, set] = field(default_factory=dict)


async def run_client(
    client: httpx.AsyncClient, args: argparse.Namespace, conversation: Conversation, remaining: list[int], tally: Tally
) -> None:
    """One harness-like client: keep drafting and extending its conversation until the shared budget is spent."""
    while remaining[0] > 0:
        remaining[0] -= 1
        headers = {} if args.no_session_id else {"X-Session-ID": conversation.session}
        body = {"token_ids": conversation.token_ids, "max_tokens": args.max_tokens}
        started = time.perf_counter()
        try:
            response = await client.post("/draft", json=body, headers=headers)
        except httpx.TransportError:  # a timeout or a dropped connection: an error, and the client goes on
            response = None
        tally.latencies.append(time.perf_counter() - started)
        if response is None or response.status_code != 200:
            tally.errors += 1
            continue
        replica = response.headers.get("x-draft-replica")
        if replica is not None:
            tally.replicas[replica] += 1
            tally.session_replicas.setdefault(conversation.session, set()).add(replica)
        answer = response.json()
        tally.draft_tokens += len(answer["draft_token_ids"])
        tally.prompt_tokens += len(conversation.token_ids)
        tally.cached_tokens += answer["cached_tokens"]
        conversation.extend(answer["draft_token_ids"])


async def run_level(args: argparse.Namespace, concurrency: int, vocab_size: int, headers: dict) -> LevelResult:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # Seeds differ per level too, so a level never finds an earlier level's conversations in the cache.
    conversations = [
        Conversation(args, vocab_size, args.seed * 10**6 + concurrency * 1000 + i) for i in range(concurrency)
    ]
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits) as client:
        # Warm-up: every client's opening turn (a cold prefill); the timed requests continue these conversations.
        warmup_budget = [concurrency]
        await asyncio.gather(*(run_client(client, args, c, warmup_budget, Tally()) for c in conversations))
        remaining, tally = [args.requests], Tally()
        started = time.perf_counter()
        await asyncio.gather(*(run_client(client, args, c, remaining, tally) for c in conversations))
        seconds = time.perf_counter() - started
    latencies = tally.latencies
    succeeded = len(latencies) - tally.errors
    return LevelResult(
        concurrency=concurrency,
        requests=len(latencies),
        errors=tally.errors,
        seconds=round(seconds, 3),
        drafts_per_s=round(succeeded / seconds, 1),
        draft_tokens_per_s=round(tally.draft_tokens / seconds, 1),
        latency_p50_ms=round(1000 * statistics.median(latencies), 1),
        latency_p95_ms=round(1000 * percentile(latencies, 0.95), 1),
        latency_p99_ms=round(1000 * percentile(latencies, 0.99), 1),
        cached_token_share=round(tally.cached_tokens / max(1, tally.prompt_tokens), 3),
        replicas=dict(sorted(tally.replicas.items())),
        sessions_on_several_replicas=sum(len(seen) > 1 for seen in tally.session_replicas.values()),
    )


def print_table(results: list[LevelResult]) -> None:
    header = (
        f"{'clients':>7} {'requests':>8} {'errors':>6} {'drafts/s':>9} {'tokens/s':>9} "
        f"{'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'cached':>7} {'replicas':>8} {'split':>5}"
    )
    print(header)
    for r in results:
        print(
            f"{r.concurrency:>7} {r.requests:>8} {r.errors:>6} {r.drafts_per_s:>9.1f} {r.draft_tokens_per_s:>9.1f} "
            f"{r.latency_p50_ms:>8.1f} {r.latency_p95_ms:>8.1f} {r.latency_p99_ms:>8.1f} {r.cached_token_share:>7.1%} "
            f"{len(r.replicas) or '-':>8} {r.sessions_on_several_replicas:>5}"
        )
    print(
        "replicas: how many answered (X-Draft-Replica; '-': not sent); split: conversations answered by more than one"
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
    parser.add_argument(
        "--no-session-id", action="store_true", help="send no X-Session-ID header (a router then places by body hash)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=120, help="seconds per request; a request past it counts as an error"
    )
    parser.add_argument("--api-key-file", type=Path, default=None, help="sent as 'Authorization: Bearer <key>'")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures and server identity here")
    return parser.parse_args()


def kernel_text(model: dict) -> str:
    """The server's INT4 kernel, its attention and norm and, on a CPU, the instruction sets they were chosen for
    (from /health)."""
    kernel = model.get("kernel") or {}
    attention = "".join(f", {part} {kernel[part]}" for part in ("attention", "norm") if part in kernel)
    cpu = f" on a CPU with {kernel['cpu']}" if "cpu" in kernel else ""
    return f"kernel {kernel.get('name', 'unknown (an older server)')}{attention}{cpu}"


def server_identity(url: str) -> dict:
    """The draft server's /health; behind vllm-router (whose /health is its own plain text), a replica's."""
    try:
        response = httpx.get(url + "/health", timeout=30)
        response.raise_for_status()
    except httpx.HTTPError as error:
        raise SystemExit(f"bench_server: no healthy server at {url} ({error}); start one with ./serve.sh") from None
    try:
        return response.json()
    except ValueError:
        pass
    try:
        workers = httpx.get(url + "/list_workers", timeout=30).raise_for_status().json()["urls"]
        health = httpx.get(workers[0] + "/health", timeout=30).raise_for_status().json()
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
        raise SystemExit(
            f"bench_server: {url}/health is not a draft server's ({response.text[:60]!r}) and its replicas could not "
            f"be listed through /list_workers ({error})"
        ) from None
    return {**health, "router": {"url": url, "workers": workers}}


def main() -> None:
    args = parse_args()
    for name in ("requests", "prompt_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"bench_server: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.concurrency) < 1:
        raise SystemExit(f"bench_server: --concurrency must be >= 1, got {min(args.concurrency)}")
    try:
        headers = {"Authorization": f"Bearer {args.api_key_file.read_text().strip()}"} if args.api_key_file else {}
    except OSError as error:
        raise SystemExit(f"bench_server: --api-key-file: {error}") from None
    health = server_identity(args.url)
    vocab_size = health["limits"]["vocab_size"]
    model = health["model"]
    router = health.get("router")
    behind = f" (a router over {len(router['workers'])} replicas)" if router else ""
    print(
        f"server {args.url}{behind}: "
        f"{model['name']} ({model['architecture']}, {model['num_layers']} layers, "
        f"{model['device']}/{model['dtype']}, weights {model.get('weights')}, {kernel_text(model)}), max_batch_size "
        f"{health['limits']['max_batch_size']}; prompt {args.prompt_tokens} tokens, k={args.max_tokens}, "
        f"accept {args.accept} + bonus; X-Session-ID {'off' if args.no_session_id else 'per conversation'}"
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
