"""GPTQ (evidence/quantize/gptq_drafter.py) against round-to-nearest on real layer activations, and its
package tensors."""

import pytest
import torch
from tiny_models import make_hf_model

import int4
from evidence.quantize.gptq_drafter import (
    SEQUENTIAL_GROUPS,
    QuantSettings,
    collect_hessians,
    first_layer_inputs,
    gptq_quantize,
    packed_weight,
    rtn_quantize,
)

CALIBRATION, HELD_OUT = 48, 16


@pytest.fixture(scope="module")
def activations() -> dict:
    """Inputs of a real tiny Qwen3's first-layer projections on calibration and held-out sequences of
    Zipf-distributed tokens (as in text: a few tokens are frequent, which makes activations anisotropic)."""
    model = make_hf_model("qwen3", seed=21, hidden_size=128, intermediate_size=256, head_dim=32)
    generator = torch.Generator().manual_seed(0)
    zipf = 1.0 / torch.arange(1, 257).float()
    sequences = [
        torch.multinomial(zipf, 48, replacement=True, generator=generator) for _ in range(CALIBRATION + HELD_OUT)
    ]
    layer = model.model.layers[0]
    captured: dict[str, list[torch.Tensor]] = {"mlp.down_proj": [], "self_attn.q_proj": [], "mlp.gate_proj": []}
    hooks = [
        layer.get_submodule(name).register_forward_pre_hook(
            lambda m, a, name=name: captured[name].append(a[0].reshape(-1, a[0].shape[-1]))
        )
        for name in captured
    ]
    with torch.no_grad():
        for sequence in sequences:
            model(sequence[None])
    for hook in hooks:
        hook.remove()
    calibration_inputs = first_layer_inputs(model, sequences[:CALIBRATION])  # the pipeline's own capture path
    hessians = collect_hessians(layer, tuple(captured), calibration_inputs)
    return {
        "layer": layer,
        "hessians": hessians,
        "held_out": {name: torch.cat(xs[CALIBRATION:]) for name, xs in captured.items()},
    }


def output_error(x: torch.Tensor, weight: torch.Tensor, quantized: torch.Tensor) -> float:
    return float(((x @ (weight - quantized).t()) ** 2).mean())


@pytest.mark.parametrize("name", ["mlp.down_proj", "self_attn.q_proj", "mlp.gate_proj"])
@pytest.mark.parametrize(
    "settings",
    [
        QuantSettings(32, True, False),
        QuantSettings(32, False, False),
        QuantSettings(64, True, True),
        QuantSettings(32, True, True, static_groups=True),
    ],
    ids=["sym", "asym", "sym-act-order-g64", "sym-act-order-static-groups"],
)
def test_gptq_beats_round_to_nearest_on_held_out_activations(activations, name, settings):
    weight = activations["layer"].get_submodule(name).weight.detach()
    held_out = activations["held_out"][name]
    gptq = gptq_quantize(weight, activations["hessians"][name], settings)
    rtn = rtn_quantize(weight, settings)
    gptq_error, rtn_error = (
        output_error(held_out, weight, gptq.dequantize()),
        output_error(held_out, weight, rtn.dequantize()),
    )
    assert gptq_error < 0.85 * rtn_error, (gptq_error, rtn_error)


