"""Add multilingual prompts from CohereForAI/aya_dataset (train split) to a prompts file.

Reads PROMPTS (prepare_prompts.py output) and the aya parquet files named in the data manifest (verified
by sha256); encodes each `inputs` text as one user turn with the target's chat template (same settings
as prepare_prompts.py), drops empty, duplicate (also against PROMPTS) and over-long ones, keeps at most
--per-language-cap prompts per language (chosen by hash of the row id), and writes OUT = PROMPTS + the aya
prompts (same format), OUT.add_aya.json (counts per language) and the log OUT.add_aya.log.

    python -m evidence.prompts.add_aya --prompts WORK/prompts_base.jsonl --tokenizer Qwen/Qwen3-8B \
        --tokenizer-revision COMMIT --cache-dir ~/.cache/evidence --per-language-cap 300 \
        --out WORK/prompts.jsonl
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

from tqdm import tqdm

from evidence import common
from evidence.prompts.prepare_prompts import (
    PromptCollector,
    add_source_arguments,
    load_tokenizer,
    pins,
    read_source,
    source_paths,
    subsample,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, required=True, help="prompts.jsonl to extend")
    add_source_arguments(parser)
    parser.add_argument("--source", default="aya", help="the aya dataset's name in the manifest")
    parser.add_argument("--per-language-cap", type=int, default=300, help="at most N prompts per language")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.per_language_cap < 1 or args.max_prompt_tokens < 1:
        raise common.UserError(
            f"--per-language-cap and --max-prompt-tokens must be at least 1, got {args.per_language_cap} and {args.max_prompt_tokens}"
        )
    logger = common.setup_logging(common.log_path_beside(args.out, "add_aya"), "add_aya")
    logger.info("command: python -m evidence.prompts.add_aya %s", " ".join(sys.argv[1:] if argv is None else argv))
    existing = common.read_jsonl(args.prompts)
    tokenizer = load_tokenizer(args.tokenizer, args.tokenizer_revision)
    collector = PromptCollector(
        tokenizer, args.enable_thinking, args.max_prompt_tokens, seen={tuple(row["token_ids"]) for row in existing}
    )
    entry, paths = source_paths(args, args.source, logger)
    if entry.get("format") != "aya":
        raise common.UserError(
            f"dataset '{args.source}' has format {entry.get('format')!r}; add_aya.py reads format 'aya'"
        )
    by_language: dict[str, list[dict]] = defaultdict(list)
    for prompt_id, messages, extra in tqdm(read_source(args.source, entry, paths), desc=args.source, unit="row"):
        row = collector.add(args.source, prompt_id, messages)
        if row is not None:
            by_language[extra["language"]].append({**row, "language": extra["language"]})
    chosen_ids = {row["id"] for rows in by_language.values() for row in subsample(rows, args.per_language_cap)}
    added = [row for rows in by_language.values() for row in rows if row["id"] in chosen_ids]
    added.sort(key=lambda row: (row["language"], common.stable_hash_fraction(row["id"])))
    common.write_jsonl(args.out, existing + added)
    summary = {
        "per_language_cap": args.per_language_cap,
        "enable_thinking": args.enable_thinking,
        "counts": dict(collector.counts.get(args.source, {})),
        "added": len(added),
        "added_per_language": dict(sorted(Counter(row["language"] for row in added).items())),
        "total": len(existing) + len(added),
        "sources": pins(args.manifest, [args.source]),
    }
    common.atomic_write_json(common.log_path_beside(args.out, "add_aya").with_suffix(".json"), summary)
    logger.info(
        "added %d aya prompts in %d languages; %d prompts in all", len(added), len(by_language), summary["total"]
    )
    return summary


if __name__ == "__main__":
    common.run_cli(main)
