"""Measure tau against a real target: greedy draft-and-verify with the target's own KV cache.

For each prompt: the drafter proposes up to k tokens, the target scores them all in one forward, the
agreeing prefix plus the target's own next token (the bonus) is committed, the target's cache is cropped
back to the commit point, and the loop repeats until --max-new-tokens or an end-of-sequence token.
tau = committed tokens / verify steps (bonus included). The same run also times the target alone
(transformers greedy generate()), which is the reference output for --check and the tokens/s baseline.

Drafters, all measured in the same run against the same target-only reference:
  --server URL     a running draft server over HTTP: each request is the previous one plus the accepted
                   drafts plus the bonus, as the benchmark harness sends them
  --drafter DIR    a model package or checkpoint in this process, through draft_model (--drafter-weights);
                   repeatable, to measure several stages against one target-only run
  --drafter-without-lora DIR   the same for a package, ignoring its LoRA adapter (the INT4 stage)
  --hybrid N       also the server, or the first --drafter, with hybrid drafting (lookup_min_match N: a
                   repeat of at least N tokens in the sequence is copied instead of drafted)
  --min-confidence P [P ...]   also the server, or the first --drafter, with adaptive draft length (stop
                   after a draft token below probability P): tau against draft tokens per call
  --baselines ngram      prompt lookup with no model (the last 1..3 tokens looked up earlier in the sequence)
  --baselines assisted   transformers assisted generation (generate(assistant_model=...), k constant
                   candidates, no confidence cut-off) with --assistant DIR (default --drafter) as the
                   assistant in fp32: for greedy decoding its tau must equal ours for the same weights
                   (dense fp32 weights on both sides: --drafter-weights dequant)
The last draft of a prompt asks for at most the tokens that can still be committed minus the bonus, as
transformers does, so the two loops verify the same steps.

Prompts: a jsonl (--prompts) with `token_ids` (or `prompt_ids`) or chat `messages` per line, or the
MT-bench question file (--mtbench question.jsonl: first turns, or --turns 2 for both, the second after
the target's own greedy answer to the first). Messages are encoded with the chat template of --tokenizer
(default: the target's directory), thinking off.

Writes: a table on stdout; with --json OUT, the report to OUT (atomically) and a log beside it; with --plot
PNG, the acceptance curves and tau of every drafter (matplotlib); with --record FILE, the table (no
outputs) and the command under the key "measured_tau" (or --record-key, e.g. shipped_package.measured_tau
for architecture.json) of that JSON record, leaving its other keys as they are.
Exit status: 0; 2 for a user error; 1 when --check finds a committed token that differs from the
target's greedy output (each mismatch is logged with prompt index, position and both tokens).

    python -m evidence.measure.measure_tau --target SMALL/teacher --tokenizer SMALL/tokenizer \
        --mtbench SMALL/mtbench_question.jsonl --drafter model --drafter SMALL/student_init \
        --drafter WORK/student --drafter-without-lora model --hybrid 4 --baselines ngram assisted \
        --k 16 --max-new-tokens 128 --check --json OUT/tau.json --plot OUT/tau.png
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

import draft_model
from checkpoint import DTYPES
from evidence import common
from evidence.measure.spec_loop import (
    DraftFn,
    SpeculativeRun,
    assisted_generate,
    eos_token_ids,
    speculative_generate,
    target_greedy,
)
from evidence.packages import load_any_model
from evidence.prompts.mtbench_second_turns import answer_text
from evidence.prompts.prepare_prompts import encode, load_tokenizer

BASELINES = ("ngram", "assisted")
NGRAM_MAX = 3  # the n-gram baseline matches the last 1..3 tokens
SERVER_TIMEOUT_S = 60


# ----------------------------------------------------------------------------------------------- drafters


def server_drafter(
    client: httpx.Client, lookup_min_match: int | None = None, min_confidence: float | None = None
) -> DraftFn:
    """Drafts from a running draft server: POST /draft with the whole sequence, as the harness does.
    Options left None are not sent, so the server's own defaults apply (the server as deployed)."""
    options = {"lookup_min_match": lookup_min_match, "min_confidence": min_confidence}

    def draft(tokens: list[int], max_tokens: int) -> list[int]:
        body = {"token_ids": tokens, "max_tokens": max_tokens} | {k: v for k, v in options.items() if v is not None}
        try:
            response = client.post("/draft", json=body)
        except httpx.TransportError as error:
            raise common.UserError(f"draft server at {client.base_url} did not answer: {error}") from None
        if response.status_code != 200:
            raise common.UserError(f"draft server answered {response.status_code} to /draft: {response.text[:500]}")
        return response.json()["draft_token_ids"]

    return draft


