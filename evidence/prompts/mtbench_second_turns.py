"""MT-bench second turns as a measurement set: the first turn, the teacher's answer to it and the second turn.

Reads PROMPTS (the first turns: smollm2_models.py's mtbench_prompts.jsonl, with id "mtbench:<question_id>",
category, messages and token_ids), QUESTIONS (MT-bench's question.jsonl, which holds each second turn),
ANSWERS (gen_data.py shards of PROMPTS: the teacher's greedy answer to every first turn) and the
teacher's tokenizer. For each first turn it writes the chat template of [user turn 1, assistant = the
teacher's answer, user turn 2] with the generation prompt, under the same id and category, to OUT (a
prompts.jsonl that gen_data.py and category_tau.py take as they take the first turns), plus
OUT.mtbench_second_turns.json (counts: answers ended by an EOS token, answers cut at gen_data's
--max-new-tokens) and the log OUT.mtbench_second_turns.log.

The answer enters the conversation as a harness would pass it on, and as measure_tau.py --turns 2 does:
its token ids decoded with special tokens skipped (the EOS gen_data keeps at the end of a finished
answer included) and stripped; the template closes the assistant turn itself. A first turn without a
teacher answer, or an answer made from other prompt tokens, is refused.

    python -m evidence.teacher.gen_data --prompts SMALL/mtbench_prompts.jsonl --teacher SMALL/teacher \
        --out WORK/eval64 --max-new-tokens 64 --top-k 20 --batch-size 16 --shard-size 16 \
        --holdout-fraction 1.0 --dtype float32
    python -m evidence.prompts.mtbench_second_turns --prompts SMALL/mtbench_prompts.jsonl \
        --questions SMALL/mtbench_question.jsonl --answers WORK/eval64 --tokenizer SMALL/tokenizer \
        --out WORK/mtbench_turn2_prompts.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evidence import common
from evidence.prompts.prepare_prompts import encode, load_tokenizer
from evidence.teacher.gen_data import SHARD_PATTERN, load_examples, read_shard_settings

ID_PREFIX = "mtbench:"  # smollm2_models.mtbench_prompts names each first turn mtbench:<question_id>


def second_turns_by_id(question_file: Path) -> dict[str, str]:
    """{prompt id: second user turn} of every question that has one."""
    turns = {}
    for line_number, question in enumerate(common.read_jsonl(question_file), 1):
        asked = question.get("turns")
        if "question_id" not in question or not (isinstance(asked, list) and all(isinstance(t, str) for t in asked)):
            raise common.UserError(
                f"{question_file}:{line_number}: not an MT-bench question (expected question_id and turns, a list of strings)"
            )
        if len(asked) > 1:
            turns[f"{ID_PREFIX}{question['question_id']}"] = asked[1]
    return turns


def teacher_answers(answer_dir: Path) -> tuple[dict[str, dict], list[int]]:
    """{prompt id: gen_data example} of the shards in `answer_dir`, and the EOS ids they stopped at."""
    examples = load_examples(answer_dir, "all")
    settings = read_shard_settings(sorted(answer_dir.glob(SHARD_PATTERN))[0])
    return {example["id"]: example for example in examples}, settings["eos_token_ids"]


def answer_text(tokenizer, answer_ids: list[int]) -> str:
    """The answer as the next turn's context: measure_tau.py --turns 2's rule (special tokens, EOS among
    them, skipped; surrounding space stripped)."""
    return tokenizer.decode(answer_ids, skip_special_tokens=True).strip()


def second_turn_rows(first_turns: list[dict], second_turns: dict[str, str], answers: dict[str, dict], tokenizer):
    """The second-turn prompts, in the first turns' order (questions without a second turn are left out)."""
    rows = []
    for first in first_turns:
        if first["id"] not in second_turns:
            continue
        answer = answers.get(first["id"])
        if answer is None:
            raise common.UserError(
                f"first turn {first['id']} has no teacher answer in --answers; run gen_data.py on --prompts into it"
            )
        if answer["prompt_ids"].tolist() != first["token_ids"]:
            raise common.UserError(
                f"the teacher answer to {first['id']} in --answers was made from other prompt tokens than --prompts"
                " holds; rerun gen_data.py on these prompts"
            )
        messages = first["messages"] + [
            {"role": "assistant", "content": answer_text(tokenizer, answer["tokens"].tolist())},
            {"role": "user", "content": second_turns[first["id"]]},
        ]
        rows.append(
            {
                "id": first["id"],
                "source": first.get("source", "mtbench"),
                "category": first.get("category", "uncategorised"),
                "turn": 2,
                "messages": messages,
                "token_ids": encode(tokenizer, messages, enable_thinking=False),
            }
        )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, required=True, help="first turns: SMALL/mtbench_prompts.jsonl")
    parser.add_argument("--questions", type=Path, required=True, help="MT-bench question.jsonl (the second turns)")
    parser.add_argument("--answers", type=Path, required=True, help="gen_data.py shards of --prompts")
    parser.add_argument("--tokenizer", required=True, help="the teacher's tokenizer, with its chat template")
    parser.add_argument("--out", type=Path, required=True, help="prompts.jsonl of the second turns to write")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    first_turns = common.read_jsonl(args.prompts)
    for line_number, row in enumerate(first_turns, 1):
        if not {"id", "messages", "token_ids"} <= row.keys():
            raise common.UserError(f"{args.prompts}:{line_number}: a prompt row needs id, messages and token_ids")
    second_turns = second_turns_by_id(args.questions)
    answers, eos_ids = teacher_answers(args.answers)
    tokenizer = load_tokenizer(args.tokenizer, None)
    logger = common.setup_logging(common.log_path_beside(args.out, "mtbench_second_turns"), "mtbench_second_turns")
    logger.info(
        "command: python -m evidence.prompts.mtbench_second_turns %s", " ".join(sys.argv[1:] if argv is None else argv)
    )
    rows = second_turn_rows(first_turns, second_turns, answers, tokenizer)
    if not rows:
        raise common.UserError(f"no first turn of {args.prompts} has a second turn in {args.questions}")
    common.write_jsonl(args.out, rows)
    ended = sum(int(answers[row["id"]]["tokens"][-1]) in eos_ids for row in rows)
    summary = {
        "second_turns": len(rows),
        "first_turns_without_a_second": len(first_turns) - len(rows),
        "answers_ended_by_eos": ended,
        "answers_cut_at_max_new_tokens": len(rows) - ended,
        "answer_tokens": sum(len(answers[row["id"]]["tokens"]) for row in rows),
        "prompt_tokens": sum(len(row["token_ids"]) for row in rows),
    }
    common.atomic_write_json(common.log_path_beside(args.out, "mtbench_second_turns").with_suffix(".json"), summary)
    logger.info("wrote %d second turns to %s: %s", len(rows), args.out, summary)
    return summary


if __name__ == "__main__":
    common.run_cli(main)
