"""The distillation loss against hand-computed values, the schedule, and a real two-process DDP run."""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pipeline_fixtures import perturbed_copy
from tiny_models import make_hf_model, write_hf_checkpoint

from evidence import common
from evidence.teacher.gen_data import load_examples
from evidence.train.train_drafter import distillation_loss, epoch_batches, learning_rate_factor

ROOT = Path(__file__).resolve().parents[1]


def test_kl_renormalises_the_teacher_top_k_and_the_student_on_those_ids():
    # Teacher top-2 ids [1, 3] with probabilities 0.6 and 0.2 -> renormalised p = [0.75, 0.25].
    # Student logits are equal on ids 1 and 3 -> restricted and renormalised q = [0.5, 0.5], whatever
    # the other ids hold (id 2 has most of the student's full softmax mass).
    logits = torch.tensor([[0.0, 2.0, 5.0, 2.0, -1.0]])
    topk_ids, topk_logprobs = torch.tensor([[1, 3]]), torch.tensor([[math.log(0.6), math.log(0.2)]])
    _, parts = distillation_loss(logits, torch.tensor([1]), topk_ids, topk_logprobs, ce_weight=1.0, kl_weight=1.0)
    assert parts["kl"] == pytest.approx(
        0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5), rel=1e-6
    )  # 0.1308120
    assert parts["ce"] == pytest.approx(-(2.0 - math.log(1 + 2 * math.exp(2) + math.exp(5) + math.exp(-1))), rel=1e-6)


def test_kl_and_cross_entropy_equal_a_hand_computed_batch():
    # Row 0: teacher p = [0.5, 0.25, 0.25] on ids [0, 2, 3]; student logits there ln 1, ln 2, ln 1 -> q = [0.25, 0.5, 0.25].
    # Row 1: teacher p = [0.6, 0.2, 0.2] (sums to 1) on ids [4, 1, 0]; student logits 2, 2, -1 there.
    logits = torch.tensor([[0.0, 9.0, math.log(2), 0.0, 3.0], [-1.0, 2.0, 0.5, 0.0, 2.0]])
    targets = torch.tensor([2, 4])
    topk_ids = torch.tensor([[0, 2, 3], [4, 1, 0]])
    topk_logprobs = torch.tensor(
        [[math.log(0.5), math.log(0.25), math.log(0.25)], [math.log(0.6), math.log(0.2), math.log(0.2)]]
    )
    kl_row0 = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5) + 0.25 * math.log(0.25 / 0.25)  # 0.1732868
    z = 2 * math.exp(2) + math.exp(-1)
    q_row1 = [math.exp(2) / z, math.exp(2) / z, math.exp(-1) / z]
    kl_row1 = sum(p * math.log(p / q) for p, q in zip([0.6, 0.2, 0.2], q_row1))
    ce_row0 = -(math.log(2) - math.log(1 + math.exp(9) + 2 + 1 + math.exp(3)))
    ce_row1 = -(2.0 - math.log(math.exp(-1) + math.exp(2) + math.exp(0.5) + 1 + math.exp(2)))
    loss, parts = distillation_loss(logits, targets, topk_ids, topk_logprobs, ce_weight=0.5, kl_weight=2.0)
    assert parts["kl"] == pytest.approx((kl_row0 + kl_row1) / 2, rel=1e-6)
    assert parts["ce"] == pytest.approx((ce_row0 + ce_row1) / 2, rel=1e-6)
    assert float(loss) == pytest.approx(0.5 * parts["ce"] + 2.0 * parts["kl"], rel=1e-6)


def test_kl_is_zero_when_the_student_matches_the_teacher_on_its_top_k():
    teacher_logits = torch.randn(6, 50)
    top = torch.log_softmax(teacher_logits, -1).topk(20)
    _, parts = distillation_loss(teacher_logits + 3.0, top.indices[:, 0], top.indices, top.values, 1.0, 1.0)
    assert parts["kl"] == pytest.approx(0.0, abs=1e-6)


def test_learning_rate_warms_up_then_decays_by_cosine():
    factors = [learning_rate_factor(step, warmup_steps=4, total_steps=20, min_ratio=0.1) for step in range(21)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == pytest.approx(1.0) and factors[20] == pytest.approx(0.1)
    assert factors[12] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))


