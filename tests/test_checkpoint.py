"""Loading checkpoints and packages against their formats: GPTQ INT4 (and the CPU kernel's layout), PEFT LoRA
adapters, the INT4 table, sharded checkpoints, and every way a package can be broken."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import (
    add_peft_adapter,
    forward_all,
    gptq_quant_config,
    make_hf_model,
    quantize_into,
    random_rows,
    reference_greedy,
    write_gptq_checkpoint,
    write_hf_checkpoint,
    write_package_with_int4_embedding,
)

import draft_model
import int4
import transformer


def test_int4_packing_is_low_nibble_first_and_round_trips():
    nibbles = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    packed = int4.pack_int4(nibbles[:, None], dim=0)
    assert packed.dtype == torch.int32 and packed.item() == 0x87654321 - 2**32
    values = torch.randint(0, 16, (16, 24))
    for dim in (0, 1):
        assert torch.equal(int4.unpack_int4(int4.pack_int4(values, dim), dim), values)


def test_v1_checkpoints_store_zero_minus_one():
    ints = torch.randint(0, 16, (8, 32))
    zeros = torch.full((1, 8), 8)
    tensors = int4.gptq_pack(ints, zeros, torch.ones(1, 8), torch.zeros(32, dtype=torch.int32))
    assert tensors["qzeros"].item() == 0x77777777  # every symmetric zero 8 stored as 7
    asymmetric = int4.gptq_pack(
        ints, torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8), torch.zeros(32, dtype=torch.int32)
    )
    assert asymmetric["qzeros"].item() == -1  # zero 0 is stored as 15 in every nibble
    weight = int4.gptq_dequantize(**asymmetric)
    assert torch.equal(weight, ints.float())


GPTQ_CASES = [
    dict(group_size=32, sym=True, desc_act=False, as_package=True),
    dict(group_size=64, sym=False, desc_act=False, as_package=False),
    dict(group_size=32, sym=False, desc_act=True, as_package=True),
    dict(group_size=128, sym=True, desc_act=True, as_package=False),
]


@pytest.mark.parametrize("case", GPTQ_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_gptq_checkpoint_loads_to_the_weights_the_format_defines(tmp_path, case):
    hf_model = make_hf_model(
        "qwen3", hidden_size=128, intermediate_size=256, head_dim=32, tie_word_embeddings=case["sym"]
    )
    gptq = quantize_into(hf_model, case["group_size"], case["sym"], case["desc_act"], seed=10)
    quant_config = gptq_quant_config(group_size=case["group_size"], sym=case["sym"], desc_act=case["desc_act"])
    write_gptq_checkpoint(hf_model, tmp_path, gptq, quant_config, as_package=case["as_package"])
    drafter = draft_model.load_model(tmp_path, cache_slots=4, weights="dequant")
    assert drafter.dtype == torch.float32 and drafter.weights == "dense"
    reference = hf_model.state_dict()
    loaded = drafter.hf_state_dict()  # the fused q/k/v and gate/up weights split back under their names
    assert loaded.keys() - reference.keys() <= {"lm_head.weight"}  # a tied head may be left out of the reference
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name
    assert drafter.quantization["group_size"] == case["group_size"]
    row = random_rows([50], seed=11)[0]
    assert draft_model.draft_batch(drafter, [row], max_tokens=12)[0] == reference_greedy(hf_model, row, 12)


@pytest.fixture
def gptq_package(tmp_path):
    hf_model = make_hf_model("qwen3")
    gptq = quantize_into(hf_model, 32, True, False, seed=12)
    write_gptq_checkpoint(hf_model, tmp_path / "package", gptq, gptq_quant_config(group_size=32), as_package=True)
    return hf_model, tmp_path / "package"


@pytest.mark.parametrize(
    "damage,message",
    [
        ("missing", "missing tensor 'model.layers.1.mlp.down_proj.scales'"),
        ("unexpected", "unexpected tensor 'model.layers.0.extra.weight'"),
        ("misshaped", r"tensor 'model.layers.0.self_attn.q_proj.qweight' has shape \[4, 64\], expected \[8, 64\]"),
    ],
)
def test_damaged_checkpoints_are_refused_naming_the_tensor(gptq_package, damage, message):
    _, directory = gptq_package
    path = directory / "model_int4.safetensors"
    tensors = load_file(path)
    if damage == "missing":
        del tensors["model.layers.1.mlp.down_proj.scales"]
    elif damage == "unexpected":
        tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    else:
        tensors["model.layers.0.self_attn.q_proj.qweight"] = tensors["model.layers.0.self_attn.q_proj.qweight"][:4]
    save_file(tensors, path)
    with pytest.raises(draft_model.ModelLoadError, match=message):
        draft_model.load_model(directory)


def test_unsupported_quantization_is_refused(gptq_package):
    _, directory = gptq_package
    (directory / "quant_config.json").write_text(json.dumps({"quant_method": "gptq", "bits": 8, "group_size": 32}))
    with pytest.raises(draft_model.ModelLoadError, match="bits 8 is not supported"):
        draft_model.load_model(directory)


# ---- LoRA from a PEFT adapter


@pytest.mark.parametrize(
    "overrides", [dict(), dict(use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])]
)
def test_lora_matches_peft_merged_and_unmerged(tmp_path, overrides):
    hf_model = make_hf_model("qwen3", tie_word_embeddings=False)
    directory = write_hf_checkpoint(hf_model, tmp_path / "model")
    peft_model = add_peft_adapter(hf_model, directory, **overrides)
    tokens = random_rows([40], seed=14)[0]
    with torch.no_grad():
        expected = peft_model(torch.tensor([tokens])).logits[0]
    unmerged = draft_model.load_model(directory, cache_slots=2, merge_lora=False)
    merged = draft_model.load_model(directory, cache_slots=2)
    # down_proj: adapted alone; gate/up: both adapted, fused into one LoRALinear
    assert isinstance(
        unmerged.model.layers[0].mlp.down_proj if not overrides else unmerged.model.layers[0].mlp.gate_up_proj,
        transformer.LoRALinear,
    )
    assert unmerged.lora_rank == merged.lora_rank == 4
    assert (forward_all(unmerged, tokens) - expected).abs().max() <= 1e-4
    assert (forward_all(merged, tokens) - expected).abs().max() <= 1e-4
    assert draft_model.draft_batch(merged, [tokens], 12) == draft_model.draft_batch(unmerged, [tokens], 12)


def test_gptq_package_with_lora_matches_peft_on_the_dequantized_model(gptq_package):
    hf_model, directory = gptq_package
    peft_model = add_peft_adapter(hf_model, directory)
    drafter = draft_model.load_model(directory, cache_slots=2, weights="dequant")
    tokens = random_rows([30], seed=15)[0]
    with torch.no_grad():
        expected = peft_model(torch.tensor([tokens])).logits[0]
    assert (forward_all(drafter, tokens) - expected).abs().max() <= 1e-4


def test_lora_adapter_with_wrong_shapes_is_refused(gptq_package):
    hf_model, directory = gptq_package
    add_peft_adapter(hf_model, directory)
    tensors = load_file(directory / "lora.safetensors")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[name] = tensors[name][:2]
    save_file(tensors, directory / "lora.safetensors")
    with pytest.raises(
        draft_model.ModelLoadError,
        match=r"lora.safetensors: tensor '.*q_proj.lora_A.weight' has shape \[2, 64\], expected \[4, 64\]",
    ):
        draft_model.load_model(directory)


# ---- packed INT4 path (PyTorch's CPU kernel, bf16 activations)


def test_int4_kernel_layer_computes_the_gptq_weights():
    generator = torch.Generator().manual_seed(16)
    out_features, in_features, group_size = 64, 128, 32
    ints = torch.randint(0, 16, (out_features, in_features), generator=generator)
    zeros = torch.randint(0, 16, (in_features // group_size, out_features), generator=generator)
    scales = torch.rand(in_features // group_size, out_features, generator=generator) * 0.03 + 0.005
    gptq = int4.gptq_pack(ints, zeros, scales, torch.arange(in_features) // group_size)
    layer = int4.Int4Linear(in_features, out_features, group_size, bias=False)
    layer.load_state_dict(int4.Int4Linear.pack_gptq(**gptq, checkpoint_format="gptq"), assign=True)
    x = torch.randn(3, 5, in_features, generator=generator)
    expected = x @ int4.gptq_dequantize(**gptq).t()
    error = (layer(x.bfloat16()).float() - expected).abs().max() / expected.abs().max()
    assert error < 2e-2, f"relative error {error:.4f}: the layout conversion is wrong, not just bf16 rounding"


def test_long_prefills_unpack_the_int4_layer_to_the_same_weights():
    """The kernel's packed layout is PyTorch-internal: the check that reads it must hold on this torch."""
    assert int4.kernel_layout_is_known()
    generator = torch.Generator().manual_seed(29)
    out_features, in_features, group_size = 128, 256, 64
    gptq = int4.rtn_quantize(torch.randn(out_features, in_features, generator=generator), group_size, sym=False)
    layer = int4.Int4Linear(in_features, out_features, group_size, bias=False)
    layer.load_state_dict(int4.Int4Linear.pack_gptq(**gptq, checkpoint_format="gptq"), assign=True)
    assert layer.dense_prefill
    rows = torch.randn(64, in_features, generator=generator).bfloat16()
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, layer.packed_weight, group_size, layer.scales_and_offsets)
    assert torch.equal(layer(rows), kernel)
    dense = layer(rows, dense_rows=len(rows))
    assert (dense.float() - kernel.float()).abs().max() / kernel.float().abs().max() < 1e-2
    expected = int4.gptq_dequantize(**gptq)
    assert (layer.dense_weight().float() - expected).abs().max() <= 2e-2 * expected.abs().max()  # bf16 scales


