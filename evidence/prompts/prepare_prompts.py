"""Prompts for the teacher: the user turn(s) of every declared training row, in the target's chat template.

For each source named in the data manifest (train splits only, verified against the recorded sha256),
takes the conversation up to its first user turn (a system turn before it is kept; ShareGPT-style chats
give one prompt per human turn, with the conversation before it), applies the target
tokenizer's chat template with the generation prompt (Qwen3: thinking off unless --enable-thinking; the
choice is recorded), drops empty prompts, exact duplicates (same token ids) and prompts longer than
--max-prompt-tokens, optionally keeps at most --max-per-source per source (chosen by hash of the row id),
and writes OUT (`prompts.jsonl`: id, source, messages, token_ids), OUT.prepare_prompts.json (tokenizer,
template settings, counts per source, pins) and the log OUT.prepare_prompts.log.

Files come from a local mirror laid out as MIRROR/<repo>/<path in repo> (--mirror), or from the hub at
the pinned commit (--cache-dir). A source that is not locked is refused; with --lock (and hub access)
it is resolved and its commit, files, sha256 and rows are written into the manifest first.

    python -m evidence.prompts.prepare_prompts --manifest data_manifest.json --tokenizer Qwen/Qwen3-8B \
        --tokenizer-revision COMMIT --sources no_robots gsm8k tulu_code tulu_if \
        --cache-dir ~/.cache/evidence --max-prompt-tokens 1024 --out WORK/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
from tqdm import tqdm
from transformers import AutoTokenizer

from evidence import common

DEFAULT_SOURCES = ("no_robots", "gsm8k", "tulu_code", "tulu_if")


def first_user_turn(messages: list[dict]) -> list[dict]:
    """The messages up to and including the first user turn (a leading system turn is kept)."""
    kept = []
    for message in messages:
        role = message.get("role")
        if role == "system" and not kept:
            kept.append({"role": "system", "content": message["content"]})
        elif role == "user":
            return kept + [{"role": "user", "content": message["content"]}]
    return []


def user_message(text: str | None) -> list[dict]:
    return [{"role": "user", "content": text}] if text else []


# Each reader yields (row id within the source, messages, extra fields) for one file of a source format.


def read_no_robots(table: dict[str, list]) -> Iterator[tuple[str, list[dict], dict]]:
    for prompt_id, messages in zip(table["prompt_id"], table["messages"]):
        yield prompt_id, first_user_turn(messages), {}


def read_gsm8k(table: dict[str, list]) -> Iterator[tuple[str, list[dict], dict]]:
    for row, question in enumerate(table["question"]):
        yield str(row), user_message(question), {}


def read_tulu(table: dict[str, list]) -> Iterator[tuple[str, list[dict], dict]]:
    for row_id, messages in zip(table["id"], table["messages"]):
        yield row_id, first_user_turn(messages), {}


def read_aya(table: dict[str, list]) -> Iterator[tuple[str, list[dict], dict]]:
    for row, (text, language) in enumerate(zip(table["inputs"], table["language"])):
        yield str(row), user_message(text), {"language": language}


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def read_sharegpt(chats: list[dict]) -> Iterator[tuple[str, list[dict], dict]]:
    """One prompt per human turn: the conversation up to it (earlier assistant turns as written in the
    chat). These small chats repeat their first turns, so later turns are where the variety is."""
    for chat in chats:
        messages = [{"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]} for turn in chat["conversations"]]
        for turn, message in enumerate(messages):
            if message["role"] == "user":
                yield f"{chat['id']}:{turn}", messages[: turn + 1], {}


FORMATS = {  # format -> (columns a parquet file must have, reader)
    "no_robots": (("prompt", "prompt_id", "messages", "category"), read_no_robots),
    "gsm8k": (("question", "answer"), read_gsm8k),
    "tulu": (("id", "prompt", "messages"), read_tulu),
    "aya": (("inputs", "targets", "language", "language_code", "annotation_type", "user_id"), read_aya),
    "sharegpt": ((), read_sharegpt),
}


def read_source(name: str, entry: dict, paths: list[Path]) -> Iterator[tuple[str, list[dict], dict]]:
    """(prompt id, messages, extra) for every row of a verified source, in file order."""
    if entry.get("format") not in FORMATS:
        raise common.UserError(f"dataset '{name}' has format {entry.get('format')!r}; known formats: {sorted(FORMATS)}")
    columns, reader = FORMATS[entry["format"]]
    for file_number, path in enumerate(paths):
        if entry["format"] == "sharegpt":
            rows = reader(json.loads(path.read_text()))
        else:
            table = pq.read_table(path)
            missing = [c for c in columns if c not in table.column_names]
            if missing:
                raise common.UserError(
                    f"dataset '{name}': {path} lacks column(s) {missing}; it has {table.column_names}"
                )
            rows = reader(table.select(list(columns)).to_pydict())
        for row_id, messages, extra in rows:
            prefix = f"{name}:" if len(paths) == 1 else f"{name}:{file_number}:"
            yield prefix + str(row_id), messages, extra


def load_tokenizer(name: str, revision: str | None):

    source, revision = common.resolve_model(name, revision)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision)
    except (OSError, ValueError) as error:
        raise common.UserError(f"cannot load tokenizer {name!r}: {error}") from None
    if not tokenizer.chat_template:
        raise common.UserError(f"tokenizer {name!r} has no chat template; the target's own tokenizer is needed")
    return tokenizer


def encode(tokenizer, messages: list[dict], enable_thinking: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class PromptCollector:
    """Encodes candidate prompts, dropping empty, duplicate and over-long ones, and counts why."""

    def __init__(
        self, tokenizer, enable_thinking: bool, max_prompt_tokens: int, seen: set[tuple[int, ...]] | None = None
    ):
        self.tokenizer, self.enable_thinking, self.max_prompt_tokens = tokenizer, enable_thinking, max_prompt_tokens
        self.seen = seen if seen is not None else set()
        self.counts: dict[str, Counter] = {}

    def add(self, source: str, prompt_id: str, messages: list[dict]) -> dict | None:
        counts = self.counts.setdefault(source, Counter())
        counts["rows"] += 1
        if not messages or not messages[-1]["content"].strip():
            counts["empty"] += 1
            return None
        token_ids = encode(self.tokenizer, messages, self.enable_thinking)
        if len(token_ids) > self.max_prompt_tokens:
            counts["too_long"] += 1
            return None
        if tuple(token_ids) in self.seen:
            counts["duplicate"] += 1
            return None
        self.seen.add(tuple(token_ids))
        counts["kept"] += 1
        return {"id": prompt_id, "source": source, "messages": messages, "token_ids": token_ids}


def subsample(rows: list[dict], limit: int | None) -> list[dict]:
    """At most `limit` rows, chosen by hash of their id (deterministic, independent of file order)."""
    if limit is None or len(rows) <= limit:
        return rows
    chosen = {row["id"] for row in sorted(rows, key=lambda r: common.stable_hash_fraction(r["id"]))[:limit]}
    return [row for row in rows if row["id"] in chosen]


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared with add_aya.py: manifest, file location, tokenizer and template."""
    parser.add_argument(
        "--manifest",
        type=Path,
        default=common.REPO_ROOT / "data_manifest.json",
        help="data manifest (default: the repo's)",
    )
    parser.add_argument(
        "--mirror", type=Path, default=None, help="local mirror of hub datasets: MIRROR/<repo>/<path in repo>"
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="download cache for hub files and PyPI/npm artifacts"
    )
    parser.add_argument(
        "--lock", action="store_true", help="resolve unlocked sources on the hub and record their pins in the manifest"
    )
    add_template_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="prompts.jsonl to write")


