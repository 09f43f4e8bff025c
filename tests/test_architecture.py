"""architecture.json declares the full-scale system and the shipped package; the plan mode of run_pipeline.py
shows and checks the full-scale pipeline offline; a slow rehearsal builds a package at the real Qwen3-1.7B
shape with the pipeline's own writers and loads it with draft_model."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import checkpoint
import int4
from evidence import common, run_pipeline
from evidence.inventory import PROJECTIONS, compact, file_inventory, package_inventory
from evidence.quantize.gptq_drafter import QuantSettings, package_tensors, quant_config, write_package
from evidence.quantize.lora_after_gptq import add_lora, write_adapter

ROOT = Path(__file__).resolve().parents[1]
QWEN3_CONFIG = ROOT / "evidence" / "configs" / "qwen3.json"
# Qwen3-1.7B's config.json, the fields that fix the package's tensors.
QWEN3_1_7B = {
    "model_type": "qwen3",
    "num_hidden_layers": 28,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads((ROOT / "architecture.json").read_text())


def settings_inventory(shape: dict, config: dict) -> dict:
    """The compact inventory the pipeline config's quantization and LoRA settings make at this shape."""
    gptq, lora = config["gptq"], config["lora"]
    return compact(
        package_inventory(
            shape,
            gptq["group_size"],
            getattr(torch, gptq["store_dtype"]),
            gptq.get("embedding_group_size"),
            lora["rank"],
            tuple(lora.get("target_modules", PROJECTIONS)),
            getattr(torch, lora.get("store_dtype", "bfloat16")),
        )
    )


def test_full_scale_is_declared_with_unlocked_pins_never_invented(record):
    full = record["full_scale"]
    assert full["base_model"]["repo"] == "Qwen/Qwen3-1.7B" and full["target_model"]["repo"] == "Qwen/Qwen3-8B"
    for role in ("base_model", "target_model", "tokenizer"):
        pin = full[role]
        # Either not locked (null) or locked to a real commit hash by --lock; nothing in between.
        assert (pin["revision"] is None and pin["locked"] is False) or (
            pin["locked"] is True and common.COMMIT_HASH.match(pin["revision"])
        ), role
    assert {key: full["model"][key] for key in QWEN3_1_7B} == QWEN3_1_7B
    assert full["pipeline"]["config"] == "evidence/configs/qwen3.json"
    assert any("--plan" in command for command in full["pipeline"]["commands"])


