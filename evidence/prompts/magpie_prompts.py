"""Prompts the teacher writes itself (Magpie): sample a user turn after the chat template's user prefix,
then keep it as a one-turn prompt for gen_data.py to answer greedily.

The user prefix is the chat template applied to one user message, cut where the message would start
(for SmolLM2: the default system turn then "<|im_start|>user\\n"). From it the teacher samples at
--temperature (plain sampling, no top-k or top-p) until the end of its turn. A sample is dropped when it
never ends its turn within --max-user-tokens, is empty or shorter than --min-words words, repeats an
earlier prompt (same text up to case, spacing and punctuation, also against --prompts and the
measurement-only prompts of --exclude, which must never be trained on) or is longer than
--max-prompt-tokens once templated.

With --categories FILE (a JSON object: category -> {"system": text, "openers": [text, ...]}) the rounds
are steered by category, in turn: round r uses category r mod C, whose system message replaces the
template's default one in the prefix, and one of its openers, which begins the user turn (the sample
continues it). The kept prompt is the opener plus the sample, as a plain user turn under the template's
default system message (the steering system message is not kept), tagged with its "category".

Rounds of --batch-size samples are drawn with the seed (--seed, round number), so a run is reproducible
and resumable: every finished round is appended to OUT.magpie_prompts.rounds.jsonl, and a rerun with the same
settings continues after the last one. Rounds continue until --count prompts are kept (or --max-rounds).

Writes OUT = PROMPTS + the new prompts (id "magpie:ROUND:ROW", source "magpie"), OUT.magpie_prompts.json
(settings, seed, counts of what was dropped and why) and the log OUT.magpie_prompts.log.

    python -m evidence.prompts.magpie_prompts --prompts WORK/prompts_base.jsonl --teacher TEACHER_DIR \
        --tokenizer TOKENIZER_DIR --count 3000 --seed 0 --out WORK/prompts.jsonl \
        [--categories evidence/configs/magpie_categories.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from evidence import common
from evidence.prompts.prepare_prompts import PromptCollector, add_template_arguments, load_tokenizer

SOURCE = "magpie"
SENTINEL = "\x00MAGPIE_USER_TURN\x00"


def user_prefix_ids(tokenizer, enable_thinking: bool, system: str | None = None, opener: str = "") -> list[int]:
    """Token ids of the chat template up to where a user message's text begins (after `system` as the
    system message when given), followed by `opener`, the start of the user's text."""
    messages = [{"role": "system", "content": system}] if system else []
    text = tokenizer.apply_chat_template(
        messages + [{"role": "user", "content": SENTINEL}], tokenize=False, enable_thinking=enable_thinking
    )
    if SENTINEL not in text:
        raise common.UserError(
            "the tokenizer's chat template does not place the user message verbatim; Magpie needs it to"
        )
    return tokenizer(text[: text.index(SENTINEL)] + opener, add_special_tokens=False)["input_ids"]


def read_categories(path: Path | None) -> dict[str, dict]:
    """The --categories file, checked: category -> {"system": text, "openers": [text, ...]}."""
    if path is None:
        return {}
    categories = common.read_json(path, "Magpie categories")
    if not isinstance(categories, dict) or not categories:
        raise common.UserError(f"{path}: expected a non-empty JSON object of categories")
    for name, spec in categories.items():
        ok = isinstance(spec, dict) and isinstance(spec.get("system"), str) and spec["system"].strip()
        openers = spec.get("openers") if isinstance(spec, dict) else None
        if not ok or not isinstance(openers, list) or not openers or not all(isinstance(o, str) for o in openers):
            raise common.UserError(
                f'{path}: category {name!r} needs "system" (text) and "openers" (a non-empty list of texts)'
            )
    return categories


