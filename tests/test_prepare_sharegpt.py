"""prepare_sharegpt.py on a small synthetic ShareGPT file (no network): first and later turns with their
context, every filter counted, MT-bench overlap dropped, split by conversation, a truncated tail parsed
up to the last complete record, and output that gen_data.py reads."""

import json
from pathlib import Path

import pytest
from pipeline_fixtures import write_tokenizer

from evidence import common
from evidence.prompts import prepare_prompts, prepare_sharegpt
from evidence.prompts.prepare_prompts import encode, load_tokenizer
from evidence.teacher import gen_data

MTBENCH_TURN = "write a story about the old man who found water under the big tree near his house"


def turns(*pairs: tuple[str, str]) -> list[dict]:
    return [{"from": role, "value": text} for role, text in pairs]


def conversations() -> list[dict]:
    return [
        {  # two human turns: a first-turn prompt and a later-turn prompt with the conversation so far
            "id": "chatA_0",
            "conversations": turns(
                ("human", "write a story about the sea"),
                ("gpt", "the sea was blue and the man was old"),
                ("human", "make it more long please now"),
                ("gpt", "the long sea"),
            ),
        },
        # the second piece of the same chat: same conversation, so the same split
        {"id": "chatA_1", "conversations": turns(("human", "and now give it a new name"), ("gpt", "sea"))},
        {"id": "dup_0", "conversations": turns(("human", "Write a story about the SEA!"), ("gpt", "x"))},
        {"id": "mt_0", "conversations": turns(("human", "please " + MTBENCH_TURN), ("gpt", "ok"))},
        {"id": "ascii_0", "conversations": turns(("human", "write a caf\u00e9 story now"), ("gpt", "ok"))},
        {"id": "empty_0", "conversations": turns(("human", "  "), ("gpt", "ok"), ("human", "how do you solve 2 + 2"))},
        {"id": "role_0", "conversations": turns(("narrator", "once upon a time"), ("human", "go on then"))},
        {"id": "short_0", "conversations": turns(("human", "hi"), ("gpt", "hello"))},
        {
            "id": "code_0",
            "conversations": turns(("human", "fix this python function for me"), ("gpt", "def f")),
        },
        {"id": "bot_only_0", "conversations": turns(("gpt", "hello there"))},
        "not a conversation",
    ]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharegpt")
    tokenizer = write_tokenizer(root / "tokenizer")
    complete = json.dumps(conversations(), indent=2)
    truncated_record = ',\n  {"id": "cut_0", "conversations": [{"from": "human", "value": "this one never en'
    (root / "sharegpt.json").write_text(complete.rstrip().removesuffix("]") + truncated_record)
    common.write_jsonl(root / "question.jsonl", [{"question_id": 81, "category": "writing", "turns": [MTBENCH_TURN]}])
    return {
        "root": root,
        "tokenizer": tokenizer,
        "sharegpt": root / "sharegpt.json",
        "mtbench": root / "question.jsonl",
    }


def run(inputs: dict, out: Path, *extra: str) -> dict:
    return prepare_sharegpt.main(
        [
            "--input",
            str(inputs["sharegpt"]),
            "--mtbench",
            str(inputs["mtbench"]),
            "--tokenizer",
            str(inputs["tokenizer"]),
            "--out",
            str(out),
            *extra,
        ]
    )