def test_packed_path_is_the_cpu_default_and_drafts_like_dense(gptq_package):
    hf_model, directory = gptq_package
    packed = draft_model.load_model(directory, cache_slots=4)
    dense = draft_model.load_model(directory, cache_slots=4, weights="dequant")
    assert (packed.weights, packed.dtype) == ("packed", torch.bfloat16)
    assert (dense.weights, dense.dtype) == ("dense", torch.float32)
    assert packed.weight_bytes() < dense.weight_bytes()
    rows = random_rows([20, 45, 90], seed=17)
    packed_drafts = draft_model.draft_batch(packed, rows, max_tokens=16)
    dense_drafts = draft_model.draft_batch(dense, rows, max_tokens=16)
    # bf16 activations may flip a near-tie late in a draft; the first tokens must agree.
    assert all(p[:4] == d[:4] for p, d in zip(packed_drafts, dense_drafts))
    # The packed path obeys the same exactness rules as the dense one: batching and caching change nothing.
    assert [draft_model.draft_batch(packed, [row], max_tokens=16)[0] for row in rows] == packed_drafts


def test_packed_lora_stays_unmerged_beside_int4(gptq_package):
    hf_model, directory = gptq_package
    peft_model = add_peft_adapter(hf_model, directory)
    drafter = draft_model.load_model(directory, cache_slots=2)
    qkv_proj = drafter.model.layers[0].self_attn.qkv_proj  # q, k and v fused: one LoRA pair beside INT4 bases
    assert isinstance(qkv_proj, transformer.LoRALinear) and any(
        isinstance(m, int4.Int4Linear) for m in qkv_proj.base.modules()
    )
    tokens = random_rows([30], seed=18)[0]
    with torch.no_grad():
        expected = peft_model(torch.tensor([tokens])).logits[0]
    error = (forward_all(drafter, tokens) - expected).abs().max() / expected.abs().max()
    assert error < 5e-2


