"""gen_data.py: resumable, deterministic shards; a killed run leaves no partial shard behind."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_models import make_hf_model, write_hf_checkpoint

from evidence import common
from evidence.teacher import gen_data

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gen-data")
    write_hf_checkpoint(make_hf_model("qwen3", seed=5), root / "teacher")
    prompts = [
        {"id": f"p{i}", "source": "test", "messages": [], "token_ids": [3, 5 + i % 200, 7 + (i * 13) % 200, 9 + i % 3]}
        for i in range(40)
    ]
    common.write_jsonl(root / "prompts.jsonl", prompts)
    return {"root": root, "teacher": root / "teacher", "prompts": root / "prompts.jsonl"}


def argv(setup: dict, out: Path, shard_size: int = 8, new_tokens: int = 12) -> list[str]:
    return [
        "--prompts",
        str(setup["prompts"]),
        "--teacher",
        str(setup["teacher"]),
        "--out",
        str(out),
        "--max-new-tokens",
        str(new_tokens),
        "--batch-size",
        "4",
        "--shard-size",
        str(shard_size),
        "--holdout-fraction",
        "0.25",
        "--eos-token-ids",
        "2",
    ]


def shard_contents(directory: Path) -> dict[str, tuple[dict, dict]]:
    """name -> (metadata, tensors as lists) of every shard (safetensors orders its header metadata
    arbitrarily, so files are compared by content, not bytes)."""
    contents = {}
    for path in sorted(directory.glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as shard:
            contents[path.name] = (shard.metadata(), {key: shard.get_tensor(key).tolist() for key in shard.keys()})
    return contents


def test_shards_hold_greedy_continuations_with_top_k(setup, tmp_path):
    index = gen_data.main(argv(setup, tmp_path / "data"))
    assert index["shards"] == 5 and index["rows"] == 40
    examples = gen_data.load_examples(tmp_path / "data")
    teacher = make_hf_model("qwen3", seed=5)
    for example in examples[:3]:
        tokens = example["prompt_ids"].tolist()
        for step, token in enumerate(example["tokens"].tolist()):  # uncached, unpadded greedy reference
            logits = teacher(torch.tensor([tokens])).logits[0, -1]
            assert token == int(logits.argmax()) == int(example["topk_ids"][step, 0])
            torch.testing.assert_close(
                example["topk_logprobs"][step], torch.log_softmax(logits, -1).topk(20).values, rtol=1e-4, atol=1e-4
            )
            tokens.append(token)
        assert len(example["tokens"]) == 12 or example["tokens"][-1] == 2  # full length or stopped at EOS
    holdout = {e["id"] for e in examples if e["holdout"]}
    assert (
        holdout == {f"p{i}" for i in range(40) if common.stable_hash_fraction(f"p{i}") < 0.25} and 0 < len(holdout) < 40
    )


def test_a_shard_range_loads_those_shards_only(setup, tmp_path):
    out = tmp_path / "data"
    gen_data.main(argv(setup, out))  # 5 shards of 8 prompts, in file order
    later = gen_data.load_examples(out, "all", first_shard=3)
    assert [e["id"] for e in later] == [f"p{i}" for i in range(24, 40)]
    holdout = gen_data.load_examples(out, "holdout", first_shard=3)
    assert holdout and [e["id"] for e in holdout] == [e["id"] for e in later if e["holdout"]]
    middle = gen_data.load_examples(out, "all", first_shard=1, last_shard=2)
    assert [e["id"] for e in middle] == [f"p{i}" for i in range(8, 24)]
    assert [e["id"] for e in gen_data.load_examples(out, "all", last_shard=0)] == [f"p{i}" for i in range(8)]
    with pytest.raises(common.UserError, match="holds no shard numbered 5 to the end; check --first-shard"):
        gen_data.load_examples(out, "all", first_shard=5)
    (out / "shard-00001.old.safetensors").write_bytes(b"")
    with pytest.raises(common.UserError, match="shard-00001.old.safetensors is not named shard-NNNNN.safetensors"):
        gen_data.load_examples(out, "all")


def test_rerun_skips_finished_shards_and_is_deterministic(setup, tmp_path):
    out = tmp_path / "data"
    gen_data.main(argv(setup, out))
    first = shard_contents(out)
    (out / "shard-00003.safetensors").unlink()
    gen_data.main(argv(setup, out))
    log = common.log_path_beside(out, "gen_data").read_text()
    assert all(f"shard {i} already complete, skipped" in log for i in (0, 1, 2, 4))
    assert log.count("shard 3 written") == 2
    assert shard_contents(out) == first  # the regenerated shard is identical


def test_rerun_with_other_settings_is_refused(setup, tmp_path):
    gen_data.main(argv(setup, tmp_path / "data"))
    with pytest.raises(common.UserError, match="shard-00000.safetensors was made with other settings or prompts"):
        gen_data.main(argv(setup, tmp_path / "data", new_tokens=6))


def test_failed_write_leaves_no_file(tmp_path):
    target = tmp_path / "shard-00000.safetensors"
    with pytest.raises(RuntimeError, match="disk full"):
        with common.atomic_path(target) as temporary:
            temporary.write_bytes(b"half a shard")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_killed_run_leaves_no_partial_shard_and_resumes(setup, tmp_path):
    """SIGKILL a real run mid-way: every shard file present is complete; the rerun finishes the rest and
    the result equals an uninterrupted run."""
    out = tmp_path / "killed"
    run_argv = argv(setup, out, shard_size=1, new_tokens=32) + ["--limit", "12"]
    command = [sys.executable, "-m", "evidence.teacher.gen_data", *run_argv]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (out / "shard-00002.safetensors").exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    finished = sorted(out.glob("shard-*.safetensors"))
    assert 3 <= len(finished) < 12, "the run was not interrupted mid-way"
    for path in finished:
        with safe_open(str(path), framework="pt") as shard:
            assert len(json.loads(shard.metadata()["ids"])) == shard.get_tensor("token_lengths").numel() == 1
    gen_data.main(run_argv)
    assert not list(out.glob(".*.tmp"))
    gen_data.main(argv(setup, tmp_path / "clean", shard_size=1, new_tokens=32) + ["--limit", "12"])
    assert shard_contents(out) == shard_contents(tmp_path / "clean")


def test_vllm_backend_without_vllm_is_a_clear_error(setup, tmp_path):
    if gen_data.vllm is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(common.UserError, match="--backend vllm needs the vllm package"):
        gen_data.main(argv(setup, tmp_path / "data") + ["--backend", "vllm"])


def test_hard_labels_are_uint16_greedy_tokens_and_split_follows_the_rows(setup, tmp_path):
    """--top-k 0: ids stored as uint16, no top-k tensors; load_examples gives the greedy token as the top 1
    (log-probability 0); a row's "split" field decides holdout, not the id hash."""
    rows = common.read_jsonl(setup["prompts"])[:12]
    for number, row in enumerate(rows):
        row["split"] = "holdout" if number % 4 == 0 else "train"
    common.write_jsonl(tmp_path / "split.jsonl", rows)
    hard = argv(setup, tmp_path / "hard") + ["--top-k", "0", "--prompts", str(tmp_path / "split.jsonl")]
    gen_data.main(hard)
    soft = argv(setup, tmp_path / "soft") + ["--prompts", str(tmp_path / "split.jsonl")]
    gen_data.main(soft)
    with safe_open(str(tmp_path / "hard" / "shard-00000.safetensors"), framework="pt") as shard:
        assert shard.get_tensor("tokens").dtype == shard.get_tensor("prompt_ids").dtype == torch.uint16
        assert "topk_ids" not in shard.keys()
    hard_examples, soft_examples = gen_data.load_examples(tmp_path / "hard"), gen_data.load_examples(tmp_path / "soft")
    for hard_example, soft_example in zip(hard_examples, soft_examples, strict=True):
        assert hard_example["tokens"].tolist() == soft_example["tokens"].tolist()
        assert hard_example["topk_ids"][:, 0].tolist() == soft_example["topk_ids"][:, 0].tolist()
        assert hard_example["topk_logprobs"].eq(0).all() and hard_example["topk_ids"].shape[1] == 1
    assert {e["id"] for e in hard_examples if e["holdout"]} == {"p0", "p4", "p8"}
    batch = gen_data.collate(hard_examples[:3])
    assert batch["targets"].tolist() == torch.cat([e["tokens"].long() for e in hard_examples[:3]]).tolist()


