"""The evidence pipeline end to end at tiny scale, its package and record, and its refusals
of unsafe labels and models (the prompt stages and data sources: test_pipeline_sources.py).

Fixture parquet files with the real column layouts of the five datasets -> prompts (a word-level
tokenizer with a chat template) -> teacher data from a tiny random Qwen3 -> distilled student -> GPTQ
package -> LoRA -> draft_model.load_model loads it strictly and draft_batch drafts."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from pipeline_fixtures import TINY_CONFIG, pipeline_argv
from safetensors import safe_open

import draft_model
from evidence import common, packages, pipeline_checks, run_pipeline
from evidence.inventory import file_inventory, package_inventory
from evidence.prompts import prepare_prompts


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


def test_package_holds_exactly_the_inventory_its_settings_make(pipeline_inputs, pipeline_run):
    """The shape arithmetic that declares the full-scale inventory (evidence/inventory.py) against what the
    pipeline's writers really wrote: every tensor, dtype and shape, the bf16 LoRA matrices included."""
    config = json.loads(TINY_CONFIG.read_text())
    gptq, lora = config["gptq"], config["lora"]
    expected = package_inventory(
        json.loads((pipeline_inputs["base"] / "config.json").read_text()),
        gptq["group_size"],
        getattr(torch, gptq["store_dtype"]),
        gptq["embedding_group_size"],
        lora["rank"],
    )
    assert file_inventory(pipeline_run["out"]) == expected
    assert {dtype for dtype, _ in expected["lora.safetensors"].values()} == {"BF16"}


def test_plan_of_a_local_run_checks_the_local_base(pipeline_inputs, tmp_path, capsys):
    summary = run_pipeline.main([*pipeline_argv(pipeline_inputs, tmp_path / "work", tmp_path / "out"), "--plan"])
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


def test_package_ships_the_tokenizer_it_was_trained_with_under_its_checksums(pipeline_inputs, pipeline_run):
    """An engine reads the package's tokenizer and chat template to make the ids it sends to /draft."""
    from transformers import AutoTokenizer

    out = pipeline_run["out"]
    for name in packages.TOKENIZER_FILES:
        assert (out / name).read_bytes() == (pipeline_inputs["tokenizer"] / name).read_bytes()
    checksums = json.loads((out / "checksums.json").read_text())["sha256"]
    assert set(packages.TOKENIZER_FILES) <= set(checksums)
    messages = [{"role": "user", "content": "tell me how to draw a tree"}]
    expected = prepare_prompts.encode(AutoTokenizer.from_pretrained(pipeline_inputs["tokenizer"]), messages, False)
    assert prepare_prompts.encode(AutoTokenizer.from_pretrained(out), messages, False) == expected


