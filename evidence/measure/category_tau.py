"""tau per prompt category for a model drafter, prompt lookup and hybrid drafting, replayed exactly offline.

With greedy verification every accepted draft token was conditioned on the target's own tokens, so a
draft-and-verify loop can be replayed from the target's greedy continuation alone (as tau.py does for a
model drafter): at each verify step the context is the prompt plus the continuation so far, the drafter
proposes up to k tokens, the accepted run is the number of leading proposals equal to the continuation,
and the step commits the run plus the bonus token. A model drafter's run is its consecutive teacher-
forced argmax matches (one forward pass per sequence); prompt lookup (measure_tau.py's n-gram baseline)
and hybrid drafting (prompt lookup when the context ends in a repeat of at least --hybrid tokens, else the
model; draft_model.draft_batch's rule) are replayed from the context itself. The counts
equal measure_tau.py's live harness on the same continuations (tests/test_measure_tau.py). A last column,
"best of", takes at each step whichever of the model's draft and lookup's the continuation accepts further:
an oracle no drafter can run, printed as the ceiling of every rule that chooses between the two.

Reads: DATA (gen_data.py shards of the measurement prompts, e.g. MT-bench with --holdout-fraction 1 and
--max-new-tokens 64), PROMPTS (their prompts.jsonl, whose "category" field groups them), the drafter (a
model package, INT4 dequantized and LoRA merged, or a Hugging Face directory). Writes a markdown table on
stdout and, with --json, the figures (atomically).

    python -m evidence.measure.category_tau --data WORK/eval64 --prompts SMALL/mtbench_prompts.jsonl \
        --drafter model --k 16 --hybrid 2 --json OUT/category_tau.json
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

import draft_model
from evidence import common
from evidence.measure.measure_tau import ngram_drafter
from evidence.measure.tau import teacher_forced_argmax
from evidence.packages import load_any_model
from evidence.teacher.gen_data import load_examples

# A proposer: (context, position in the continuation, most tokens) -> the proposed tokens.
Proposer = Callable[[list[int], int, int], list[int]]


def replay(prompt: list[int], continuation: list[int], k: int, propose: Proposer) -> tuple[int, int]:
    """(committed tokens, verify steps) of a greedy draft-and-verify loop over one continuation."""
    position = steps = 0
    while position < len(continuation):
        run = accepted_run(propose(prompt + continuation[:position], position, k)[:k], continuation, position)
        position += min(run + 1, len(continuation) - position)  # accepted drafts + the bonus, up to the end
        steps += 1
    return len(continuation), steps


def model_proposer(matches: list[bool], continuation: list[int]) -> Proposer:
    """The model's greedy draft from position p agrees with the continuation exactly as far as its
    teacher-forced argmaxes do; past the first miss the tokens are never compared, so any stand-in will do."""

    def propose(context: list[int], position: int, most: int) -> list[int]:
        agreed = []
        for offset in range(most):
            if position + offset >= len(continuation) or not matches[position + offset]:
                return agreed + [-1]  # a token that matches nothing
            agreed.append(continuation[position + offset])
        return agreed

    return propose


def ngram_proposer(context: list[int], position: int, most: int) -> list[int]:
    """measure_tau.py's n-gram baseline, as a proposer."""
    return ngram_drafter(context, most)


def hybrid_proposer(model: Proposer, min_match: int) -> Proposer:
    def propose(context: list[int], position: int, most: int) -> list[int]:
        copied = draft_model.prompt_lookup(context, most, min_match=min_match)
        return copied if copied else model(context, position, most)

    return propose


def accepted_run(proposal: list[int], continuation: list[int], position: int) -> int:
    """How many leading tokens of `proposal` the continuation accepts at `position`."""
    run = 0
    while run < len(proposal) and position + run < len(continuation) and proposal[run] == continuation[position + run]:
        run += 1
    return run


def best_of_proposer(model: Proposer, continuation: list[int]) -> Proposer:
    """At each step whichever of the model's draft and prompt lookup's the continuation accepts further (the
    model's on a tie): an oracle, so the ceiling of every rule that picks one of the two per step. Lookup at its
    most permissive, a repeat of one token: it then proposes whenever it would at any minimum match, and the
    same tokens (the longest match wins)."""

    def propose(context: list[int], position: int, most: int) -> list[int]:
        drafted = model(context, position, most)
        copied = draft_model.prompt_lookup(context, most, min_match=1)
        copied_run = accepted_run(copied[:most], continuation, position)
        return copied if copied_run > accepted_run(drafted[:most], continuation, position) else drafted

    return propose


def category_table(examples: list[dict], categories: dict[str, str], predictions: list, k: int, hybrid: int) -> dict:
    """{category: {drafter: {"committed", "steps", "tau"}}}, plus "all"."""
    counts: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for example, argmax in zip(examples, predictions):
        prompt, continuation = example["prompt_ids"].tolist(), example["tokens"].tolist()
        model = model_proposer((argmax == example["tokens"]).tolist(), continuation)
        proposers = {
            "model": model,
            "prompt_lookup": ngram_proposer,
            "hybrid": hybrid_proposer(model, hybrid),
            "best_of": best_of_proposer(model, continuation),
        }
        for name, propose in proposers.items():
            committed, steps = replay(prompt, continuation, k, propose)
            for group in (categories[example["id"]], "all"):
                counts[group][name][0] += committed
                counts[group][name][1] += steps
    return {
        group: {name: {"committed": c, "steps": s, "tau": c / s} for name, (c, s) in by_drafter.items()}
        for group, by_drafter in sorted(counts.items(), key=lambda item: (item[0] == "all", item[0]))
    }


def markdown(table: dict) -> str:
    lines = [
        "| category | model | prompt lookup | hybrid | best of model and lookup per step | model >= lookup |",
        "|---|---|---|---|---|---|",
    ]
    for group, row in table.items():
        model, lookup, hybrid, best = (row[name]["tau"] for name in ("model", "prompt_lookup", "hybrid", "best_of"))
        better = "yes" if model >= lookup else "no"
        lines.append(f"| {group} | {model:.3f} | {lookup:.3f} | {hybrid:.3f} | {best:.3f} | {better} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="gen_data.py shards of the measurement prompts")
    parser.add_argument("--prompts", type=Path, required=True, help="their prompts.jsonl, with a category field")
    parser.add_argument("--drafter", type=Path, required=True, help="model package or Hugging Face directory")
    parser.add_argument("--k", type=int, default=16, help="draft tokens per verify step")
    parser.add_argument("--hybrid", type=int, default=2, help="prompt lookup's minimum match in hybrid drafting")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.k < 1 or not 1 <= args.hybrid <= draft_model.LOOKUP_MAX_MATCH:
        raise common.UserError(f"--k must be >= 1 and --hybrid in 1..{draft_model.LOOKUP_MAX_MATCH}")
    examples = load_examples(args.data, "all")
    categories = {row["id"]: row.get("category", "uncategorised") for row in common.read_jsonl(args.prompts)}
    missing = [e["id"] for e in examples if e["id"] not in categories]
    if missing:
        raise common.UserError(f"{len(missing)} sequence(s) of --data are not in --prompts (first: {missing[0]})")
    model = load_any_model(args.drafter, "cpu", torch.float32)
    predictions = teacher_forced_argmax(model, examples, args.batch_size)
    table = category_table(examples, categories, predictions, args.k, args.hybrid)
    print(markdown(table))
    report = {"k": args.k, "hybrid_min_match": args.hybrid, "sequences": len(examples), "table": table}
    if args.json:
        common.atomic_write_json(args.json, report)
    return report


if __name__ == "__main__":
    common.run_cli(main)