def round_steering(categories: dict[str, dict], round_index: int) -> tuple[str | None, str | None, str]:
    """(category, system message, opener) of a round: categories in turn, then each category's openers in
    turn, so every category gets the same number of rounds and the choice needs no random state."""
    if not categories:
        return None, None, ""
    names = list(categories)
    name = names[round_index % len(names)]
    openers = categories[name]["openers"]
    return name, categories[name]["system"], openers[(round_index // len(names)) % len(openers)]


def normalized(text: str) -> str:
    """The text compared for duplicates: lower case, letters and digits only, single spaces."""
    return " ".join(re.sub(r"[^\w]+", " ", text.lower()).split())


def user_text(row: dict) -> str:
    return next((m["content"] for m in reversed(row.get("messages", [])) if m["role"] == "user"), "")


@torch.no_grad()
def sample_round(
    model, prefix: list[int], args: argparse.Namespace, end_ids: list[int], round_index: int
) -> list[list[int] | None]:
    """--batch-size sampled user turns (their token ids without the end-of-turn token), None where the
    turn did not end within --max-user-tokens."""
    torch.manual_seed(args.seed * 1_000_003 + round_index)
    input_ids = torch.tensor([prefix] * args.batch_size)  # [B, P]: the same prefix, so no padding
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=True,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=args.max_user_tokens,
        eos_token_id=end_ids,
        pad_token_id=end_ids[0],
    )
    samples = []
    for row in output[:, len(prefix) :].tolist():
        ends = [position for position, token in enumerate(row) if token in end_ids]
        samples.append(row[: ends[0]] if ends else None)
    return samples


def read_rounds(path: Path, settings: dict) -> list[dict]:
    """Finished rounds of an earlier run with the same settings (a torn last line is ignored)."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    if not lines or json.loads(lines[0]) != {"settings": settings}:
        raise common.UserError(f"{path} was made with other settings; delete it or use another --out")
    rounds = []
    for line in lines[1:]:
        try:
            rounds.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rounds


class MagpieFilter:
    """Turns sampled token ids into prompt rows, dropping what is not a usable, new user turn."""

    def __init__(self, tokenizer, args: argparse.Namespace, existing: list[dict], excluded: list[dict]):
        self.tokenizer, self.min_words = tokenizer, args.min_words
        self.collector = PromptCollector(
            tokenizer, args.enable_thinking, args.max_prompt_tokens, seen={tuple(r["token_ids"]) for r in existing}
        )
        self.seen_texts = {normalized(user_text(row)) for row in existing + excluded}
        self.dropped = Counter()

    def add(
        self, prompt_id: str, sample: list[int] | None, opener: str = "", category: str | None = None
    ) -> dict | None:
        if sample is None:
            self.dropped["no_end_of_turn"] += 1
            return None
        text = (opener + self.tokenizer.decode(sample, skip_special_tokens=False)).strip()
        if len(text.split()) < self.min_words:
            self.dropped["too_short"] += 1
            return None
        if any(token in text for token in self.tokenizer.all_special_tokens):
            self.dropped["special_tokens"] += 1
            return None
        if normalized(text) in self.seen_texts:
            self.dropped["duplicate_text"] += 1
            return None
        self.seen_texts.add(normalized(text))
        row = self.collector.add(SOURCE, prompt_id, [{"role": "user", "content": text}])
        if row is not None and category is not None:
            row["category"] = category
        return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, required=True, help="prompts.jsonl to extend")
    parser.add_argument(
        "--exclude", type=Path, nargs="*", default=[], help="prompts.jsonl files never to add to (e.g. MT-bench)"
    )
    parser.add_argument("--teacher", required=True, help="the target model: directory or hub id")
    parser.add_argument("--teacher-revision", default=None)
    add_template_arguments(parser)
    parser.add_argument(
        "--categories", type=Path, default=None, help="JSON: category -> system message and openers (steered rounds)"
    )
    parser.add_argument("--count", type=int, required=True, help="prompts to add")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=64, help="samples per round")
    parser.add_argument("--max-user-tokens", type=int, default=96, help="a user turn longer than this is dropped")
    parser.add_argument("--min-words", type=int, default=3)
    parser.add_argument(
        "--max-rounds", type=int, default=None, help="stop after this many rounds (default: 4 x count / batch size)"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--out", type=Path, required=True, help="prompts.jsonl to write")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    for flag in ("count", "batch_size", "max_user_tokens", "max_prompt_tokens", "min_words", "max_rounds"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise common.UserError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if not args.temperature > 0:
        raise common.UserError(f"--temperature must be positive (Magpie samples), got {args.temperature}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    check_args(args)
    logger = common.setup_logging(common.log_path_beside(args.out, "magpie_prompts"), "magpie_prompts")
    logger.info(
        "command: python -m evidence.prompts.magpie_prompts %s", " ".join(sys.argv[1:] if argv is None else argv)
    )
    existing = common.read_jsonl(args.prompts)
    tokenizer = load_tokenizer(args.tokenizer, args.tokenizer_revision)
    teacher, revision = common.resolve_model(args.teacher, args.teacher_revision)
    prefix = user_prefix_ids(tokenizer, args.enable_thinking)
    turn_ends = [t for t in ("<|im_end|>", "<|eot_id|>") if t in tokenizer.get_vocab()]  # ChatML, Llama 3
    end_ids = sorted(
        {
            *tokenizer.convert_tokens_to_ids(turn_ends),
            *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []),
        }
    )
    if not end_ids:
        raise common.UserError(
            "the tokenizer names no end-of-turn token (eos, <|im_end|> or <|eot_id|>): Magpie cannot tell where a user turn ends"
        )
    settings = {
        "teacher": args.teacher,
        "teacher_revision": revision,
        "prefix": prefix,
        "end_ids": end_ids,
        "seed": args.seed,
        "temperature": args.temperature,
        "batch_size": args.batch_size,
        "max_user_tokens": args.max_user_tokens,
        "dtype": args.dtype,
    }
    categories = read_categories(args.categories)
    if categories:  # recorded whole, so a resumed run refuses rounds steered differently
        settings["categories"] = categories
    rounds_path = common.log_path_beside(args.out, "magpie_prompts").with_suffix(".rounds.jsonl")
    rounds = read_rounds(rounds_path, settings)
    # Rewritten without a torn last line, so the rounds appended below start on a line of their own.
    common.atomic_write_text(
        rounds_path, "".join(json.dumps(line) + "\n" for line in [{"settings": settings}, *rounds])
    )
    logger.info("user prefix %r; %d finished round(s) found", tokenizer.decode(prefix), len(rounds))

    keep = MagpieFilter(tokenizer, args, existing, [row for path in args.exclude for row in common.read_jsonl(path)])

    def keep_round(round_index: int, samples: list) -> list[dict]:
        category, _, opener = round_steering(categories, round_index)
        rows = (keep.add(f"{SOURCE}:{round_index}:{i}", s, opener, category) for i, s in enumerate(samples))
        return [row for row in rows if row is not None]

    added = [row for r in rounds for row in keep_round(r["round"], r["samples"])]
    max_rounds = args.max_rounds or -(-4 * args.count // args.batch_size)
    model = None
    progress = tqdm(total=args.count, initial=min(len(added), args.count), desc="magpie prompts", unit="prompt")
    with rounds_path.open("a") as log:
        for round_index in range(len(rounds), max_rounds):
            if len(added) >= args.count:
                break
            if model is None:
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(
                    teacher, revision=revision, dtype=getattr(torch, args.dtype)
                ).eval()
            _, system, opener = round_steering(categories, round_index)
            steered = user_prefix_ids(tokenizer, args.enable_thinking, system, opener) if categories else prefix
            samples = sample_round(model, steered, args, end_ids, round_index)
            log.write(json.dumps({"round": round_index, "samples": samples}) + "\n")
            log.flush()
            before = len(added)
            added += keep_round(round_index, samples)
            progress.update(min(len(added), args.count) - min(before, args.count))
    progress.close()
    added = added[: args.count]
    if len(added) < args.count:
        logger.warning(
            "only %d of %d prompts after %d rounds (dropped: %s)",
            len(added),
            args.count,
            max_rounds,
            dict(keep.dropped),
        )
    common.write_jsonl(args.out, existing + added)
    summary = {
        "settings": settings,
        "count": args.count,
        "added": len(added),
        "total": len(existing) + len(added),
        "per_category": dict(Counter(row.get("category") for row in added if row.get("category"))),
        "dropped": dict(keep.dropped)
        | {k: v for k, v in keep.collector.counts.get(SOURCE, {}).items() if k in ("too_long", "duplicate")},
    }
    common.atomic_write_json(common.log_path_beside(args.out, "magpie_prompts").with_suffix(".json"), summary)
    logger.info(
        "added %d Magpie prompts; %d prompts in all; dropped %s", len(added), summary["total"], summary["dropped"]
    )
    return summary


if __name__ == "__main__":
    common.run_cli(main)
