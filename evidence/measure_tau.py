"""Measure tau against a real target: greedy draft-and-verify with the target's own KV cache.

For each prompt: the drafter proposes up to k tokens, the target scores them all in one forward, the
agreeing prefix plus the target's own next token (the bonus) is committed, the target's cache is cropped
back to the commit point, and the loop repeats until --max-new-tokens or an end-of-sequence token.
tau = committed tokens / verify steps (bonus included). The same run also times the target alone
(transformers greedy generate()), which is the reference output for --check and the tokens/s baseline.

Drafters: a running draft server over HTTP (--server URL; each request is the previous one plus the
accepted drafts plus the bonus, as the benchmark harness sends them), a model package or checkpoint in
this process (--drafter DIR, through draft_model), and the prompt-lookup n-gram baseline
(--baselines ngram: no model; the last n tokens are looked up earlier in the sequence and what followed
them is proposed).

Reads: the target (a transformers causal-LM directory), the drafter (server or directory), and a jsonl
of prompts with `token_ids` per line (prepare_prompts.py's output; `prompt_ids` is accepted too).
Writes: a table on stdout; with --json OUT, the report to OUT (atomically) and a log beside it.
Exit status: 0; 2 for a user error; 1 when --check finds a committed token that differs from the
target's greedy output (each mismatch is logged with prompt index, position and both tokens).

    python evidence/measure_tau.py --target TARGET_DIR --prompts WORK/prompts.jsonl \
        --server http://127.0.0.1:8000 --k 16 --max-new-tokens 128 --limit 80 \
        --baselines ngram --check --json OUT/tau.json

Not yet: prompts as chat messages or the MT-bench question file, transformers assisted generation as a
baseline, and the PNG plot.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import torch
from tqdm import tqdm
from transformers import DynamicCache

from evidence import common
from evidence.tau import load_any_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BASELINES = ("ngram",)
SERVER_TIMEOUT_S = 60

# A drafter maps (the sequence so far, how many tokens at most) to its proposed continuation.
DraftFn = Callable[[list[int], int], list[int]]


# ----------------------------------------------------------------------------------------------- drafters


def server_drafter(client: httpx.Client) -> DraftFn:
    """Drafts from a running draft server: POST /draft with the whole sequence, as the harness does."""

    def draft(tokens: list[int], max_tokens: int) -> list[int]:
        try:
            response = client.post("/draft", json={"token_ids": tokens, "max_tokens": max_tokens})
        except httpx.TransportError as error:
            raise common.UserError(f"draft server at {client.base_url} did not answer: {error}") from None
        if response.status_code != 200:
            raise common.UserError(f"draft server answered {response.status_code} to /draft: {response.text[:500]}")
        return response.json()["draft_token_ids"]

    return draft


def in_process_drafter(model_dir: Path) -> DraftFn:
    """Drafts from a model package or checkpoint loaded in this process with draft_model."""
    import draft_model

    try:
        drafter = draft_model.load_model(model_dir, cache_slots=2)  # one sequence at a time: its slot is reused
    except draft_model.ModelLoadError as error:
        raise common.UserError(str(error)) from None

    def draft(tokens: list[int], max_tokens: int) -> list[int]:
        return list(draft_model.draft_batch(drafter, [tokens], max_tokens=max_tokens)[0])

    return draft


def ngram_drafter(max_ngram: int = 3) -> DraftFn:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (longest n
    first) and propose the tokens that followed it."""

    def draft(tokens: list[int], max_tokens: int) -> list[int]:
        for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # earlier occurrences only, latest first
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + max_tokens]
        return []

    return draft


# ----------------------------------------------------------------------------------------------- target


@dataclass
class SpeculativeRun:
    """What one drafter did over all prompts."""

    committed: int = 0
    verify_steps: int = 0
    drafted_per_call: list[int] = field(default_factory=list)
    draft_seconds: list[float] = field(default_factory=list)  # per call, as the client sees it
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    # Per draft position i: the steps that drafted at least i + 1 tokens, and those whose drafts 0..i were
    # all accepted; their ratio is the reported P(position i accepted).
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # committed continuation per prompt

    def record_step(self, drafted: int, accepted: int) -> None:
        for position in range(drafted):
            if position == len(self.proposed_at):
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            self.proposed_at[position] += 1
            self.accepted_at[position] += int(position < accepted)


def verify(target: torch.nn.Module, cache: DynamicCache, last_token: int, draft: list[int]) -> list[int]:
    """The target's greedy token after `last_token` and after each draft token, in one forward.

    The cache holds every committed token but the last; it grows by 1 + len(draft) here."""
    input_ids = torch.tensor([[last_token, *draft]])
    logits = target(input_ids=input_ids, cache=cache, use_cache=True).logits[0]  # [1 + d, V]
    return logits.argmax(-1).tolist()