def test_fused_projections_compute_what_their_parts_do():
    """q, k and v (and gate and up) become one module at load: one INT4 kernel call and one LoRA pair."""
    generator = torch.Generator().manual_seed(41)
    in_features, group_size, rank = 128, 32, 4
    parts = []
    for out_features in (128, 64, 64):
        layer = int4.Int4Linear(in_features, out_features, group_size, bias=False)
        gptq = int4.rtn_quantize(torch.randn(out_features, in_features, generator=generator), group_size, sym=False)
        layer.load_state_dict(int4.Int4Linear.pack_gptq(**gptq, checkpoint_format="gptq"), assign=True)
        parts.append(layer)
    # The first and last parts carry adapters, the middle one none (a target_modules subset).
    parts[0], parts[2] = (
        transformer.LoRALinear(
            p,
            torch.randn(rank, in_features, generator=generator),
            torch.randn(p.out_features, rank, generator=generator),
            0.5,
        )
        for p in (parts[0], parts[2])
    )
    fused = transformer.concat_outputs(parts)
    assert isinstance(fused, transformer.LoRALinear) and isinstance(fused.base, int4.Int4Linear)
    x = torch.randn(64, in_features, generator=generator).bfloat16()
    for dense_rows in (0, 64):  # the kernel's path and the unpacked one
        expected = torch.cat([part(x, dense_rows) for part in parts], dim=-1)
        torch.testing.assert_close(fused(x, dense_rows), expected, rtol=1e-2, atol=1e-2)  # fp32 side matmuls
        unadapted = slice(128, 192)
        assert torch.equal(fused(x, dense_rows)[:, unadapted], parts[1](x, dense_rows))  # an empty block of B
    dense = [torch.nn.Linear(in_features, n, bias=True) for n in (96, 32)]
    fused_dense = transformer.concat_outputs(dense)
    assert isinstance(fused_dense, torch.nn.Linear)
    x = torch.randn(3, in_features, generator=generator)
    torch.testing.assert_close(fused_dense(x), torch.cat([d(x) for d in dense], dim=-1), rtol=1e-6, atol=1e-6)
    mixed = transformer.concat_outputs([dense[0], parts[1]])  # a dense fallback beside an INT4 layer
    assert isinstance(mixed, transformer.Concat)