def test_workers_split_the_shards_and_a_moved_copy_resumes(setup, tmp_path):
    """Two workers make disjoint shards that together equal one worker's; the shards, copied next to a teacher
    at another path, are recognised (settings name the weights' sha256, not the path); index.json lists
    every shard's sha256 and a damaged copy is refused."""
    out = tmp_path / "data"
    for worker in ("0", "1"):
        gen_data.main(argv(setup, out) + ["--limit", "24", "--workers", "2", "--worker", worker])
    gen_data.main(argv(setup, tmp_path / "single") + ["--limit", "24"])
    assert shard_contents(out) == shard_contents(tmp_path / "single")
    moved_teacher = tmp_path / "elsewhere" / "teacher"
    moved_teacher.parent.mkdir()
    os.symlink(setup["teacher"], moved_teacher)
    moved = argv(setup, out) + ["--limit", "24", "--teacher", str(moved_teacher)]
    index = gen_data.main(moved)
    log = common.log_path_beside(out, "gen_data").read_text()
    assert log.count("already complete, skipped") == 3 and index["finished_shards"] == 3
    assert index["shard_sha256"]["shard-00001.safetensors"] == common.sha256_file(out / "shard-00001.safetensors")
    damaged = out / "shard-00001.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b" ")
    with pytest.raises(common.UserError, match="shard-00001.safetensors has another sha256 than"):
        gen_data.main(moved)


def test_bad_worker_numbers_are_refused(setup, tmp_path):
    with pytest.raises(common.UserError, match=r"--worker must be in 0..1 \(--workers 2\), got 2"):
        gen_data.main(argv(setup, tmp_path / "data") + ["--workers", "2", "--worker", "2"])
    with pytest.raises(common.UserError, match="--top-k must be 0"):
        gen_data.main(argv(setup, tmp_path / "data") + ["--top-k", "-1"])