def test_length_groups_cut_padding_and_keep_every_full_batch_of_the_epoch():
    lengths = random.Random(1).choices(range(4, 600), k=16 * 40 + 5)
    examples = [{"id": i, "prompt_ids": [0] * n, "tokens": [1]} for i, n in enumerate(lengths)]

    def padded_tokens(batches):
        return sum(len(b) * max(len(e["prompt_ids"]) for e in b) for b in batches)

    plain = epoch_batches(examples, 16, 1, random.Random(0))
    grouped = epoch_batches(examples, 16, 8, random.Random(0))
    assert [len(b) for b in plain] == [16] * 40 and [len(b) for b in grouped] == [16] * 40
    assert [e["id"] for b in plain for e in b] == list(range(640))  # plain: the given order, cut in chunks
    grouped_ids = [e["id"] for b in grouped for e in b]
    assert len(set(grouped_ids)) == 640 and max(grouped_ids) < 640  # no example twice; the tail stays dropped
    assert padded_tokens(grouped) < 0.7 * padded_tokens(plain)
    assert grouped == epoch_batches(examples, 16, 8, random.Random(0))  # seeded: a resumed run sees the same batches


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    from evidence.teacher import gen_data

    root = tmp_path_factory.mktemp("train")
    teacher = make_hf_model("qwen3", seed=11)
    write_hf_checkpoint(teacher, root / "teacher")
    write_hf_checkpoint(perturbed_copy(teacher, noise=0.3, seed=12), root / "base")
    prompts = [
        {"id": f"q{i}", "source": "test", "messages": [], "token_ids": [3, 10 + i, 60 + 2 * i, 9]} for i in range(24)
    ]
    common.write_jsonl(root / "prompts.jsonl", prompts)
    gen_data.main(
        [
            "--prompts",
            str(root / "prompts.jsonl"),
            "--teacher",
            str(root / "teacher"),
            "--out",
            str(root / "data"),
            "--max-new-tokens",
            "16",
            "--batch-size",
            "8",
            "--shard-size",
            "12",
            "--holdout-fraction",
            "0.25",
            "--eos-token-ids",
            "2",
        ]
    )
    return {"root": root, "base": root / "base", "data": root / "data"}


def test_training_raises_train_agreement_and_keeps_the_best_checkpoint(data, tmp_path):
    from transformers import AutoModelForCausalLM

    from evidence.measure.tau import offline_tau
    from evidence.train import train_drafter

    out = tmp_path / "student"
    report = train_drafter.main(
        [
            "--base",
            str(data["base"]),
            "--data",
            str(data["data"]),
            "--out",
            str(out),
            "--k",
            "4",
            "--lr",
            "3e-3",
            "--warmup-steps",
            "2",
            "--max-steps",
            "12",
            "--batch-size",
            "6",
            "--eval-every",
            "4",
        ]
    )
    assert [entry["step"] for entry in report["history"]] == [0, 4, 8, 12]
    best = max(report["history"], key=lambda entry: entry["holdout_tau"])
    assert report["selected_step"] == best["step"] and report["selected_holdout_tau"] == best["holdout_tau"]
    saved = AutoModelForCausalLM.from_pretrained(out)
    holdout = offline_tau(saved, load_examples(data["data"], "holdout"), k=4, progress=False)
    assert holdout.tau == pytest.approx(best["holdout_tau"])  # the saved weights are the selected ones
    base = AutoModelForCausalLM.from_pretrained(data["base"])
    train = load_examples(data["data"], "train")
    last = train_drafter.train(
        base,
        train,
        train,
        train_drafter.TrainSettings(k=4, lr=3e-3, warmup_steps=2, max_steps=12, batch_size=6, eval_every=12),
        common.setup_logging(tmp_path / "t.log", "t"),
    )
    assert last["history"][-1]["holdout_tau"] > last["history"][0]["holdout_tau"]  # it learns what it is taught


def test_a_shard_range_trains_on_those_shards_and_keeps_every_holdout_through_its_end(data, tmp_path):
    from evidence.train import train_drafter

    flags = ["--base", str(data["base"]), "--data", str(data["data"]), "--k", "4", "--batch-size", "6"]
    report = train_drafter.main([*flags, "--out", str(tmp_path / "s"), "--max-steps", "1", "--first-shard", "1"])
    everything = load_examples(data["data"], "train")
    shard_0 = load_examples(data["data"], "train", last_shard=0)
    assert 0 < report["train_examples"] == len(everything) - len(shard_0)
    assert report["holdout_examples"] == len(load_examples(data["data"], "holdout"))
    report = train_drafter.main([*flags, "--out", str(tmp_path / "t"), "--max-steps", "1", "--last-shard", "0"])
    assert report["holdout_examples"] == len(load_examples(data["data"], "holdout", last_shard=0))
    assert report["train_examples"] == len(shard_0)
    with pytest.raises(common.UserError, match="--first-shard must be 0 or more and --last-shard at least"):
        train_drafter.main([*flags, "--out", str(tmp_path / "u"), "--first-shard", "1", "--last-shard", "0"])


