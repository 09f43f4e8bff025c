"""Soak a draft server: hours of mixed traffic in minutes, and the figures that show whether it held.

Reads nothing but the server (GET /health for its vocabulary, context and process id, POST /draft, GET
/metrics) and, on this machine, the server's resident memory from /proc/<pid>/status. Writes a JSON report
with --json. With --model-dir it starts `server.py` itself on a free loopback port, in fp32 with dense
weights (the path on which a draft does not depend on its batch or on the cache), and stops it at the end.

--concurrency clients send, for --duration-s seconds, a mix of
  * valid requests: conversations that continue (the previous turn plus drafts plus a bonus token, so the
    prefix cache is exercised) or start afresh, with random max_tokens, logprobs and truncation;
  * invalid ones: ids outside the vocabulary, an empty list, wrong types, broken JSON, an oversized body;
  * clients that hang up: a request abandoned while it is queued or drafted, and an upload that stops
    half-way through its body and closes the connection.
Meanwhile /health is polled once a second and the server's RSS sampled. At the end a sample of the valid
requests is sent again, one at a time, and each draft compared with what the same request got under load.

It passes (exit status 0) with no status 500, /health answering 200 throughout, RSS after warm-up growing
less than --max-rss-growth, and every re-sent draft equal. Run it for 10 minutes at concurrency 32 with

    python -m evidence.bench.soak --model-dir model --duration-s 600 --concurrency 32 --json soak.json
    python -m evidence.bench.soak --url http://127.0.0.1:8000 --duration-s 3600   # a server already running
"""

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
VERIFY_SAMPLE = 64  # valid requests re-sent alone at the end
WARM_UP_SHARE = 0.1  # the first tenth of the run: caches fill and malloc reaches its working size


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)  # "kind status" -> count
    health_failures: int = 0
    health_checks: int = 0
    rss_samples: list = field(default_factory=list)  # (seconds since start, bytes)
    answered: list = field(default_factory=list)  # reservoir of (request body, draft) for the final check
    valid_seen: int = 0

    def remember(self, body: dict, draft: list[int], rng: random.Random) -> None:
        """Reservoir sampling: every valid answer has the same chance to be checked at the end."""
        self.valid_seen += 1
        if len(self.answered) < VERIFY_SAMPLE:
            self.answered.append((body, draft))
        elif (slot := rng.randrange(self.valid_seen)) < VERIFY_SAMPLE:
            self.answered[slot] = (body, draft)


def valid_body(rng: random.Random, history: list[list[int]], vocab_size: int, max_context: int) -> dict:
    """A turn of a conversation this client has going, or a fresh one."""
    if history and rng.random() < 0.7:
        tokens = history[-1]
    else:
        tokens = [rng.randrange(vocab_size) for _ in range(rng.randint(1, min(max_context - 1, 600)))]
    body = {"token_ids": tokens, "max_tokens": rng.randint(1, 16)}
    if rng.random() < 0.2:
        body["return_logprobs"] = True
    if len(tokens) + body["max_tokens"] > max_context:
        body["truncate"] = True
    return body


def invalid_body(rng: random.Random, vocab_size: int) -> tuple[str, bytes]:
    """(what is wrong, raw JSON body)."""
    choices = {
        "id out of vocabulary": json.dumps({"token_ids": [1, vocab_size + rng.randrange(1000)]}),
        "empty token_ids": json.dumps({"token_ids": []}),
        "string id": json.dumps({"token_ids": [1, "2"]}),
        "bool max_tokens": json.dumps({"token_ids": [1], "max_tokens": True}),
        "broken JSON": '{"token_ids": [1, 2',
        "oversized body": json.dumps({"token_ids": [1] * 400_000}),  # over the default 1 MiB
    }
    kind = rng.choice(sorted(choices))
    return kind, choices[kind].encode()


async def stalled_upload(host: str, port: int, rng: random.Random) -> None:
    """Send the headers and half the body, wait a little, close: the server must not wait for the rest."""
    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps({"token_ids": list(range(200))}).encode()
    head = f"POST /draft HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    writer.write(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2])
    await writer.drain()
    await asyncio.sleep(rng.uniform(0.05, 1.0))
    writer.close()
    await writer.wait_closed()


async def client(index: int, url: str, limits: dict, deadline: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed * 1000 + index)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    history: list[list[int]] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.monotonic() < deadline:
            roll = rng.random()
            if roll < 0.7:
                body = valid_body(rng, history, limits["vocab_size"], limits["max_context"])
                response = await http.post("/draft", json=body)
                tally.statuses[f"valid {response.status_code}"] += 1
                if response.status_code == 200:
                    draft = response.json()["draft_token_ids"]
                    tally.remember(body, draft, rng)
                    history = [body["token_ids"] + draft[: rng.randint(0, len(draft))] + [rng.randrange(100)]]
            elif roll < 0.85:
                kind, raw = invalid_body(rng, limits["vocab_size"])
                headers = {"Content-Type": "application/json"}
                response = await http.post("/draft", content=raw, headers=headers)
                tally.statuses[f"invalid {response.status_code}"] += 1
            elif roll < 0.93:
                body = valid_body(rng, [], limits["vocab_size"], limits["max_context"])
                try:  # gives up after a few milliseconds: queued or mid-draft, the server sees a disconnect
                    await http.post("/draft", json=body, timeout=rng.uniform(0.001, 0.05))
                    tally.statuses["hang-up answered first"] += 1
                except httpx.TimeoutException:
                    tally.statuses["hang-up"] += 1
            else:
                await stalled_upload(host, int(port), rng)
                tally.statuses["stalled upload"] += 1