def test_declared_inventory_is_what_the_settings_make_at_the_declared_shape(record):
    """Counted on the meta device: 28 identical layers of GPTQ projections and norms, the bf16 embedding
    (tied: no lm_head), and a rank-32 adapter on every projection."""
    full = record["full_scale"]
    declared = full["package_inventory"]
    assert declared == settings_inventory(full["model"], json.loads(QWEN3_CONFIG.read_text()))
    weights, adapter = declared[checkpoint.PACKAGE_WEIGHTS], declared[checkpoint.PACKAGE_LORA_WEIGHTS]
    assert weights["layers"] == adapter["layers"] == 28
    assert weights["per_layer"]["model.layers.N.mlp.down_proj.qweight"] == ["I32", [6144 // 8, 2048]]
    assert weights["per_layer"]["model.layers.N.self_attn.k_proj.scales"] == ["F16", [2048 // 128, 1024]]
    assert weights["other"] == {
        "model.embed_tokens.weight": ["BF16", [151936, 2048]],
        "model.norm.weight": ["BF16", [2048]],
    }
    assert weights["tensors"] == 28 * (7 * 4 + 4) + 2 and adapter["tensors"] == 28 * 7 * 2
    key = "base_model.model.model.layers.N.mlp.gate_proj.lora_A.weight"
    assert adapter["per_layer"][key] == ["BF16", [32, 2048]]


def test_shipped_package_files_are_its_declared_inventory(record):
    """The same arithmetic describes model/ exactly, from its own config, quant and LoRA settings."""
    model = ROOT / "model"
    config = json.loads((model / "config.json").read_text())
    quant = json.loads((model / checkpoint.PACKAGE_QUANT_CONFIG).read_text())
    lora = json.loads((model / checkpoint.PACKAGE_LORA_CONFIG).read_text())
    on_disk = file_inventory(model)
    lora_dtype = next(iter(on_disk[checkpoint.PACKAGE_LORA_WEIGHTS].values()))[0]
    computed = package_inventory(
        config,
        quant["group_size"],
        torch.bfloat16,
        (quant.get("quantized_embedding") or {}).get("group_size"),
        lora["r"],
        tuple(lora["target_modules"]),
        {"F32": torch.float32, "BF16": torch.bfloat16}[lora_dtype],
    )
    assert on_disk == computed
    assert record["shipped_package"]["package_inventory"] == compact(on_disk)


def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the plan tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_plan_shows_every_stage_and_checks_the_config_offline(monkeypatch, capsys):
    no_network(monkeypatch)
    summary = run_pipeline.main(["--config", str(QWEN3_CONFIG), "--plan"])
    out = capsys.readouterr().out
    assert summary["stages"] == ["prompts", "aya", "data", "distill", "gptq", "lora"]
    for number, stage in enumerate(summary["stages"], 1):
        assert f"[{number}/7] {stage} (" in out
    assert out.count("  command : ") == out.count("  inputs  : ") == out.count("  hardware: ") == 7
    assert "not stated in the config" not in out  # every stage names its hardware
    assert (
        "torchrun --nproc_per_node=8 -m evidence.train.train_drafter --base Qwen/Qwen3-1.7B --base-revision UNLOCKED"
        in out
    )
    assert all(check["ok"] for check in summary["checks"])
    assert "package inventory equals the declared one" in out
    assert "base Qwen/Qwen3-1.7B (revision None)" in " ".join(summary["unlocked"])  # shown, not invented


def test_plan_refuses_a_config_that_cannot_work(monkeypatch, tmp_path, capsys):
    no_network(monkeypatch)
    config = json.loads(QWEN3_CONFIG.read_text())
    config["gptq"]["group_size"] = 96  # divides neither 2,048 nor 6,144
    config["lora"]["target_modules"] = ["q_proj", "lm_head"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    with pytest.raises(common.UserError, match="fails 3 check"):
        run_pipeline.main(["--config", str(path), "--plan"])
    out = capsys.readouterr().out
    assert "FAIL group size divides" in out and "FAIL LoRA targets" in out and "FAIL package inventory" in out


class Prepacked:
    """GPTQ tensors already packed, standing in for gptq_drafter's QuantizedLinear (whose int64 weights at
    this shape would take 11 GB): package_tensors only asks it to pack()."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def pack(self) -> dict[str, torch.Tensor]:
        return self.tensors


LOAD_AND_DRAFT = """
import json, resource, sys, time
import torch
import draft_model

def timed(work):
    wall, cpu = time.perf_counter(), time.process_time()
    result = work()
    return result, round(time.perf_counter() - wall, 2), round(time.process_time() - cpu, 2)

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024

drafter, load_wall, load_cpu = timed(lambda: draft_model.load_model(sys.argv[1], "cpu", cache_slots=2, max_context=1024))
loaded_rss = rss_mb()
prompt = torch.randint(0, 151643, (128,), generator=torch.Generator().manual_seed(1)).tolist()
(cold,), cold_wall, cold_cpu = timed(lambda: draft_model.draft_batch(drafter, [prompt], max_tokens=16))
follow_up = prompt + list(cold)[:4] + [7]
(warm,), warm_wall, warm_cpu = timed(lambda: draft_model.draft_batch(drafter, [follow_up], max_tokens=16))
print(json.dumps({
    "threads": torch.get_num_threads(), "weights": drafter.weights,
    "load_wall_s": load_wall, "load_cpu_s": load_cpu, "rss_after_load_mb": loaded_rss,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    "draft16_after_128_prompt_wall_s": cold_wall, "draft16_after_128_prompt_cpu_s": cold_cpu,
    "draft16_cached_prefix_wall_s": warm_wall, "draft16_cached_prefix_cpu_s": warm_cpu,
    "cold_tokens": len(cold), "warm_tokens": len(warm),
}))
"""


@pytest.mark.slow
def test_full_shape_rehearsal_builds_loads_and_drafts(record, tmp_path):
    """A package at the exact Qwen3-1.7B shape from random weights, written by the pipeline's writers with
    qwen3.json's quantization and LoRA settings (round-to-nearest on int4's grid instead of GPTQ: the
    format and the inventory are the same), then loaded strictly by draft_model and drafting."""
    config = json.loads(QWEN3_CONFIG.read_text())
    gptq, lora = config["gptq"], config["lora"]
    torch.manual_seed(0)
    started = time.perf_counter()
    hf_config = AutoConfig.for_model(**record["full_scale"]["model"])
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    quantized = {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in PROJECTIONS:
            quantized[name] = Prepacked(int4.rtn_quantize(module.weight.float(), gptq["group_size"], sym=gptq["sym"]))
    settings = QuantSettings(
        gptq["group_size"], gptq["sym"], gptq["act_order"], gptq["damp_percent"], gptq["static_groups"]
    )
    package = tmp_path / "package"
    tensors = package_tensors(model, quantized, getattr(torch, gptq["store_dtype"]), embedding=None)
    card = {"name": "qwen3-1.7b-shape-rehearsal", "random_weights": True}
    write_package(package, model, tensors, quant_config(settings, 0, None), card)
    del tensors, quantized
    peft_model = add_lora(model, lora["rank"], lora["alpha"], lora["dropout"], list(PROJECTIONS))
    for name, parameter in peft_model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero; a non-zero adapter exercises the loader's LoRA path
            torch.nn.init.normal_(parameter, std=1e-3)
    write_adapter(peft_model, package, card["name"])
    built_s = time.perf_counter() - started
    del peft_model, model
    assert compact(file_inventory(package)) == record["full_scale"]["package_inventory"]

    # Loaded and drafted in a fresh process, so its memory is the drafter's alone, not the builder's leftovers.
    result = subprocess.run(
        [sys.executable, "-c", LOAD_AND_DRAFT, str(package)], cwd=ROOT, capture_output=True, text=True, timeout=3600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.splitlines()[-1])
    assert 1 <= figures["cold_tokens"] <= 16 and 1 <= figures["warm_tokens"] <= 16 and figures["weights"] == "packed"
    figures |= {"build_s": round(built_s, 1), "package_bytes": sum(p.stat().st_size for p in package.iterdir())}
    print("rehearsal:", json.dumps(figures))