def add_template_arguments(parser: argparse.ArgumentParser) -> None:
    """The tokenizer and chat-template flags of every script that templates prompts (PromptCollector's settings)."""
    parser.add_argument("--tokenizer", required=True, help="the target's tokenizer: directory or hub id")
    parser.add_argument("--tokenizer-revision", default=None)
    parser.add_argument(
        "--enable-thinking",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Qwen3 chat template thinking mode (default off)",
    )
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)


def source_paths(args: argparse.Namespace, name: str, logger) -> tuple[dict, list[Path]]:
    manifest = common.load_manifest(args.manifest)
    entry = common.dataset_entry(manifest, name)
    if entry.get("kind") == "artifact":
        common.check_train_split(name, entry)
        if args.cache_dir is None:
            raise common.UserError(f"dataset '{name}' comes from artifact '{entry['artifact']}'; give --cache-dir")
        extracted = common.fetch_artifact(args.manifest, entry["artifact"], args.cache_dir, logger)
        return entry, [extracted[entry["member"]]]
    if args.mirror is None and args.cache_dir is None:
        raise common.UserError(f"dataset '{name}': give --mirror (a local copy) or --cache-dir (fetch from the hub)")
    paths = common.dataset_files(
        args.manifest, name, mirror=args.mirror, cache_dir=args.cache_dir, lock=args.lock, logger=logger
    )
    return common.dataset_entry(common.load_manifest(args.manifest), name), paths


