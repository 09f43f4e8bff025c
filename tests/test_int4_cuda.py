"""Packed INT4 on CUDA, checked without a GPU: the repacking is pure functions tested on exact integers, and
the loader's wiring is checked with the two CUDA-only operators recorded. The kernel's numbers are the GPU
check's business (evidence/bench/gpu_check.py)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import int4

MODEL = Path(__file__).resolve().parent.parent / "model"


def load_model_package_packed() -> checkpoint.LoadedWeights:
    return checkpoint.load_weights(
        MODEL, "cpu", None, merge_lora=False, use_lora=True, weights="packed", quantize_lm_head=False
    )


def test_nibble_pairs_put_even_inputs_in_the_high_nibble_and_round_trip():
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]])
    assert int4.nibble_pairs(q).tolist() == [[0x12, 0x34], [0xF0, 0x0F]]
    values = torch.randint(0, 16, (96, 256), generator=torch.Generator().manual_seed(5))
    assert torch.equal(int4.unpack_nibble_pairs(int4.nibble_pairs(values)), values)


def test_the_cuda_kernel_input_decodes_back_to_the_gptq_integers():
    """model/'s GPTQ tensors -> the CPU kernel layout -> the CUDA kernel's plain input -> the same integers."""
    tensors = load_file(MODEL / "model_int4.safetensors")
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj"):
        parts = {p: tensors[f"{name}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")}
        out_features, in_features = parts["scales"].shape[1], parts["g_idx"].shape[0]
        assert int4.cuda_unsupported(in_features, out_features) is None
        layer = int4.Int4Linear(in_features, out_features, 64, bias=False)
        layer.load_state_dict(int4.Int4Linear.pack_gptq(**parts, checkpoint_format="gptq"), assign=True)
        gptq_ints, _ = int4.gptq_integers(parts["qweight"], parts["qzeros"], "gptq")  # (K, N)
        pairs = int4.nibble_pairs(layer.integers())
        assert pairs.dtype == torch.uint8 and pairs.shape == (out_features, in_features // 2)
        assert torch.equal(int4.unpack_nibble_pairs(pairs), gptq_ints.t())


def test_a_packed_model_hands_the_cuda_kernel_its_layout(monkeypatch):
    """Every Int4Linear of model/ (fused q/k/v and gate/up, the INT4 head) is repacked through the CUDA
    conversion op and then multiplies through the CUDA kernel; the tied INT4 table becomes a dense embedding
    of the same rows. The two CUDA-only operators are recorded here, their shape rules run on meta tensors."""
    converted, multiplied = [], []
    meta_convert = torch.ops.aten._convert_weight_to_int4pack.default

    def convert(pairs, tiles):
        converted.append((pairs.dtype, tuple(pairs.shape), tiles))
        return meta_convert(pairs.to("meta"), tiles)

    def multiply(x, packed, group_size, scales_and_offsets):
        multiplied.append((x.dtype, tuple(packed.shape), group_size))
        return torch.zeros(x.shape[0], scales_and_offsets.shape[1], dtype=x.dtype)

    loaded = load_model_package_packed()
    model, cfg = loaded.model, loaded.cfg
    assert model.embed_tokens is None  # model/ keeps one INT4 table for both ends on the CPU
    ids = torch.tensor([0, 7, 4095])
    expected_rows = model.embed(ids)
    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack", convert)
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm", multiply)
    model.use_cuda_int4_kernels()
    assert torch.equal(model.embed(ids), expected_rows)
    layers = [m for m in model.modules() if isinstance(m, int4.Int4Linear)]
    assert len(layers) == len(converted) == 4 * cfg.num_layers + 1  # qkv, o, gate_up, down per layer; the head
    for layer, (dtype, shape, tiles) in zip(layers, converted):
        assert dtype == torch.uint8 and shape == (layer.out_features, layer.in_features // 2)
        assert layer.on_cuda_kernel and not layer.dense_prefill
        assert layer.packed_weight.shape == (layer.out_features // 8, layer.in_features // (16 * tiles), 32, tiles // 2)
        rows = torch.zeros(3, layer.in_features, dtype=torch.bfloat16)
        assert layer(rows, dense_rows=3).shape == (3, layer.out_features)  # no dense rows on the CUDA kernel
        assert multiplied.pop() == (torch.bfloat16, tuple(layer.packed_weight.shape), layer.group_size)
    with pytest.raises(RuntimeError, match="tiled for the CUDA kernel"):
        model.lm_head.dense_weight()


@pytest.mark.parametrize(
    "capability,packed,message",
    [((9, 0), True, None), ((8, 0), True, None), ((7, 5), False, "compute capability 8.0 or newer, not 7.5")],
)
def test_cuda_runs_packed_int4_from_compute_capability_8(monkeypatch, capability, packed, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    quant = checkpoint.read_layout(MODEL).quant
    device, dtype, chosen = checkpoint.resolve_runtime("cuda", None, "auto", quant)
    assert (device.type, dtype, chosen) == ("cuda", torch.bfloat16, packed)
    if message:
        with pytest.raises(checkpoint.ModelLoadError, match=message):
            checkpoint.resolve_runtime("cuda", None, "packed", quant)


def test_layers_the_cuda_kernel_cannot_take_say_why():
    assert "multiples of 32" in int4.cuda_unsupported(48, 64)
    assert "64-row blocks" in int4.cuda_unsupported(64, 80)
    assert int4.cuda_unsupported(2048, 1024) is None