def test_prompts_counts_and_manifest(inputs, tmp_path):
    out = tmp_path / "prompts.jsonl"
    summary = run(inputs, out, "--holdout-fraction", "0.5")
    rows = common.read_jsonl(out)
    by_id = {row["id"]: row for row in rows}
    assert set(by_id) == {
        "sharegpt:chatA_0:1",
        "sharegpt:chatA_0:2",
        "sharegpt:chatA_1:1",
        "sharegpt:empty_0:2",
        "sharegpt:code_0:1",
    }
    counts = summary["counts"]
    assert counts["truncated_tail"] == 1 and counts["records"] == 11 and counts["not_a_conversation"] == 1
    assert counts["mtbench_overlap"] == 1 and counts["near_duplicate"] == 1 and counts["non_ascii_turn"] == 1
    assert counts["empty_turn"] == 1 and counts["unknown_role"] == 1 and counts["too_few_words"] == 1
    assert counts["no_human_turn"] == 1
    later = by_id["sharegpt:chatA_0:2"]
    assert [m["role"] for m in later["messages"]] == ["user", "assistant", "user"] and later["turn"] == 2
    tokenizer = load_tokenizer(str(inputs["tokenizer"]), None)
    assert later["token_ids"] == encode(tokenizer, later["messages"], enable_thinking=False)
    assert by_id["sharegpt:code_0:1"]["category"] == "coding" and by_id["sharegpt:empty_0:2"]["category"] == "math"
    assert by_id["sharegpt:chatA_0:2"]["category"] == "writing"  # a follow-up takes its conversation's topic
    splits = {row["id"]: row["split"] for row in rows}
    assert splits["sharegpt:chatA_0:1"] == splits["sharegpt:chatA_0:2"] == splits["sharegpt:chatA_1:1"]
    for prompt_id, split in splits.items():  # by conversation: the id up to the piece number
        conversation = prompt_id.split(":")[1].rsplit("_", 1)[0]
        assert split == ("holdout" if common.stable_hash_fraction(conversation) < 0.5 else "train")
    assert summary["output_sha256"] == common.sha256_file(out) and summary["prompts"] == 5
    assert summary["per_category"] == {"writing": 2, "math": 1, "coding": 1, "other": 1}  # chatA_1: "give it a name"
    assert [row["category"] for row in rows[:4]] == ["coding", "math", "other", "writing"]  # round robin first
    assert [row["turn"] for row in rows if row["category"] == "writing"] == [1, 2]  # first turns alternate with later
    assert gen_data.holdout_flag(by_id["sharegpt:chatA_0:1"], 0.0) == (splits["sharegpt:chatA_0:1"] == "holdout")


def test_context_is_cut_to_the_budget_from_the_oldest_turn(inputs, tmp_path):
    out = tmp_path / "prompts.jsonl"
    summary = run(inputs, out, "--max-prompt-tokens", "20")
    by_id = {row["id"]: row for row in common.read_jsonl(out)}
    later = by_id["sharegpt:chatA_0:2"]
    assert [m["content"] for m in later["messages"]] == ["make it more long please now"]
    assert all(len(row["token_ids"]) <= 20 for row in by_id.values())
    assert summary["counts"]["context_cut"] >= 1


def test_rerun_is_identical(inputs, tmp_path):
    first, second = run(inputs, tmp_path / "a.jsonl"), run(inputs, tmp_path / "b.jsonl")
    assert first["output_sha256"] == second["output_sha256"]


def test_bad_input_is_one_clear_error(inputs, tmp_path):
    (tmp_path / "bad.json").write_text('{"id": 1}')
    with pytest.raises(common.UserError, match="not a JSON array"):
        run(inputs | {"sharegpt": tmp_path / "bad.json"}, tmp_path / "out.jsonl")
    (tmp_path / "none.json").write_text('[{"id": "x", "conversations": [{"from": "gpt", "value": "hi"}]}]')
    with pytest.raises(common.UserError, match="no prompt survived the filters"):
        run(inputs | {"sharegpt": tmp_path / "none.json"}, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()
    with pytest.raises(common.UserError, match="give --cache-dir"):
        prepare_sharegpt.main(["--tokenizer", str(inputs["tokenizer"]), "--out", str(tmp_path / "o.jsonl")])
    with pytest.raises(common.UserError, match="--max-turns must be at least 1"):
        run(inputs, tmp_path / "out.jsonl", "--max-turns", "0")


def test_sharegpt_chats_give_one_prompt_per_human_turn():
    chats = [
        {
            "id": "c0",
            "conversations": [
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello"},
                {"from": "human", "value": "who are you"},
                {"from": "gpt", "value": "a model"},
            ],
        }
    ]
    rows = list(prepare_prompts.read_sharegpt(chats))
    assert [(row_id, [m["role"] for m in messages]) for row_id, messages, _ in rows] == [
        ("c0:0", ["user"]),
        ("c0:2", ["user", "assistant", "user"]),
    ]
    assert rows[1][1][1] == {"role": "assistant", "content": "hello"}