@torch.inference_mode()
def speculative_generate(
    target: torch.nn.Module, draft: DraftFn, prompt: list[int], k: int, max_new_tokens: int, eos_ids: set[int], run: SpeculativeRun
) -> list[int]:
    """Greedy draft-and-verify on one prompt; returns the committed continuation and records into `run`."""
    started = time.perf_counter()
    cache = DynamicCache()
    if len(prompt) > 1:  # keep the invariant: the cache holds all tokens but the last
        target(input_ids=torch.tensor([prompt[:-1]]), cache=cache, use_cache=True)
    sequence = list(prompt)
    while len(sequence) - len(prompt) < max_new_tokens:
        remaining = max_new_tokens - (len(sequence) - len(prompt))
        draft_started = time.perf_counter()
        proposal = draft(sequence, min(k, remaining))[:k]
        run.draft_seconds.append(time.perf_counter() - draft_started)
        run.drafted_per_call.append(len(proposal))

        verify_started = time.perf_counter()
        target_tokens = verify(target, cache, sequence[-1], proposal)
        run.verify_seconds += time.perf_counter() - verify_started
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == target_tokens[accepted]:
            accepted += 1
        run.record_step(len(proposal), accepted)
        run.verify_steps += 1

        # Keep the KV of the last committed token and of the accepted drafts; the bonus is fed next step.
        # (This transformers' crop takes the number of tokens to drop, as a negative int.)
        cache.crop(-(len(proposal) - accepted))
        new_tokens = (proposal[:accepted] + [target_tokens[accepted]])[:remaining]
        ends = [i for i, token in enumerate(new_tokens) if token in eos_ids]
        sequence += new_tokens[: ends[0] + 1] if ends else new_tokens
        if ends:
            break
    continuation = sequence[len(prompt) :]
    run.committed += len(continuation)
    run.total_seconds += time.perf_counter() - started
    run.outputs.append(continuation)
    return continuation


@torch.inference_mode()
def target_greedy(target: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """The target alone: transformers greedy generate() with its KV cache (the reference output)."""
    stop = sorted(eos_ids) or None  # a target without eos ids generates max_new_tokens every time
    output = target.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stop,
        pad_token_id=stop[0] if stop else None,
    )
    return output[0, len(prompt) :].tolist()


def eos_token_ids(target: torch.nn.Module) -> set[int]:
    eos = target.generation_config.eos_token_id
    if eos is None:
        eos = target.config.eos_token_id
    return set() if eos is None else set([eos] if isinstance(eos, int) else eos)


# ----------------------------------------------------------------------------------------------- report


def first_mismatch(committed: list[int], reference: list[int]) -> tuple[int, int | None, int | None] | None:
    """(position, committed token, reference token) where the two first differ, or None if equal."""
    for position in range(max(len(committed), len(reference))):
        ours = committed[position] if position < len(committed) else None
        theirs = reference[position] if position < len(reference) else None
        if ours != theirs:
            return position, ours, theirs
    return None


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (values need not be sorted)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))] if ordered else float("nan")


def summarize(name: str, run: SpeculativeRun, greedy_tokens_per_s: float, mismatches: list[dict] | None) -> dict:
    tokens_per_s = run.committed / run.total_seconds if run.total_seconds else float("nan")
    return {
        "drafter": name,
        "tau": run.committed / run.verify_steps if run.verify_steps else float("nan"),
        "committed_tokens": run.committed,
        "verify_steps": run.verify_steps,
        "acceptance_by_position": [a / p for a, p in zip(run.accepted_at, run.proposed_at)],
        "mean_draft_tokens_per_call": statistics.fmean(run.drafted_per_call) if run.drafted_per_call else float("nan"),
        "draft_latency_ms": {"p50": 1000 * percentile(run.draft_seconds, 0.50), "p95": 1000 * percentile(run.draft_seconds, 0.95)},
        "draft_seconds": sum(run.draft_seconds),
        "verify_seconds": run.verify_seconds,
        "tokens_per_s": tokens_per_s,
        "speedup_vs_target_greedy": tokens_per_s / greedy_tokens_per_s,
        "check": "not run" if mismatches is None else ("passed" if not mismatches else "FAILED"),
        "mismatches": mismatches or [],
    }


def print_table(report: dict) -> None:
    greedy = report["target_greedy"]
    print(f"target {report['target']}  k={report['k']}  max_new_tokens={report['max_new_tokens']}  prompts={report['prompts']}")
    print(f"target-only greedy: {greedy['tokens']} tokens, {greedy['tokens_per_s']:.1f} tok/s")
    header = f"{'drafter':<40} {'tau':>6} {'draft/call':>10} {'p50 ms':>8} {'p95 ms':>8} {'verify s':>9} {'tok/s':>8} {'speedup':>8} {'check':>8}"
    print(header)
    print("-" * len(header))
    for run in report["runs"]:
        latency = run["draft_latency_ms"]
        print(
            f"{run['drafter'][-40:]:<40} {run['tau']:>6.3f} {run['mean_draft_tokens_per_call']:>10.2f} {latency['p50']:>8.2f} "
            f"{latency['p95']:>8.2f} {run['verify_seconds']:>9.2f} {run['tokens_per_s']:>8.1f} {run['speedup_vs_target_greedy']:>8.2f} {run['check']:>8}"
        )
    for run in report["runs"]:
        curve = " ".join(f"{p:.2f}" for p in run["acceptance_by_position"])
        print(f"P(position i accepted) {run['drafter']}: {curve}")


