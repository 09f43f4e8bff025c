"""vLLM generating with this draft server, beside vLLM's own proposers, on the same prompts in one run.

The target is SmolLM2-135M-Instruct in vLLM (CPU build, fp32, greedy); the prompts are MT-bench first turns.
Each setting runs in its own vLLM process (evidence/bench/vllm_run.py in .venv-engine, made by scripts/engine_venv.sh):

    none          no speculation: the baseline every other setting's text must equal
    ngram         vLLM's prompt-lookup proposer (n-grams of 2..5 tokens)
    draft_model   vLLM's in-process draft model: the package's student, INT4 dequantized and LoRA merged (fp32)
    server k=K    this server over HTTP (vllm_proposer.DraftServerProposer), always K draft tokens
    server adaptive   the same, the proposer choosing each request's length (at most K)
    hook_only     the proposer with no server listening: never a draft, so the cost of the hook itself (vLLM turns
                  async scheduling off for it)

Columns: wall seconds of the timed generate call (model loading and a warm-up excluded), output tokens per
second, tau per draft (1 + accepted / drafts, vLLM's mean acceptance length), tau per target step (tokens /
(tokens - accepted): drafts that were never made count as steps too), acceptance at positions 1..3 (accepted at
that position / drafts), and how many outputs equal the no-speculation output token for token. With --repeats R
each setting runs R times (each time its own vLLM process, the settings interleaved) and the table shows the run
with the median wall; bench_vllm.json keeps every wall.

Reads: --small (evidence/prompts/smollm2_models.py's output: teacher/, tokenizer/, mtbench_prompts.jsonl) and --package
(default model/). Writes into --work: target/ (teacher + tokenizer), draft/ (the package as an HF directory),
one JSON per setting, bench_vllm.json (all figures) and the server's log; prints the table (markdown).

    .venv/bin/python -m evidence.prompts.smollm2_models --cache-dir CACHE --out SMALL
    scripts/engine_venv.sh
    .venv/bin/python -m evidence.bench.bench_vllm --small SMALL --work WORK --count 20 --max-tokens 96 --k 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from evidence import common, packages

ENGINE_PYTHON = common.REPO_ROOT / ".venv-engine" / "bin" / "python"
RUNNER = common.REPO_ROOT / "evidence" / "bench" / "vllm_run.py"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=Path, required=True, help="output of evidence/prompts/smollm2_models.py")
    parser.add_argument("--package", type=Path, default=common.REPO_ROOT / "model", help="the drafter package")
    parser.add_argument("--work", type=Path, required=True, help="working directory for models and results")
    parser.add_argument("--count", type=int, default=20, help="MT-bench prompts (first turns, in file order)")
    parser.add_argument("--max-tokens", type=int, default=96, help="new tokens per prompt")
    parser.add_argument("--k", type=int, default=16, help="num_speculative_tokens")
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["none", "ngram", "draft_model", "server_fixed", "server_adaptive"],
        choices=["none", "ngram", "draft_model", "server_fixed", "server_adaptive", "hook_only"],
        help="which settings to run ('none' always runs: it is the baseline)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each setting; the table shows the median")
    parser.add_argument("--engine-python", type=Path, default=ENGINE_PYTHON, help="python of the vLLM environment")
    parser.add_argument(
        "--server-threads",
        type=int,
        default=max(os.cpu_count() or 1, 1),
        help="the draft server's --threads (default: every core; vLLM waits while the server drafts)",
    )
    parser.add_argument(
        "--proposer-timeout-s",
        type=float,
        default=60.0,
        help="DRAFT_SERVER_TIMEOUT_S: long by default, so that fixed k measures drafting rather than timeouts",
    )
    args = parser.parse_args(argv)
    if min(args.count, args.max_tokens, args.k, args.repeats) < 1:
        parser.error("--count, --max-tokens, --k and --repeats must be at least 1")
    return args


def prepare_target(small: Path, work: Path) -> Path:
    """work/target: the teacher with its tokenizer in one directory, as vLLM wants it."""
    for needed in (small / "teacher" / "config.json", small / "tokenizer" / "tokenizer.json"):
        if not needed.is_file():
            raise common.UserError(
                f"--small {small} lacks {needed.relative_to(small)}: run evidence.prompts.smollm2_models"
            )
    target = work / "target"
    if not target.is_dir():
        with common.atomic_directory(target) as staging:
            for source in (small / "teacher").iterdir():
                shutil.copy2(source, staging / source.name)
            packages.copy_tokenizer(small / "tokenizer", staging)
    return target


def prepare_draft(small: Path, package: Path, work: Path, logger) -> Path:
    """work/draft: the package as a Hugging Face directory (INT4 dequantized, LoRA merged, fp32) for vLLM's
    draft_model proposer, which then drafts with the same weights the server does (up to the server's bf16)."""
    draft = work / "draft"
    if not draft.is_dir():
        logger.info("writing %s as a Hugging Face directory (INT4 dequantized, LoRA merged, fp32)", package)
        packages.save_dense(package, draft, tokenizer=small / "tokenizer")
    return draft


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(package: Path, threads: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, str(common.REPO_ROOT / "server.py"), "--model-dir", str(package)]
    command += ["--port", str(port), "--threads", str(threads)]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=common.REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise common.UserError(f"the draft server did not start; its log: {log_path}")


def run_setting(args, name: str, target: Path, draft: Path, prompts: Path, url: str, repeat: int, logger) -> dict:
    run_name = f"{name}-{repeat}"
    out = args.work / f"{run_name}.json"
    method = {"server_fixed": "server", "server_adaptive": "server", "hook_only": "server"}.get(name, name)
    command = [str(args.engine_python), str(RUNNER), "--method", method, "--target", str(target)]
    command += ["--prompts", str(prompts), "--count", str(args.count), "--max-tokens", str(args.max_tokens)]
    command += ["--k", str(args.k), "--draft", str(draft), "--out", str(out)]
    env = os.environ | {
        "DRAFT_SERVER_URL": f"http://127.0.0.1:{free_port()}" if name == "hook_only" else url,
        "DRAFT_SERVER_ADAPTIVE": "1" if name == "server_adaptive" else "0",
        "DRAFT_SERVER_TIMEOUT_S": str(args.proposer_timeout_s),
    }
    logger.info("%s: %s", name, " ".join(command))
    with open(args.work / f"{run_name}.log", "wb") as log_file:
        finished = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, check=False)
    if finished.returncode != 0:
        raise common.UserError(f"vLLM run '{run_name}' failed (exit {finished.returncode}); see {run_name}.log")
    return json.loads(out.read_text())