def test_act_order_layers_fall_back_to_dense(tmp_path, caplog):
    hf_model = make_hf_model("qwen3")
    gptq = quantize_into(hf_model, 32, True, True, seed=19)
    quant_config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": True}
    write_gptq_checkpoint(hf_model, tmp_path, gptq, quant_config, as_package=True)
    drafter = draft_model.load_model(tmp_path, cache_slots=2)
    assert drafter.weights == "dense" and drafter.dtype == torch.bfloat16
    assert "act-order g_idx reorders groups" in caplog.text
    with pytest.raises(draft_model.ModelLoadError, match="needs bfloat16 activations"):
        draft_model.load_model(tmp_path, dtype="float32", weights="packed")


def test_rtn_quantize_stays_within_half_a_step_of_the_weights():
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(21))
    for sym in (True, False):
        gptq = int4.rtn_quantize(weight, group_size=32, sym=sym)
        step = gptq["scales"].float().t().repeat_interleave(32, dim=1)  # (N, K): each weight's grid step
        assert ((int4.gptq_dequantize(**gptq) - weight).abs() <= 0.51 * step).all()  # fp16 scales: a hair over 1/2


def test_int4_lm_head_keeps_the_embedding_and_drafts(gptq_package):
    _, directory = gptq_package
    plain = draft_model.load_model(directory, cache_slots=2)
    quantized = draft_model.load_model(directory, cache_slots=2, quantize_lm_head=True)
    assert isinstance(quantized.model.lm_head, int4.Int4Linear)
    assert torch.equal(quantized.model.embed_tokens.weight, plain.model.embed_tokens.weight)
    hidden = torch.randn(5, plain.cfg.hidden_size, generator=torch.Generator().manual_seed(22))
    rounded = int4.gptq_dequantize(**int4.rtn_quantize(plain.model.lm_head.weight, 64, sym=False))
    expected = hidden @ rounded.t()
    error = (quantized.model.lm_head(hidden.bfloat16()).float() - expected).abs().max() / expected.abs().max()
    assert error < 2e-2
    with pytest.raises(draft_model.ModelLoadError, match="quantize_lm_head needs the packed INT4 path"):
        draft_model.load_model(directory, weights="dequant", quantize_lm_head=True)