# ----------------------------------------------------------------------------------------------- inputs


def load_prompts(path: Path, limit: int | None, vocab_size: int) -> list[list[int]]:
    """Token-id prompts from a jsonl (`token_ids`, or `prompt_ids`), checked against the target's vocabulary."""
    prompts = []
    for line_number, row in enumerate(common.read_jsonl(path)[:limit], 1):
        ids = row.get("token_ids", row.get("prompt_ids")) if isinstance(row, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise common.UserError(f"{path}:{line_number}: expected a non-empty list of ints in `token_ids` (or `prompt_ids`)")
        if not all(0 <= i < vocab_size for i in ids):
            raise common.UserError(f"{path}:{line_number}: token id {max(ids)} or {min(ids)} outside the target's vocabulary 0..{vocab_size - 1}")
        prompts.append(ids)
    if not prompts:
        raise common.UserError(f"{path} holds no prompts")
    return prompts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="target causal-LM directory (transformers)")
    drafters = parser.add_mutually_exclusive_group()
    drafters.add_argument("--server", help="draft server base URL, e.g. http://127.0.0.1:8000")
    drafters.add_argument("--drafter", type=Path, help="model package or checkpoint directory, drafted in this process")
    parser.add_argument("--baselines", nargs="*", choices=BASELINES, default=[], help="also measure these drafters in the same run")
    parser.add_argument("--prompts", type=Path, required=True, help="jsonl with `token_ids` per line")
    parser.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    parser.add_argument("--k", type=int, default=16, help="draft tokens per verify step (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to commit per prompt (default 128)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="target dtype on CPU (default float32)")
    parser.add_argument("--check", action="store_true", help="committed output must equal the target's greedy output")
    parser.add_argument("--json", type=Path, default=None, help="write the report here (and a log beside it)")
    args = parser.parse_args(argv)
    if args.server is None and args.drafter is None and not args.baselines:
        parser.error("give a drafter (--server or --drafter) and/or --baselines")
    for name in ("k", "max_new_tokens", "limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise common.UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return args


def make_logger(json_path: Path | None) -> logging.Logger:
    if json_path is not None:
        return common.setup_logging(common.log_path_beside(json_path, "measure_tau"), "measure_tau")
    logger = logging.getLogger("evidence.measure_tau")
    if not logger.handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return logger


# ----------------------------------------------------------------------------------------------- main


def measure(name: str, draft: DraftFn, target, prompts, args, eos_ids, references, greedy_tokens_per_s, logger) -> dict:
    run = SpeculativeRun()
    for prompt in tqdm(prompts, desc=name[-30:], leave=False):
        speculative_generate(target, draft, prompt, args.k, args.max_new_tokens, eos_ids, run)
    mismatches = None
    if args.check:
        mismatches = []
        for index, (committed, reference) in enumerate(zip(run.outputs, references)):
            found = first_mismatch(committed, reference)
            if found:
                position, ours, theirs = found
                logger.error("LOSSLESS CHECK FAILED (%s): prompt %d position %d: committed %s, target greedy %s", name, index, position, ours, theirs)
                mismatches.append({"prompt": index, "position": position, "committed": ours, "target_greedy": theirs})
    summary = summarize(name, run, greedy_tokens_per_s, mismatches)
    summary["outputs"] = run.outputs
    return summary


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logger = make_logger(args.json)
    target = load_any_model(args.target, "cpu", DTYPES[args.dtype])
    eos_ids = eos_token_ids(target)
    prompts = load_prompts(args.prompts, args.limit, target.config.vocab_size)

    drafters: list[tuple[str, DraftFn]] = []
    client = httpx.Client(base_url=args.server, timeout=SERVER_TIMEOUT_S) if args.server else None
    if client is not None:
        drafters.append((f"server {args.server}", server_drafter(client)))
    if args.drafter is not None:
        drafters.append((f"model {args.drafter}", in_process_drafter(args.drafter)))
    if "ngram" in args.baselines:
        drafters.append(("ngram", ngram_drafter()))

    logger.info("target-only greedy on %d prompts", len(prompts))
    started = time.perf_counter()
    references = [target_greedy(target, prompt, args.max_new_tokens, eos_ids) for prompt in prompts]
    greedy_seconds = time.perf_counter() - started
    greedy_tokens = sum(len(r) for r in references)
    report = {
        "target": str(args.target),
        "dtype": args.dtype,
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts),
        "target_greedy": {"tokens": greedy_tokens, "seconds": greedy_seconds, "tokens_per_s": greedy_tokens / greedy_seconds},
        "runs": [],
    }
    try:
        for name, draft in drafters:
            logger.info("measuring %s", name)
            report["runs"].append(measure(name, draft, target, prompts, args, eos_ids, references, greedy_tokens / greedy_seconds, logger))
    finally:
        if client is not None:
            client.close()

    print_table(report)
    if args.json is not None:
        common.atomic_write_text(args.json, json.dumps(report, indent=2) + "\n")
    if any(run["check"] == "FAILED" for run in report["runs"]):
        logger.error("the lossless check failed: see the mismatches above")
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    common.run_cli(main)