def load_drafter(model_dir: Path, weights: str, use_lora: bool = True) -> draft_model.Drafter:
    try:  # one sequence at a time: its slot is reused
        return draft_model.load_model(model_dir, cache_slots=2, weights=weights, use_lora=use_lora)
    except draft_model.ModelLoadError as error:
        raise common.UserError(str(error)) from None


def in_process_drafter(drafter: draft_model.Drafter, lookup_min_match: int = 0, min_confidence: float = 0.0) -> DraftFn:
    """Drafts from a model loaded in this process with draft_model."""

    def draft(tokens: list[int], max_tokens: int) -> list[int]:
        made = draft_model.draft_batch(
            drafter, [tokens], max_tokens=max_tokens, lookup_min_match=lookup_min_match, min_confidence=min_confidence
        )
        return list(made[0])

    return draft


def ngram_drafter(tokens: list[int], max_tokens: int) -> list[int]:
    """Prompt lookup with no model: what followed the latest earlier occurrence of the last 3, 2 or 1 tokens."""
    return draft_model.prompt_lookup(tokens, max_tokens, min_match=1, max_match=NGRAM_MAX)


# ----------------------------------------------------------------------------------------------- report


def first_mismatch(committed: list[int], reference: list[int]) -> tuple[int, int | None, int | None] | None:
    """(position, committed token, reference token) where the two first differ, or None if equal."""
    for position in range(max(len(committed), len(reference))):
        ours = committed[position] if position < len(committed) else None
        theirs = reference[position] if position < len(reference) else None
        if ours != theirs:
            return position, ours, theirs
    return None


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """Nearest-rank percentile (values need not be sorted); None for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))] if ordered else None


def summarize(name: str, run: SpeculativeRun, greedy_tokens_per_s: float, mismatches: list[dict] | None) -> dict:
    """The report of one drafter; what a loop did not observe (transformers' own drafts) is None."""
    tokens_per_s = run.committed / run.total_seconds
    drafted = bool(run.drafted_per_call)
    return {
        "drafter": name,
        "tau": run.committed / run.verify_steps,
        "committed_tokens": run.committed,
        "verify_steps": run.verify_steps,
        "acceptance_by_position": [a / p for a, p in zip(run.accepted_at, run.proposed_at)],
        "mean_draft_tokens_per_call": statistics.fmean(run.drafted_per_call) if drafted else None,
        "draft_latency_ms": {
            "p50": 1000 * percentile(run.draft_seconds, 0.50),
            "p95": 1000 * percentile(run.draft_seconds, 0.95),
        }
        if drafted
        else None,
        "draft_seconds": sum(run.draft_seconds) if drafted else None,
        "verify_seconds": run.verify_seconds or None,  # transformers' loop verifies out of sight
        "tokens_per_s": tokens_per_s,
        "speedup_vs_target_greedy": tokens_per_s / greedy_tokens_per_s,
        "check": "not run" if mismatches is None else ("passed" if not mismatches else "FAILED"),
        "mismatches": mismatches or [],
    }


def cell(value: float | None, width: int, decimals: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{decimals}f}"


def print_table(report: dict) -> None:
    greedy = report["target_greedy"]
    print(
        f"target {report['target']}  k={report['k']}  max_new_tokens={report['max_new_tokens']}  prompts={report['prompts']}"
    )
    print(f"target-only greedy: {greedy['tokens']} tokens, {greedy['tokens_per_s']:.1f} tok/s")
    header = f"{'drafter':<40} {'tau':>6} {'draft/call':>10} {'p50 ms':>8} {'p95 ms':>8} {'verify s':>9} {'tok/s':>8} {'speedup':>8} {'check':>8}"
    print(header)
    print("-" * len(header))
    for run in report["runs"]:
        latency = run["draft_latency_ms"] or {"p50": None, "p95": None}
        print(
            f"{run['drafter'][-40:]:<40} {run['tau']:>6.3f} {cell(run['mean_draft_tokens_per_call'], 10, 2)} {cell(latency['p50'], 8, 2)} "
            f"{cell(latency['p95'], 8, 2)} {cell(run['verify_seconds'], 9, 2)} {run['tokens_per_s']:>8.1f} {run['speedup_vs_target_greedy']:>8.2f} {run['check']:>8}"
        )
    for run in report["runs"]:
        if run["acceptance_by_position"]:
            curve = " ".join(f"{p:.2f}" for p in run["acceptance_by_position"])
            print(f"P(position i accepted) {run['drafter']}: {curve}")


def plot(report: dict, path: Path) -> None:
    """Acceptance by draft position (left) and tau (right) of every drafter, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    figure, (curves, bars) = pyplot.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for run in report["runs"]:
        if run["acceptance_by_position"]:
            positions = range(1, len(run["acceptance_by_position"]) + 1)
            curves.plot(positions, run["acceptance_by_position"], marker="o", markersize=3, label=run["drafter"])
    curves.set(xlabel="draft position i", ylabel="P(drafts 1..i accepted)", ylim=(0, 1), title="Acceptance by position")
    curves.legend(fontsize=7)
    names = [
        f"{number}. {run['drafter'][-40:]}" for number, run in enumerate(report["runs"], 1)
    ]  # numbered: never two alike
    bars.barh(names, [run["tau"] for run in report["runs"]])
    bars.set(xlabel="tau (tokens per target forward)", title=f"tau, k={report['k']}, {report['prompts']} prompts")
    bars.tick_params(axis="y", labelsize=7)
    figure.tight_layout()
    with common.atomic_path(path) as staging:
        figure.savefig(staging, format="png", dpi=120)
    pyplot.close(figure)


def write_record(path: Path, report: dict, argv: list[str] | None, key: str = "measured_tau") -> None:
    """The report without per-prompt outputs, and the command, under `key` of a JSON record (dots nest)."""
    record = common.read_json(path, "record") if path.exists() else {}
    runs = [{key: value for key, value in run.items() if key != "outputs"} for run in report["runs"]]
    command = "python -m evidence.measure.measure_tau " + shlex.join(sys.argv[1:] if argv is None else argv)
    table = {name: value for name, value in report.items() if name != "runs"}
    common.set_dotted(record, key, {**table, "runs": runs, "command": command})
    common.atomic_write_json(path, record)


# ----------------------------------------------------------------------------------------------- inputs


def prompt_ids(row: dict, where: str, tokenizer_for) -> list[int]:
    """A row's token ids: `token_ids` / `prompt_ids` as given, or `messages` in the chat template."""
    if not isinstance(row, dict):
        raise common.UserError(
            f"{where}: expected a JSON object with `token_ids` or `messages`, found {type(row).__name__}"
        )
    if "messages" in row and "token_ids" not in row:
        messages = row["messages"]
        if not (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages)
        ):
            raise common.UserError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects")
        return encode(tokenizer_for(where), messages, enable_thinking=False)
    ids = row.get("token_ids", row.get("prompt_ids"))
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise common.UserError(
            f"{where}: expected a non-empty list of ints in `token_ids` (or `prompt_ids`), or chat `messages`"
        )
    return ids