def test_dense_from_package_drafts_what_the_server_drafts(pipeline_run, tmp_path):
    """Continuing distillation from a package starts from the weights the server drafts with: the dense
    checkpoint's greedy tokens are the package's drafts, and it carries the package's tokenizer."""
    from tiny_models import random_rows, reference_greedy
    from transformers import AutoModelForCausalLM

    from evidence.train import dense_from_package

    out = pipeline_run["out"]
    report = dense_from_package.main(["--package", str(out), "--out", str(tmp_path / "dense")])
    assert (
        report["tokenizer"]
        and (tmp_path / "dense" / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    )
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    rows = random_rows([9, 30, 57], seed=3)
    drafts = draft_model.draft_batch(draft_model.load_model(out, "cpu", "float32"), rows, max_tokens=8)
    assert [reference_greedy(dense, row, 8) for row in rows] == drafts
    for package, target, message in (
        (tmp_path / "dense", tmp_path / "again", "not a model package"),
        (out, out, "is the package itself"),
    ):
        with pytest.raises(common.UserError, match=message):
            dense_from_package.main(["--package", str(package), "--out", str(target)])
    assert not (tmp_path / "again").exists() and (out / "quant_config.json").is_file()


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


def test_rerun_skips_every_finished_stage(pipeline_inputs, pipeline_run):
    before = (pipeline_run["out"] / "model_int4.safetensors").read_bytes()
    record = run_pipeline.main(pipeline_argv(pipeline_inputs, pipeline_run["work"], pipeline_run["out"]))
    log = (pipeline_run["work"] / "run_pipeline.log").read_text()
    for stage in ("prompts", "aya", "magpie", "data", "distill", "gptq", "lora", "eval_data"):
        assert f"stage {stage}: unchanged, skipped" in log
    assert record["holdout_tau"] == pipeline_run["record"]["holdout_tau"]
    assert (pipeline_run["out"] / "model_int4.safetensors").read_bytes() == before


def test_measurement_prompts_must_not_be_training_prompts(pipeline_run, tmp_path):
    training = common.read_jsonl(pipeline_run["work"] / "prompts.jsonl")
    common.write_jsonl(tmp_path / "eval.jsonl", [training[3] | {"id": "eval:0"}])
    with pytest.raises(
        common.UserError, match=r"1 measurement prompt\(s\) are also training prompts \(first: eval:0\)"
    ):
        pipeline_checks.check_disjoint(
            pipeline_checks.prompt_token_ids(pipeline_run["work"] / "prompts.jsonl"), tmp_path / "eval.jsonl"
        )


def test_hub_model_without_pinned_revision_is_refused(pipeline_inputs, tmp_path):
    config = json.loads(TINY_CONFIG.read_text()) | {"teacher": {"repo": "Qwen/Qwen3-8B", "revision": None}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = pipeline_argv(pipeline_inputs, tmp_path / "work", tmp_path / "out")
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


def test_a_config_with_labels_starts_at_distillation_on_them(pipeline_inputs, pipeline_run, tmp_path):
    labels = tmp_path / "labels"
    shutil.copytree(pipeline_run["work"] / "data", labels)
    argv = pipeline_argv(pipeline_inputs, tmp_path / "work", tmp_path / "out")
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


def test_labels_that_differ_from_their_index_are_refused(pipeline_inputs, pipeline_run, tmp_path, capsys):
    labels = tmp_path / "labels"
    shutil.copytree(pipeline_run["work"] / "data", labels)
    shard = sorted(labels.glob("shard-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit of the last tensor
    argv = pipeline_argv(pipeline_inputs, tmp_path / "work", tmp_path / "out")
    argv[argv.index("--config") + 1] = str(labels_config(tmp_path, labels))
    with pytest.raises(common.UserError, match=rf"{shard.name} is missing or differs from index.json"):
        run_pipeline.main(argv)
    assert not (tmp_path / "out").exists()
    with pytest.raises(common.UserError, match="fails 1 check"):
        run_pipeline.main([*argv, "--plan"])
    assert f"FAIL teacher labels {labels}" in capsys.readouterr().out


def test_a_tokenizer_directory_without_tokenizer_json_is_refused_before_any_stage(pipeline_inputs, tmp_path):
    empty = tmp_path / "not-a-tokenizer"
    empty.mkdir()
    argv = pipeline_argv(pipeline_inputs, tmp_path / "work", tmp_path / "out")
    argv[argv.index("--tokenizer") + 1] = str(empty)
    with pytest.raises(common.UserError, match="holds no tokenizer.json"):
        run_pipeline.main(argv)
    assert not (tmp_path / "out").exists() and not (tmp_path / "work" / "prompts.jsonl").exists()


def test_a_hub_tokenizer_is_fetched_at_its_pin_and_a_failed_fetch_is_one_line(pipeline_inputs, tmp_path, monkeypatch):
    import logging

    from pipeline_fixtures import FAKE_REVISION

    config = run_pipeline.load_config(TINY_CONFIG) | {"tokenizer": {"repo": "org/tokenizer", "revision": FAKE_REVISION}}
    argv = pipeline_argv(pipeline_inputs, tmp_path / "work", tmp_path / "out")
    del argv[argv.index("--tokenizer") : argv.index("--tokenizer") + 2]
    pipeline = run_pipeline.Pipeline(run_pipeline.parse_args(argv), config, logging.getLogger("test"))
    asked = []

    def download(repo, **options):
        asked.append((repo, options["revision"], tuple(options["allow_patterns"])))
        return str(pipeline_inputs["tokenizer"])

    monkeypatch.setattr(run_pipeline, "snapshot_download", download)
    assert pipeline.tokenizer_dir() == pipeline_inputs["tokenizer"]
    assert asked == [("org/tokenizer", FAKE_REVISION, packages.TOKENIZER_FILES)]

    def offline(repo, **options):
        raise OSError("no network")

    monkeypatch.setattr(run_pipeline, "snapshot_download", offline)
    with pytest.raises(common.UserError, match=f"tokenizer org/tokenizer@{FAKE_REVISION}: OSError: no network"):
        pipeline.tokenizer_dir()