def resident_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def watch(url: str, pid: int, started: float, deadline: float, tally: Tally) -> None:
    """/health once a second (a failure: not 200 within 5 s), RSS every 5 s."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        tick = 0
        while time.monotonic() < deadline:
            tally.health_checks += 1
            try:
                if (await http.get("/health")).status_code != 200:
                    tally.health_failures += 1
            except httpx.HTTPError:
                tally.health_failures += 1
            if tick % 5 == 0 and (rss := resident_bytes(pid)) is not None:
                tally.rss_samples.append((round(time.monotonic() - started, 1), rss))
            tick += 1
            await asyncio.sleep(1)


def verify_alone(url: str, answered: list[tuple[dict, list[int]]]) -> int:
    """How many of the sampled valid requests, sent again one at a time, got a different draft."""
    with httpx.Client(base_url=url, timeout=120) as http:
        return sum(http.post("/draft", json=body).json()["draft_token_ids"] != draft for body, draft in answered)


def report(tally: Tally, args: argparse.Namespace, mismatches: int, seconds: float) -> dict:
    warm = [rss for at, rss in tally.rss_samples if at >= WARM_UP_SHARE * args.duration_s]
    rss_start, rss_end = (warm[0], warm[-1]) if warm else (None, None)
    growth = (rss_end - rss_start) / rss_start if warm else None
    statuses = dict(sorted(tally.statuses.items()))
    server_errors = sum(count for key, count in statuses.items() if key.endswith(" 500"))
    checks = {
        "no status 500": server_errors == 0,
        "health answered throughout": tally.health_failures == 0 and tally.health_checks > 0,
        f"rss growth under {args.max_rss_growth:.0%} after warm-up": growth is not None
        and growth < args.max_rss_growth,
        "drafts under load equal drafts alone": mismatches == 0 and len(tally.answered) > 0,
    }
    return {
        "seconds": round(seconds, 1),
        "concurrency": args.concurrency,
        "requests": sum(statuses.values()),
        "statuses": statuses,
        "health_checks": tally.health_checks,
        "health_failures": tally.health_failures,
        "rss_mib_after_warm_up": round(rss_start / 2**20, 1) if rss_start else None,
        "rss_mib_at_end": round(rss_end / 2**20, 1) if rss_end else None,
        "rss_growth": round(growth, 4) if growth is not None else None,
        "verified_alone": len(tally.answered),
        "verify_mismatches": mismatches,
        "checks": checks,
        "passed": all(checks.values()),
    }


async def soak(url: str, args: argparse.Namespace) -> dict:
    health = httpx.get(url + "/health", timeout=30).json()
    limits = {"vocab_size": health["limits"]["vocab_size"], "max_context": health["limits"]["max_context"]}
    tally = Tally()
    started = time.monotonic()
    deadline = started + args.duration_s
    clients = [client(i, url, limits, deadline, tally, args.seed) for i in range(args.concurrency)]
    await asyncio.gather(watch(url, health["pid"], started, deadline, tally), *clients)
    seconds = time.monotonic() - started
    mismatches = await asyncio.to_thread(verify_alone, url, tally.answered)
    return report(tally, args, mismatches, seconds)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model_dir: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, str(REPO_ROOT / "server.py"), "--model-dir", str(model_dir), "--port", str(port)]
    command += ["--dtype", "float32", "--weights", "dequant"]  # drafts independent of batch and cache
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if process.poll() is not None:
            raise SystemExit(f"soak: the server exited with {process.returncode}; its log: {log_path}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"soak: the server did not answer /health in 300 s; its log: {log_path}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000 (on this machine: RSS is read)")
    target.add_argument("--model-dir", type=Path, help="start server.py on this package (fp32, dense weights)")
    parser.add_argument("--duration-s", type=float, default=600, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=32, help="clients sending at once")
    parser.add_argument("--max-rss-growth", type=float, default=0.10, help="allowed RSS growth after warm-up")
    parser.add_argument("--seed", type=int, default=0, help="seeds every client's choices")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if args.duration_s <= 0 or args.concurrency < 1:
        parser.error("--duration-s must be > 0 and --concurrency >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    process = None
    if args.model_dir:
        log_path = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
        print(f"soak: server log {log_path}", flush=True)
        process, url = start_server(args.model_dir, log_path)
    else:
        url = args.url.rstrip("/")
    try:
        result = asyncio.run(soak(url, args))
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            result_code = process.wait(timeout=60)
            print(f"soak: server exited with {result_code}", flush=True)
    print(json.dumps(result, indent=2))
    if args.json:
        temporary = args.json.with_name(f".{args.json.name}.tmp")
        temporary.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(temporary, args.json)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