def test_same_script_runs_as_ddp_under_torchrun(data, tmp_path):
    """Two CPU processes (gloo): both ranks train, rank 0 saves; DDP keeps the replicas equal."""
    out = tmp_path / "ddp"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "-m",
        "evidence.train.train_drafter",
        "--base",
        str(data["base"]),
        "--data",
        str(data["data"]),
        "--out",
        str(out),
        "--k",
        "4",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "1",
        "--max-steps",
        "3",
        "--batch-size",
        "3",
        "--eval-every",
        "3",
    ]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (out / "model.safetensors").exists()
    report = json.loads(common.log_path_beside(out, "train_drafter").with_suffix(".json").read_text())
    assert report["total_steps"] == 3 and [e["step"] for e in report["history"]] == [0, 3]
    for rank in (0, 1):
        assert "train / " in common.log_path_beside(out, f"train_drafter.rank{rank}").read_text()


def resumable_argv(data: dict, out: Path, lr: str = "3e-3") -> list[str]:
    return [
        "--base",
        str(data["base"]),
        "--data",
        str(data["data"]),
        "--out",
        str(out),
        "--k",
        "4",
        "--lr",
        lr,
        "--warmup-steps",
        "2",
        "--max-steps",
        "8",
        "--batch-size",
        "6",
        "--eval-every",
        "3",
        "--checkpoint-every",
        "2",
    ]


def test_an_interrupted_run_resumes_from_its_checkpoint_to_the_same_weights(data, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from evidence.train import train_drafter

    reference = train_drafter.main(resumable_argv(data, tmp_path / "whole"))
    real_loss, calls = train_drafter.distillation_loss, []

    def loss_that_dies_at_step_5(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt  # the sitting ends during step 5; the checkpoint of step 4 is on disk
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(train_drafter, "distillation_loss", loss_that_dies_at_step_5)
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        train_drafter.main(resumable_argv(data, out))
    monkeypatch.setattr(train_drafter, "distillation_loss", real_loss)
    resumed = train_drafter.main(resumable_argv(data, out))
    log = common.log_path_beside(out, "train_drafter").read_text()
    assert "at step 4 of 8" in log and len(calls) == 5
    assert resumed["history"] == reference["history"] and resumed["selected_step"] == reference["selected_step"]
    whole, cut = load_file(tmp_path / "whole" / "model.safetensors"), load_file(out / "model.safetensors")
    assert whole.keys() == cut.keys() and all(torch.equal(whole[name], cut[name]) for name in whole)
    with pytest.raises(common.UserError, match="was saved by a run with other settings or data"):
        train_drafter.main(resumable_argv(data, out, lr="1e-3"))


def test_teacher_top_k_on_the_fly_equals_the_stored_top_k(data):
    from transformers import AutoModelForCausalLM

    from evidence.teacher.gen_data import collate
    from evidence.train.train_drafter import teacher_top_k

    teacher = AutoModelForCausalLM.from_pretrained(data["root"] / "teacher").eval()
    batch = collate(load_examples(data["data"], "all")[:5])
    recomputed = teacher_top_k(teacher, batch, k=20)
    assert torch.equal(recomputed["topk_ids"][:, 0], batch["targets"])  # greedy labels are the top 1
    torch.testing.assert_close(recomputed["topk_logprobs"], batch["topk_logprobs"], rtol=1e-4, atol=1e-4)


def test_student_from_a_subset_of_teacher_layers(tmp_path):
    """smollm2_models.layer_subset: the kept layers, renumbered, with the teacher's embeddings and norm."""
    from transformers import AutoModelForCausalLM

    from evidence.prompts.smollm2_models import layer_subset

    teacher = make_hf_model("llama", seed=5, num_hidden_layers=3)
    layer_subset(teacher, [0, 2], tmp_path / "student")
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "student")
    assert student.config.num_hidden_layers == 2
    torch.testing.assert_close(
        student.model.layers[1].mlp.down_proj.weight, teacher.model.layers[2].mlp.down_proj.weight
    )
    torch.testing.assert_close(student.model.embed_tokens.weight, teacher.model.embed_tokens.weight)
    assert student.lm_head.weight is student.model.embed_tokens.weight  # still tied


def test_the_student_init_script_without_gguf_says_what_to_install(monkeypatch, tmp_path):
    import importlib.util

    from evidence.prompts import smollm2_models

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(common.UserError, match=r"needs the gguf package: pip install -e '\.\[train\]'"):
        smollm2_models.main(["--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "small")])
    assert list(tmp_path.iterdir()) == []  # nothing fetched, nothing written