def pins(manifest_path: Path, names: list[str]) -> dict:
    manifest = common.load_manifest(manifest_path)
    return {
        name: {
            key: manifest["datasets"][name].get(key)
            for key in ("repo", "revision", "split", "files", "artifact", "member")
        }
        for name in names
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_source_arguments(parser)
    parser.add_argument("--sources", nargs="+", default=list(DEFAULT_SOURCES), help="dataset names in the manifest")
    parser.add_argument(
        "--max-per-source", type=int, default=None, help="keep at most N prompts per source (by id hash)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.max_prompt_tokens < 1:
        raise common.UserError(f"--max-prompt-tokens must be at least 1, got {args.max_prompt_tokens}")
    logger = common.setup_logging(common.log_path_beside(args.out, "prepare_prompts"), "prepare_prompts")
    logger.info(
        "command: python -m evidence.prompts.prepare_prompts %s", " ".join(sys.argv[1:] if argv is None else argv)
    )
    tokenizer = load_tokenizer(args.tokenizer, args.tokenizer_revision)
    collector = PromptCollector(tokenizer, args.enable_thinking, args.max_prompt_tokens)
    prompts = []
    for name in args.sources:
        entry, paths = source_paths(args, name, logger)
        kept = [
            row
            for prompt_id, messages, _ in tqdm(read_source(name, entry, paths), desc=name, unit="row")
            if (row := collector.add(name, prompt_id, messages)) is not None
        ]
        prompts += subsample(kept, args.max_per_source)
        logger.info("%s: %s, written %d", name, dict(collector.counts[name]), len(subsample(kept, args.max_per_source)))
    if not prompts:
        raise common.UserError("no prompt survived the filters; check --sources and --max-prompt-tokens")
    common.write_jsonl(args.out, prompts)
    summary = {
        "tokenizer": args.tokenizer,
        "tokenizer_revision": args.tokenizer_revision,
        "enable_thinking": args.enable_thinking,
        "max_prompt_tokens": args.max_prompt_tokens,
        "max_per_source": args.max_per_source,
        "counts": {name: dict(counts) for name, counts in collector.counts.items()},
        "written": dict(Counter(row["source"] for row in prompts)),
        "sources": pins(args.manifest, args.sources),
    }
    common.atomic_write_json(common.log_path_beside(args.out, "prepare_prompts").with_suffix(".json"), summary)
    logger.info("wrote %d prompts to %s", len(prompts), args.out)
    return summary


if __name__ == "__main__":
    common.run_cli(main)