def test_quantized_embedding_is_one_int4_table_for_both_ends(tmp_path):
    hf_model = make_hf_model("qwen3")
    write_package_with_int4_embedding(hf_model, tmp_path, seed=31)
    dense = draft_model.load_model(tmp_path, cache_slots=4, weights="dequant")
    assert torch.equal(dense.model.embed_tokens.weight, hf_model.model.embed_tokens.weight)
    rows = random_rows([20, 45], seed=32)
    dense_drafts = draft_model.draft_batch(dense, rows, max_tokens=12)
    assert dense_drafts == [reference_greedy(hf_model, row, 12) for row in rows]

    packed = draft_model.load_model(tmp_path, cache_slots=4)
    assert packed.model.embed_tokens is None and isinstance(packed.model.lm_head, int4.Int4Linear)
    assert packed.quantization["embedding_group_size"] == 32
    vocab, hidden = packed.vocab_size, packed.cfg.hidden_size
    assert not any(
        t.numel() == vocab * hidden and t.is_floating_point()
        for t in [*packed.model.parameters(), *packed.model.buffers()]
    )
    ids = torch.tensor([[0, 5, 63, 64], [127, 200, 255, 31]])
    looked_up = packed.model.embed(ids).float()  # (2, 4, hidden) read from the packed head
    assert torch.allclose(looked_up, packed.model.lm_head.dense_weight()[ids].float())
    assert (
        looked_up - hf_model.model.embed_tokens.weight[ids]
    ).abs().max() <= 1e-2 * hf_model.model.embed_tokens.weight.abs().max()
    packed_drafts = draft_model.draft_batch(packed, rows, max_tokens=12)
    assert all(p[:4] == d[:4] for p, d in zip(packed_drafts, dense_drafts))  # bf16 may flip a late near-tie


def test_quantized_embedding_needs_a_tied_table(tmp_path):
    hf_model = make_hf_model("qwen3", tie_word_embeddings=False)
    write_package_with_int4_embedding(hf_model, tmp_path, seed=33)
    with pytest.raises(draft_model.ModelLoadError, match="quantized_embedding needs tie_word_embeddings"):
        draft_model.load_model(tmp_path)


def test_sharded_checkpoint_and_generation_config_eos(tmp_path):
    hf_model = make_hf_model("llama", tie_word_embeddings=False)
    hf_model.generation_config.eos_token_id = [2, 7]
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    drafter = draft_model.load_model(tmp_path, cache_slots=2)
    assert drafter.eos_token_ids == (2, 7)
    row = random_rows([12], seed=23)[0]
    assert draft_model.draft_batch(drafter, [row], max_tokens=10)[0] == reference_greedy(hf_model, row, 10)


@pytest.mark.parametrize(
    "damage,message",
    [
        ("group_size", "group_size -1 is not supported"),
        ("lora_without_weights", "lora.safetensors: missing"),
        ("corrupt_weights", "not a readable safetensors file"),
        ("int_norm", "'model.norm.weight' has dtype torch.int64, expected a floating-point dtype"),
    ],
)
def test_broken_packages_are_refused_with_a_load_error(gptq_package, damage, message):
    _, directory = gptq_package
    if damage == "group_size":
        (directory / "quant_config.json").write_text(json.dumps({"quant_method": "gptq", "bits": 4, "group_size": -1}))
    elif damage == "lora_without_weights":
        (directory / "lora_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    elif damage == "corrupt_weights":
        (directory / "model_int4.safetensors").write_bytes(b"not safetensors")
    else:
        tensors = load_file(directory / "model_int4.safetensors")
        tensors["model.norm.weight"] = tensors["model.norm.weight"].long()
        save_file(tensors, directory / "model_int4.safetensors")
    with pytest.raises(draft_model.ModelLoadError, match=message):
        draft_model.load_model(directory)