def read_mtbench(path: Path, limit: int | None) -> list[list[str]]:
    """The user turns of each MT-bench question (FastChat's question.jsonl: question_id, category, turns)."""
    questions = []
    for line_number, row in enumerate(common.read_jsonl(path)[:limit], 1):
        turns = row.get("turns")
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise common.UserError(
                f"{path}:{line_number}: not an MT-bench question (expected `turns`, a list of strings)"
            )
        questions.append(turns)
    return questions


def check_vocabulary(prompts: list[list[int]], vocab_size: int, what: str) -> None:
    for index, ids in enumerate(prompts):
        if not all(0 <= i < vocab_size for i in ids):
            raise common.UserError(
                f"{what}, prompt {index}: token id {max(ids)} or {min(ids)} outside the target's vocabulary 0..{vocab_size - 1}"
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="target causal-LM directory (transformers)")
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="the target's tokenizer, for chat messages (default: --target)"
    )
    parser.add_argument("--server", help="draft server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--drafter",
        type=Path,
        action="append",
        default=[],
        help="model package or checkpoint directory, drafted in this process (repeatable)",
    )
    parser.add_argument(
        "--drafter-without-lora",
        type=Path,
        action="append",
        default=[],
        help="model package drafted without its LoRA adapter (repeatable)",
    )
    parser.add_argument(
        "--drafter-weights",
        choices=("auto", "packed", "dequant"),
        default="auto",
        help="draft_model weight path of the in-process drafters",
    )
    parser.add_argument(
        "--hybrid",
        type=int,
        default=None,
        metavar="N",
        help=f"also measure hybrid drafting with lookup_min_match N (1..{draft_model.LOOKUP_MAX_MATCH})",
    )
    parser.add_argument(
        "--min-confidence",
        type=float,
        nargs="*",
        default=[],
        metavar="P",
        help="also measure the first drafter with these min_confidence values",
    )
    parser.add_argument(
        "--baselines", nargs="*", choices=BASELINES, default=[], help="also measure these in the same run"
    )
    parser.add_argument(
        "--assistant", type=Path, default=None, help="assistant model for --baselines assisted (default: --drafter)"
    )
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompts", type=Path, help="jsonl with `token_ids` or chat `messages` per line")
    prompts.add_argument("--mtbench", type=Path, help="MT-bench question.jsonl (FastChat format)")
    parser.add_argument(
        "--turns",
        type=int,
        choices=(1, 2),
        default=1,
        help="MT-bench turns to measure (2: also the second, after the target's answer)",
    )
    parser.add_argument("--limit", type=int, default=None, help="use the first N prompts (questions)")
    parser.add_argument("--k", type=int, default=16, help="draft tokens per verify step (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to commit per prompt (default 128)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="target dtype on CPU (default float32)"
    )
    parser.add_argument("--check", action="store_true", help="committed output must equal the target's greedy output")
    parser.add_argument("--json", type=Path, default=None, help="write the report here (and a log beside it)")
    parser.add_argument("--plot", type=Path, default=None, help="write the acceptance curves and tau here (PNG)")
    parser.add_argument(
        "--record",
        type=Path,
        default=None,
        help='put the table under "measured_tau" in this JSON record (e.g. architecture.json)',
    )
    parser.add_argument(
        "--record-key",
        default="measured_tau",
        help="key for --record; dots nest it (architecture.json: shipped_package.measured_tau)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.server is None and not args.drafter and not args.drafter_without_lora and not args.baselines:
        parser.error("give a drafter (--server, --drafter or --drafter-without-lora) and/or --baselines")
    for name in ("k", "max_new_tokens", "limit", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise common.UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.hybrid is not None and not 1 <= args.hybrid <= draft_model.LOOKUP_MAX_MATCH:
        raise common.UserError(f"--hybrid must be in 1..{draft_model.LOOKUP_MAX_MATCH}, got {args.hybrid}")
    if (args.hybrid is not None or args.min_confidence) and args.server is None and not args.drafter:
        raise common.UserError("--hybrid and --min-confidence measure a model drafter: give --server or --drafter")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise common.UserError("--plot needs matplotlib: pip install -e '.[eval]'")
    if not all(0 < p <= 1 for p in args.min_confidence):
        raise common.UserError(f"--min-confidence values must be probabilities in (0, 1], got {args.min_confidence}")
    if "assisted" in args.baselines and args.assistant is None and not args.drafter:
        raise common.UserError(
            "--baselines assisted needs the assistant model: give --assistant DIR (or --drafter DIR)"
        )
    return args


def make_logger(json_path: Path | None) -> logging.Logger:
    if json_path is not None:
        return common.setup_logging(common.log_path_beside(json_path, "measure_tau"), "measure_tau")
    logger = logging.getLogger("evidence.measure.measure_tau")
    if not logger.handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return logger


# ----------------------------------------------------------------------------------------------- main


class Measurement:
    """One target, its prompts and its own greedy outputs (the reference for --check and for tokens/s)."""

    def __init__(self, args: argparse.Namespace, logger: logging.Logger):
        self.args, self.logger = args, logger
        self.target = load_any_model(args.target, "cpu", DTYPES[args.dtype])
        self.eos_ids = eos_token_ids(self.target)
        self.tokenizer = None
        self.prompts: list[list[int]] = []
        self.references: list[list[int]] = []
        self.greedy_seconds = 0.0

    def tokenizer_for(self, where: str):
        if self.tokenizer is None:
            source = self.args.tokenizer or self.args.target
            try:
                self.tokenizer = load_tokenizer(str(source), None)
            except common.UserError as error:
                raise common.UserError(
                    f"{where} holds chat messages, which need the target's tokenizer: {error}; give --tokenizer DIR"
                ) from None
        return self.tokenizer

    def add_prompts(self, prompts: list[list[int]], what: str) -> None:
        """Check prompts against the target and run the target alone on them."""
        check_vocabulary(prompts, self.target.config.vocab_size, what)
        self.logger.info("target-only greedy on %d prompts (%s)", len(prompts), what)
        started = time.perf_counter()
        self.references += [
            target_greedy(self.target, prompt, self.args.max_new_tokens, self.eos_ids)
            for prompt in tqdm(prompts, desc="target greedy", leave=False)
        ]
        self.greedy_seconds += time.perf_counter() - started
        self.prompts += prompts

    def load_prompts(self) -> None:
        args = self.args
        if args.prompts is not None:
            rows = common.read_jsonl(args.prompts)[: args.limit]
            if not rows:
                raise common.UserError(f"{args.prompts} holds no prompts")
            self.add_prompts(
                [prompt_ids(row, f"{args.prompts}:{i}", self.tokenizer_for) for i, row in enumerate(rows, 1)],
                str(args.prompts),
            )
            return
        questions = read_mtbench(args.mtbench, args.limit)
        if not questions:
            raise common.UserError(f"{args.mtbench} holds no questions")
        tokenizer = self.tokenizer_for(str(args.mtbench))
        first_turns = [[{"role": "user", "content": turns[0]}] for turns in questions]
        self.add_prompts(
            [encode(tokenizer, messages, enable_thinking=False) for messages in first_turns], "MT-bench turn 1"
        )
        if args.turns == 2:
            second_turns = [
                messages
                + [
                    {"role": "assistant", "content": answer_text(tokenizer, answer)},
                    {"role": "user", "content": turns[1]},
                ]
                for messages, answer, turns in zip(first_turns, self.references, questions)
                if len(turns) > 1
            ]
            self.add_prompts(
                [encode(tokenizer, messages, enable_thinking=False) for messages in second_turns], "MT-bench turn 2"
            )

    @property
    def greedy_tokens_per_s(self) -> float:
        return sum(map(len, self.references)) / self.greedy_seconds

    def finish(self, name: str, run: SpeculativeRun) -> dict:
        """The summary of one drafter's run, with the lossless check against the target's own outputs."""
        mismatches = None
        if self.args.check:
            mismatches = []
            for index, (committed, reference) in enumerate(zip(run.outputs, self.references)):
                found = first_mismatch(committed, reference)
                if found:
                    position, ours, theirs = found
                    self.logger.error(
                        "LOSSLESS CHECK FAILED (%s): prompt %d position %d: committed %s, target greedy %s",
                        name,
                        index,
                        position,
                        ours,
                        theirs,
                    )
                    mismatches.append(
                        {"prompt": index, "position": position, "committed": ours, "target_greedy": theirs}
                    )
        summary = summarize(name, run, self.greedy_tokens_per_s, mismatches)
        summary["outputs"] = run.outputs
        return summary

    def speculative(self, name: str, draft: DraftFn) -> dict:
        self.logger.info("measuring %s", name)
        run = SpeculativeRun()
        for prompt in tqdm(self.prompts, desc=name[-30:], leave=False):
            speculative_generate(self.target, draft, prompt, self.args.k, self.args.max_new_tokens, self.eos_ids, run)
        return self.finish(name, run)

    def assisted(self, assistant_dir: Path) -> dict:
        name = f"transformers assisted {assistant_dir}"
        self.logger.info("measuring %s", name)
        assistant = load_any_model(assistant_dir, "cpu", torch.float32)
        run = SpeculativeRun()
        for prompt in tqdm(self.prompts, desc="assisted", leave=False):
            assisted_generate(self.target, assistant, prompt, self.args.k, self.args.max_new_tokens, self.eos_ids, run)
        return self.finish(name, run)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logger = make_logger(args.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    measurement = Measurement(args, logger)
    measurement.load_prompts()

    drafters: list[tuple[str, DraftFn]] = []
    client = httpx.Client(base_url=args.server, timeout=SERVER_TIMEOUT_S) if args.server else None
    if client is not None:
        drafters.append((f"server {args.server}", server_drafter(client)))
        if args.hybrid is not None:
            drafters.append((f"server {args.server} hybrid>={args.hybrid}", server_drafter(client, args.hybrid)))
        drafters += [
            (f"server {args.server} min_confidence={p}", server_drafter(client, min_confidence=p))
            for p in args.min_confidence
        ]
    for number, model_dir in enumerate(args.drafter):
        drafter = load_drafter(model_dir, args.drafter_weights)
        label = f"model {model_dir} ({drafter.weights})"
        drafters.append((label, in_process_drafter(drafter)))
        if number == 0:
            if args.hybrid is not None:
                drafters.append((f"{label} hybrid>={args.hybrid}", in_process_drafter(drafter, args.hybrid)))
            drafters += [
                (f"{label} min_confidence={p}", in_process_drafter(drafter, min_confidence=p))
                for p in args.min_confidence
            ]
    for model_dir in args.drafter_without_lora:
        drafter = load_drafter(model_dir, args.drafter_weights, use_lora=False)
        drafters.append((f"model {model_dir} without LoRA ({drafter.weights})", in_process_drafter(drafter)))
    if "ngram" in args.baselines:
        drafters.append((f"ngram (prompt lookup, n<={NGRAM_MAX})", ngram_drafter))

    report = {
        "target": str(args.target),
        "dtype": args.dtype,
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(measurement.prompts),
        "prompt_source": str(args.prompts or args.mtbench) + (f" (turns 1..{args.turns})" if args.mtbench else ""),
        "target_greedy": {
            "tokens": sum(map(len, measurement.references)),
            "seconds": measurement.greedy_seconds,
            "tokens_per_s": measurement.greedy_tokens_per_s,
        },
        "runs": [],
    }
    try:
        report["runs"] += [measurement.speculative(name, draft) for name, draft in drafters]
    finally:
        if client is not None:
            client.close()
    if "assisted" in args.baselines:
        report["runs"].append(measurement.assisted(args.assistant or args.drafter[0]))

    print_table(report)
    if args.json is not None:
        common.atomic_write_text(args.json, json.dumps(report, indent=2) + "\n")
    if args.record is not None:
        write_record(args.record, report, argv, args.record_key)
    if args.plot is not None:
        plot(report, args.plot)
    if any(run["check"] == "FAILED" for run in report["runs"]):
        logger.error("the lossless check failed: see the mismatches above")
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    common.run_cli(main)