def test_package_tensors_mean_the_gptq_weights(activations):
    """Packed with int4.gptq_pack and read back with gptq_dequantize: exactly the weights GPTQ
    produced; with act-order each group still holds group_size columns, in their original places."""
    weight = activations["layer"].mlp.down_proj.weight.detach()
    result = gptq_quantize(weight, activations["hessians"]["mlp.down_proj"], QuantSettings(32, False, True))
    packed = result.pack()
    assert packed["qweight"].shape == (weight.shape[1] // 8, weight.shape[0]) and packed["qweight"].dtype == torch.int32
    assert packed["scales"].dtype == torch.float16 and packed["g_idx"].dtype == torch.int32
    torch.testing.assert_close(packed_weight(result), result.dequantize(), rtol=0, atol=0)
    torch.testing.assert_close(int4.gptq_dequantize(**packed), result.dequantize(), rtol=0, atol=0)
    assert torch.bincount(result.g_idx).tolist() == [32] * (weight.shape[1] // 32)
    assert not torch.equal(result.g_idx, torch.arange(weight.shape[1]) // 32)  # act-order really reordered


def test_static_groups_keep_consecutive_groups(activations):
    weight = activations["layer"].mlp.down_proj.weight.detach()
    settings = QuantSettings(32, True, act_order=True, static_groups=True)
    result = gptq_quantize(weight, activations["hessians"]["mlp.down_proj"], settings)
    assert torch.equal(result.g_idx, torch.arange(weight.shape[1]) // 32)
    # the grids are round-to-nearest's (fixed before error feedback); the integer weights are not
    rtn = rtn_quantize(weight, settings)
    assert torch.equal(result.scales, rtn.scales) and torch.equal(result.zeros, rtn.zeros)
    assert not torch.equal(result.int_weight, rtn.int_weight)


def test_symmetric_zero_is_stored_as_seven(activations):
    weight = activations["layer"].self_attn.q_proj.weight.detach()
    packed = gptq_quantize(weight, activations["hessians"]["self_attn.q_proj"], QuantSettings(32, True, False)).pack()
    assert set(int4.unpack_int4(packed["qzeros"], dim=1).unique().tolist()) == {7}


def weight_with_awkward_groups(out_features: int = 16, in_features: int = 128, group_size: int = 32) -> torch.Tensor:
    """A weight whose groups include one all zero (a flat group) and one far below fp16's normal range."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(3))
    weight[:, :group_size] = 0  # flat: every row's first group
    weight[:, group_size : 2 * group_size] *= 1e-7  # tiny: (max - min) / 15 underflows fp16
    return weight


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_every_writer_and_the_loader_share_one_grid(sym):
    """GPTQ, the RTN baseline and the embedding / lm_head quantizer (int4.rtn_quantize) use int4's one grid:
    with a diagonal Hessian GPTQ has no error to feed forward, so all three write the same tensors; flat
    and tiny groups get fp16-normal scales and dequantize to (about) the weights, never inf or nan."""
    weight = weight_with_awkward_groups()
    settings = QuantSettings(32, sym, act_order=False)
    gptq = gptq_quantize(weight, torch.eye(weight.shape[1]), settings)
    rtn = rtn_quantize(weight, settings)
    written = int4.rtn_quantize(weight, 32, sym=sym)
    for result in (gptq, rtn):
        for kind, tensor in result.pack().items():
            assert torch.equal(tensor, written[kind]), kind
    loaded = int4.gptq_dequantize(**written)
    assert torch.equal(loaded, gptq.dequantize()) and torch.isfinite(loaded).all()
    assert (written["scales"].float() >= int4.MIN_SCALE).all()
    assert torch.equal(loaded[:, :32], torch.zeros(16, 32))  # the flat group comes back exactly
    assert (loaded[:, 32:64] - weight[:, 32:64]).abs().max() <= int4.MIN_SCALE  # the tiny one within a step
    q, zeros = int4.gptq_integers(written["qweight"], written["qzeros"], "gptq")
    assert torch.equal(int4.dequantize(q.t(), zeros, written["scales"], written["g_idx"]), loaded)


def test_a_gptq_package_loads_as_the_weights_gptq_wrote(tmp_path):
    """The pipeline's writer (gptq_drafter.package_tensors / write_package) and draft_model's loader agree:
    every projection of a package loads, densely, as exactly the GPTQ weights, flat groups included."""
    import draft_model
    from evidence.quantize.gptq_drafter import package_tensors, quant_config, write_package

    model = make_hf_model("qwen3", seed=5)
    quantized = {}
    for index in range(len(model.model.layers)):
        for name in (f"model.layers.{index}.{part}" for group in SEQUENTIAL_GROUPS for part in group):
            weight = model.get_submodule(name).weight.detach().clone()
            weight[:, :32] = 0  # a flat group in every row
            quantized[name] = gptq_quantize(weight, torch.eye(weight.shape[1]), QuantSettings(32, True, True))
    settings = QuantSettings(32, True, True)
    tensors = package_tensors(model, quantized, torch.float32, embedding=None)
    write_package(tmp_path / "package", model, tensors, quant_config(settings, 0, None), {"name": "test"})
    drafter = draft_model.load_model(tmp_path / "package", "cpu", torch.float32, weights="dequant", use_lora=False)
    state = drafter.hf_state_dict()
    for name, result in quantized.items():
        torch.testing.assert_close(state[f"{name}.weight"], result.dequantize(), rtol=0, atol=0)


def test_gptq_table_beats_round_to_nearest_on_held_out_logits():
    """The tied table as the lm_head: GPTQ with the Hessian of the head's inputs (the pipeline's own
    head_hessian) gives smaller held-out logit errors than round-to-nearest, on int4's grid both."""
    from evidence.quantize.gptq_drafter import head_hessian, quantize_embedding

    model = make_hf_model("qwen3", seed=22, hidden_size=128, intermediate_size=256, head_dim=32)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(1)
    zipf = 1.0 / torch.arange(1, 257).float()
    sequences = [torch.multinomial(zipf, 48, replacement=True, generator=generator) for _ in range(64)]
    hessian, held_out = head_hessian(model, sequences[:48]), []
    hook = model.lm_head.register_forward_pre_hook(lambda m, a: held_out.append(a[0].reshape(-1, 128)))
    with torch.no_grad():
        for sequence in sequences[48:]:
            model(sequence[None])
    hook.remove()
    x, table = torch.cat(held_out), model.lm_head.weight.detach().clone()
    errors = {}
    for method, h in (("rtn", None), ("gptq", hessian)):
        model.get_input_embeddings().weight.data.copy_(table)
        written = quantize_embedding(model, 32, h)
        assert torch.equal(written["g_idx"], torch.arange(128, dtype=torch.int32) // 32)  # the kernel's layout
        assert torch.equal(int4.gptq_dequantize(**written), model.lm_head.weight)  # the table is what was written
        errors[method] = output_error(x, table, int4.gptq_dequantize(**written))
    assert errors["gptq"] < 0.85 * errors["rtn"], errors
