"""evidence/prompts/mtbench_second_turns.py on a tiny target and a word-level chat tokenizer: the second-turn set,
labelled by gen_data.py and replayed by category_tau.py, gives exactly the counts of measure_tau.py's live
--turns 2 harness; bad input is refused in one line."""

import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_fixtures import perturbed_copy, write_tokenizer
from tiny_models import make_hf_model, write_hf_checkpoint

from evidence import common
from evidence.measure import category_tau, measure_tau
from evidence.prompts import mtbench_second_turns
from evidence.prompts.prepare_prompts import load_tokenizer
from evidence.prompts.smollm2_models import mtbench_prompts
from evidence.teacher import gen_data

ROOT = Path(__file__).resolve().parents[1]
K, NEW_TOKENS = 6, 10
QUESTIONS = [  # (question_id, category, turns): the last has no second turn, as a question file may
    (81, "writing", ["write a story about the sea", "now make it long and sad"]),
    (101, "reasoning", ["what is the number of the tree", "why is that so"]),
    (121, "coding", ["tell me how to build a house", "and a home for animal"]),
    (131, "extraction", ["find the name of the city"]),
]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def turns(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Target, drafter, tokenizer, question file, first turns and the target's answers to them."""
    root = tmp_path_factory.mktemp("mtbench-second-turns")
    target = make_hf_model("qwen3", seed=3)
    paths = {
        "root": root,
        "target": write_hf_checkpoint(target, root / "target"),
        "drafter": write_hf_checkpoint(perturbed_copy(target, noise=0.05, seed=4), root / "drafter"),
        "tokenizer": write_tokenizer(root / "tokenizer"),
        "questions": root / "question.jsonl",
        "first": root / "turn1.jsonl",
        "answers": root / "turn1_data",
    }
    common.write_jsonl(paths["questions"], [{"question_id": q, "category": c, "turns": t} for q, c, t in QUESTIONS])
    mtbench_prompts(paths["questions"], load_tokenizer(str(paths["tokenizer"]), None), paths["first"])
    label(paths, paths["first"], paths["answers"])
    return paths


def label(paths: dict, prompts: Path, out: Path, *extra: str) -> None:
    """The target's greedy continuations of `prompts` (a measurement set: every row held out)."""
    gen_data.main(
        ["--prompts", str(prompts), "--teacher", str(paths["target"]), "--out", str(out), "--holdout-fraction", "1"]
        + ["--max-new-tokens", str(NEW_TOKENS), "--eos-token-ids", "2", "--batch-size", "2", "--shard-size", "2"]
        + list(extra)
    )


def build(paths: dict, out: Path, prompts: Path | None = None, answers: Path | None = None) -> dict:
    return mtbench_second_turns.main(
        ["--prompts", str(prompts or paths["first"]), "--questions", str(paths["questions"])]
        + ["--answers", str(answers or paths["answers"]), "--tokenizer", str(paths["tokenizer"]), "--out", str(out)]
    )


def test_second_turns_carry_the_first_turn_and_the_teachers_answer(turns):
    out = turns["root"] / "turn2.jsonl"
    summary = build(turns, out)
    first, second = common.read_jsonl(turns["first"]), common.read_jsonl(out)
    assert [(r["id"], r["category"]) for r in second] == [(r["id"], r["category"]) for r in first[:3]]
    assert summary["second_turns"] == 3 and summary["first_turns_without_a_second"] == 1
    assert summary["answers_ended_by_eos"] + summary["answers_cut_at_max_new_tokens"] == 3
    answers = {e["id"]: e["tokens"].tolist() for e in gen_data.load_examples(turns["answers"])}
    tokenizer = load_tokenizer(str(turns["tokenizer"]), None)
    for row, first_row, (_, _, asked) in zip(second, first, QUESTIONS):
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant", "user"] and [row["messages"][i]["content"] for i in (0, 2)] == asked
        assert row["messages"][1]["content"] == tokenizer.decode(answers[row["id"]], skip_special_tokens=True).strip()
        user_turn = first_row["token_ids"][: first_row["token_ids"].index(tokenizer.eos_token_id) + 1]
        assert row["token_ids"][: len(user_turn)] == user_turn  # the conversation starts with turn 1, closed
    assert out.with_name("turn2.jsonl.mtbench_second_turns.json").is_file()


def test_offline_replay_of_both_turns_equals_the_live_two_turn_harness(turns):
    """category_tau on turn 1 plus turn 2 (labelled by gen_data) counts what measure_tau.py --turns 2
    counts live: the second-turn prompts are the ones the live harness builds."""
    root = turns["root"]
    build(turns, root / "live_turn2.jsonl")
    label(turns, root / "live_turn2.jsonl", root / "turn2_data")
    offline: dict[str, list[int]] = {}
    for data, prompts in ((turns["answers"], turns["first"]), (root / "turn2_data", root / "live_turn2.jsonl")):
        report = category_tau.main(
            ["--data", str(data), "--prompts", str(prompts), "--drafter", str(turns["drafter"])]
            + ["--k", str(K), "--hybrid", "2"]
        )
        for name, counts in report["table"]["all"].items():
            offline.setdefault(name, [0, 0])
            offline[name][0] += counts["committed"]
            offline[name][1] += counts["steps"]
    live = measure_tau.main(
        ["--target", str(turns["target"]), "--tokenizer", str(turns["tokenizer"]), "--mtbench", str(turns["questions"])]
        + ["--turns", "2", "--drafter", str(turns["drafter"]), "--hybrid", "2", "--baselines", "ngram"]
        + ["--k", str(K), "--max-new-tokens", str(NEW_TOKENS), "--check"]
    )
    assert live["prompts"] == 4 + 3
    by_name = {
        "prompt_lookup" if r["drafter"].startswith("ngram") else "hybrid" if "hybrid" in r["drafter"] else "model": [
            r["committed_tokens"],
            r["verify_steps"],
        ]
        for r in live["runs"]
    }
    assert all(r["check"] == "passed" for r in live["runs"])
    assert {name: offline[name] for name in by_name} == by_name  # best_of, an oracle, has no live drafter


def test_a_first_turn_without_an_answer_is_refused(turns):
    partial = turns["root"] / "partial_data"
    label(turns, turns["first"], partial, "--limit", "2")
    with pytest.raises(common.UserError, match="mtbench:121 has no teacher answer"):
        build(turns, turns["root"] / "refused.jsonl", answers=partial)
    assert not (turns["root"] / "refused.jsonl").exists()


def test_answers_to_other_prompts_are_refused(turns):
    rows = common.read_jsonl(turns["first"])
    rows[1]["token_ids"] = rows[1]["token_ids"][:-1]
    changed = turns["root"] / "changed.jsonl"
    common.write_jsonl(changed, rows)
    with pytest.raises(common.UserError, match="mtbench:101 in --answers was made from other prompt tokens"):
        build(turns, turns["root"] / "refused.jsonl", prompts=changed)


def test_missing_file_is_one_line_on_the_command_line(turns, tmp_path):
    command = [sys.executable, "-m", "evidence.prompts.mtbench_second_turns", "--prompts", str(tmp_path / "none.jsonl")]
    command += ["--questions", str(turns["questions"]), "--answers", str(turns["answers"])]
    command += ["--tokenizer", str(turns["tokenizer"]), "--out", str(tmp_path / "out.jsonl")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'none.jsonl'} does not exist; expected a JSON-lines file"
    ]
    assert not (tmp_path / "out.jsonl").exists()