def summarise(name: str, runs: list[dict], baseline: dict) -> dict:
    """The median-wall run's figures (speculation counters and texts are the same in every repeat of greedy
    decoding, up to the adaptive proposer's timing-driven choices), with every repeat's wall and its equality."""
    result = sorted(runs, key=lambda run: run["wall_s"])[len(runs) // 2]
    row = summarise_run(name, result, baseline)
    row["walls_s"] = [run["wall_s"] for run in runs]
    row["equal_to_none"] = min(summarise_run(name, run, baseline)["equal_to_none"] for run in runs)
    return row


def summarise_run(name: str, result: dict, baseline: dict) -> dict:
    spec = result["spec"]
    tokens = sum(len(output["token_ids"]) for output in result["outputs"])
    drafts, accepted = spec["num_drafts"], spec["num_accepted_tokens"]
    equal = sum(
        mine["token_ids"] == theirs["token_ids"]
        for mine, theirs in zip(result["outputs"], baseline["outputs"], strict=True)
    )
    return {
        "setting": name,
        "wall_s": result["wall_s"],
        "tokens": tokens,
        "tokens_per_s": tokens / result["wall_s"],
        "drafts": drafts,
        "draft_tokens": spec["num_draft_tokens"],
        "accepted": accepted,
        "tau_per_draft": 1 + accepted / drafts if drafts else None,
        "tau_per_step": tokens / (tokens - accepted),
        "acceptance_by_position": [count / drafts for count in spec["num_accepted_tokens_per_pos"]] if drafts else [],
        "equal_to_none": equal,
        "prompts": len(result["outputs"]),
    }


def table(rows: list[dict], k: int) -> str:
    lines = [
        "| setting | wall s | vs none | tokens/s | drafts | tau per draft | tau per step | acceptance at 1 / 2 / 3 "
        "| text equal to none |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    none_wall = rows[0]["wall_s"]
    for row in rows:
        label = {
            "server_fixed": f"this server, k = {k}",
            "server_adaptive": f"this server, adaptive (k <= {k})",
            "hook_only": "custom_class hook, no server",
        }
        by_position = " / ".join(f"{rate:.2f}" for rate in row["acceptance_by_position"][:3]) or "-"
        tau_draft = f"{row['tau_per_draft']:.3f}" if row["tau_per_draft"] else "-"
        lines.append(
            f"| {label.get(row['setting'], row['setting'])} | {row['wall_s']:.1f} | {row['wall_s'] / none_wall:.2f}x "
            f"| {row['tokens_per_s']:.1f} | {row['drafts']} | {tau_draft} | {row['tau_per_step']:.3f} "
            f"| {by_position} | {row['equal_to_none']}/{row['prompts']} |"
        )
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.machine()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    logger = common.setup_logging(args.work / "bench_vllm.log", "bench_vllm")
    logger.info("command: python -m evidence.bench.bench_vllm %s", " ".join(sys.argv[1:] if argv is None else argv))
    if not args.engine_python.is_file():
        raise common.UserError(f"{args.engine_python} does not exist: run scripts/engine_venv.sh first")
    prompts = args.small / "mtbench_prompts.jsonl"
    target, draft = prepare_target(args.small, args.work), prepare_draft(args.small, args.package, args.work, logger)
    settings = ["none"] + [name for name in args.settings if name != "none"]
    server, url = start_server(args.package, args.server_threads, args.work / "server.log")
    try:
        results: dict[str, list[dict]] = {name: [] for name in settings}
        for repeat in range(args.repeats):  # interleaved, so that a change in the machine's load hits every setting
            for name in settings:
                results[name].append(run_setting(args, name, target, draft, prompts, url, repeat, logger))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    baseline = results["none"][0]
    rows = [summarise(name, results[name], baseline) for name in settings]
    cpu = f"{cpu_name()}, {os.cpu_count()} cores"
    report = {"cpu": cpu, "rows": rows} | {
        name: getattr(args, name)
        for name in ("count", "max_tokens", "k", "repeats", "server_threads", "proposer_timeout_s")
    }
    common.atomic_write_json(args.work / "bench_vllm.json", report)
    print(f"CPU: {cpu}; {args.count} MT-bench first turns, {args.max_tokens} new tokens, greedy, fp32 target")
    print(
        f"draft server: {args.package}, --threads {args.server_threads}; proposer timeout {args.proposer_timeout_s} s"
    )
    print(table(rows, args.k))
    return report


if __name__ == "__main__":
    common.run_cli(main)
