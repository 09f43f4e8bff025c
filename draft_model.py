"""The drafter: a Qwen3 / Llama / Qwen2 decoder in plain PyTorch that turns token ids into greedy drafts.

Read top to bottom: config -> primitives (RMSNorm, RoPE) -> GPTQ INT4 and LoRA linear layers ->
attention, MLP, block -> model -> loading a package -> KV-cache pool and greedy decoding.

    drafter = load_model("model/")
    drafts = draft_batch(drafter, [[1, 2, 3], [4, 5]], max_tokens=16)   # [[...], [...]]
    drafts[0].cached_tokens                                            # prompt tokens reused from the cache

One forward serves prefill and decode: new tokens' keys/values are written into a preallocated cache
slot by index, then every query attends to its slot up to its own position. Prefix reuse is exact:
a slot is matched to a request by token equality, and KV beyond the matched prefix is never read.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# Config

SUPPORTED_ARCHITECTURES = ("qwen3", "llama", "qwen2")
DEFAULT_MAX_CONTEXT = 4096  # KV-cache length per slot when the caller does not choose one


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3 normalises q and k per head before RoPE
    qkv_bias: bool  # Qwen2 (and attention_bias=True) adds biases to q/k/v
    o_bias: bool  # attention_bias=True (Llama/Qwen3) also biases o_proj
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: dict, generation_config: dict | None = None) -> "ModelConfig":
        """Read a Hugging Face config.json dict; refuse features this forward does not implement."""
        _require(hf, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"), "config.json")
        architecture = hf.get("model_type")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"config.json: model_type {architecture!r} is not supported; expected one of {SUPPORTED_ARCHITECTURES}")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelLoadError(f"config.json: rope_type {rope_type!r} is not supported; only 'default' RoPE is implemented")
        if hf.get("use_sliding_window"):
            raise ModelLoadError("config.json: use_sliding_window=true is not supported; only full attention is implemented")
        if hf.get("mlp_bias"):
            raise ModelLoadError("config.json: mlp_bias=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported; the MLP is SwiGLU ('silu')")
        attention_bias = bool(hf.get("attention_bias", False))
        eos_ids = _as_id_tuple(hf.get("eos_token_id")) + _as_id_tuple((generation_config or {}).get("eos_token_id"))
        num_heads = hf["num_attention_heads"]
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            max_position_embeddings=hf.get("max_position_embeddings", DEFAULT_MAX_CONTEXT),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qk_norm=architecture == "qwen3",
            qkv_bias=architecture == "qwen2" or attention_bias,
            o_bias=architecture != "qwen2" and attention_bias,
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),  # union, order kept, no repeats
        )


def _require(raw: dict, keys: tuple[str, ...], source) -> None:
    missing = [key for key in keys if key not in raw]
    if missing:
        raise ModelLoadError(f"{source}: missing field {missing[0]!r} (required: {', '.join(keys)})")


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


# ----------------------------------------------------------------------------------------------
# Primitives


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability, cast back, then scale (the order transformers uses).
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for the half-split RoPE form. positions (B, T) -> two (B, T, 1, head_dim) tensors."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq  # (B, T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]  # (B, T, 1, head_dim), broadcast over heads
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D): rotate each (i, i + D/2) pair by its position's angle."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------------------------
# GPTQ INT4 layout (pure functions: the loader uses them now, evidence/gptq_drafter.py to write)
#
# Per Linear with K inputs, N outputs, group size G:  qweight int32 [K/8, N] (packed along inputs),
# qzeros int32 [K/G, N/8] (packed along outputs), scales fp16 [K/G, N], g_idx int32 [K].
# Nibble j of an int32 holds bits 4j..4j+3. W[n, k] = scales[g[k], n] * (q[k, n] - zero[g[k], n]).
# "gptq" (v1) checkpoints store zero - 1 (masked to 4 bits); "gptq_v2" stores the zero itself.

NIBBLES_PER_INT32 = 8
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack 4-bit values (0..15) eight to an int32 along `dim`, lowest nibble first."""
    values = values.movedim(dim, 0).to(torch.int64)
    if values.shape[0] % NIBBLES_PER_INT32:
        raise ValueError(f"pack_int4: size {values.shape[0]} along dim {dim} is not a multiple of 8")
    if values.numel() and (values.min() < 0 or values.max() > 15):
        raise ValueError("pack_int4: values must lie in 0..15")
    groups = values.reshape(-1, NIBBLES_PER_INT32, *values.shape[1:])  # (n/8, 8, ...)
    shifts = (4 * torch.arange(NIBBLES_PER_INT32)).reshape(1, -1, *([1] * (values.dim() - 1)))
    packed = (groups << shifts).sum(dim=1)  # 0 .. 2^32 - 1
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # reinterpret as two's complement int32
    return packed.to(torch.int32).movedim(0, dim).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of pack_int4: int32 -> int64 values 0..15, eight per int32 along `dim`."""
    packed = packed.movedim(dim, 0).to(torch.int64)
    shifts = (4 * torch.arange(NIBBLES_PER_INT32, device=packed.device)).reshape(1, -1, *([1] * (packed.dim() - 1)))
    values = (packed[:, None] >> shifts) & 0xF  # (n, 8, ...)
    return values.reshape(-1, *packed.shape[1:]).movedim(0, dim)


def gptq_pack(int_weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors for one Linear. int_weight [N, K] and zeros [K/G, N] hold 0..15; scales [K/G, N]."""
    stored_zeros = (zeros.to(torch.int64) - ZERO_OFFSET["gptq"]) & 0xF
    return {
        "qweight": pack_int4(int_weight.t(), dim=0),
        "qzeros": pack_int4(stored_zeros, dim=1),
        "scales": scales.to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }


def gptq_integers(qweight: torch.Tensor, qzeros: torch.Tensor, checkpoint_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit weights q (K, N) and the real zero points (K/G, N) of GPTQ tensors."""
    zeros = (unpack_int4(qzeros, dim=1) + ZERO_OFFSET[checkpoint_format]) & 0xF
    return unpack_int4(qweight, dim=0), zeros


def gptq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, checkpoint_format: str = "gptq"
) -> torch.Tensor:
    """The fp32 weight [N, K] (nn.Linear layout) that a GPTQ checkpoint means."""
    q, zeros = gptq_integers(qweight, qzeros, checkpoint_format)
    groups = g_idx.to(torch.int64)
    weight = scales.float()[groups] * (q - zeros[groups]).float()  # (K, N)
    return weight.t().contiguous()


def rtn_quantize(weight: torch.Tensor, group_size: int, sym: bool) -> dict[str, torch.Tensor]:
    """Round-to-nearest 4-bit GPTQ tensors of a weight [N, K]: per group of `group_size` inputs, the
    grid spans [min(w, 0), max(w, 0)] (symmetric: +-max|w| around zero 8). GPTQ's baseline."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)  # (N, K/G, G)
    low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)  # (N, K/G)
    if sym:
        high = torch.maximum(high, -low)
        low = -high
    # The stored fp16 scale is what dequantizes; the floor keeps an all-zero group's scale a normal fp16.
    scales = ((high - low) / 15).clamp(min=2**-14).half().float()
    zeros = torch.full_like(scales, 8) if sym else torch.round(-low / scales).clamp(0, 15)
    ints = torch.clamp(torch.round(groups / scales[..., None]) + zeros[..., None], 0, 15).reshape(out_features, in_features)
    return gptq_pack(ints.long(), zeros.long().t(), scales.t(), torch.arange(in_features) // group_size)


INT4_KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's CPU INT4 kernel accepts
INT4_KERNEL_DTYPE = torch.bfloat16  # its fast path; fp32 activations run ~30x slower on these CPUs
# The kernel is a matrix-vector one: its cost grows with every row (27 ms for 2000 rows of a 512x2048
# layer, against 2 ms dense in bf16). From this many rows (a prefill), unpacking the layer to bf16 and
# one dense matmul is faster: unpacking a 3072x1024 layer takes 1.3 ms, what the kernel spends on ~40 rows.
DENSE_PREFILL_ROWS = 64
DENSE_PREFILL_BLOCK = 2048  # output rows unpacked at a time (a multiple of the kernel's 64-row blocks)


@functools.cache
def kernel_layout_is_known() -> bool:
    """Does the kernel pack weights the way Int4Linear.dense_weight reads them? Its layout is PyTorch's
    internal business, so check once per process on known values rather than trust it."""
    q = torch.randint(0, 16, (128, 64), dtype=torch.int32, device="cpu", generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return packed.shape == (128, 32) and torch.equal(_unpack_kernel_layout(packed, 128, 64), q.t())


def _unpack_kernel_layout(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The 4-bit values of the CPU kernel's uint8 (N, K/2) layout, transposed: (K, N). Each block of 64
    output rows is stored as (K, 32) bytes, the low nibble holding rows 0..31 of the block and the high
    nibble rows 32..63, so moving the K axis first is a copy of 32-byte runs and the nibbles then land in
    row order; unpacking to (N, K) instead would transpose every byte."""
    blocks = packed.view(out_features // 64, in_features, 32).transpose(0, 1).contiguous()  # (K, N/64, 32)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=2).view(in_features, out_features)


class Int4Linear(nn.Module):
    """A GPTQ linear kept packed at 4 bits per weight and multiplied by PyTorch's CPU INT4 kernel.

    The kernel dequantizes W = (q - 8) * scale + offset per group, so GPTQ's scale * (q - zero) becomes
    offset = scale * (8 - zero). Only plain group order (g_idx[k] = k // group_size) maps onto it.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.dense_prefill = out_features % 64 == 0 and kernel_layout_is_known()
        self.register_buffer("packed_weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_offsets", torch.empty(in_features // group_size, out_features, 2, dtype=INT4_KERNEL_DTYPE))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=INT4_KERNEL_DTYPE)) if bias else None

    @staticmethod
    def pack_gptq(qweight, qzeros, scales, g_idx, checkpoint_format: str) -> dict[str, torch.Tensor]:
        """GPTQ tensors -> this module's buffers (CPU)."""
        q, zeros = gptq_integers(qweight, qzeros, checkpoint_format)
        scales = scales.float()
        return {
            "packed_weight": torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.t().to(torch.int32).contiguous(), 2),
            "scales_and_offsets": torch.stack([scales, scales * (8 - zeros)], dim=2).to(INT4_KERNEL_DTYPE),
        }

    @staticmethod
    def unsupported(in_features: int, out_features: int, group_size: int, g_idx: torch.Tensor) -> str | None:
        """Why this layer cannot use the kernel, or None when it can."""
        if group_size not in INT4_KERNEL_GROUP_SIZES:
            return f"group size {group_size} is not one of {INT4_KERNEL_GROUP_SIZES}"
        if out_features % 16:
            return f"{out_features} output features are not a multiple of 16"
        if not torch.equal(g_idx.to(torch.int64), torch.arange(in_features) // group_size):
            return "act-order g_idx reorders groups"
        return None

    def dense_weight(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start..stop-1 (multiples of 64; default all) of the (N, K) bf16 weight the kernel multiplies
        by, (q - 8) * scale + offset per group, as the transposed view of a contiguous (K, rows) tensor:
        the layout the kernel's bytes unpack to cheaply, and the one a prefill's x @ W^T wants."""
        K, G = self.in_features, self.group_size
        stop = self.out_features if stop is None else stop
        centred = _unpack_kernel_layout(self.packed_weight[start:stop], stop - start, K).view(torch.int8) - 8
        # Contiguous (K/G, 1, rows) scales: broadcasting the strided halves of scales_and_offsets is 5x slower.
        scales, offsets = (t[:, start:stop].contiguous()[:, None] for t in self.scales_and_offsets.unbind(dim=-1))
        weight = torch.addcmul(offsets, centred.view(K // G, G, stop - start).to(INT4_KERNEL_DTYPE), scales)
        return weight.view(K, stop - start).t()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) of the (N, K) weight, dequantized as dense_weight does: (*ids.shape, K).
        A tied INT4 lm_head serves as the embedding table this way, so one 4-bit copy does both jobs."""
        flat = ids.reshape(-1)
        blocks = self.packed_weight.view(self.out_features // 64, self.in_features, 32)  # see _unpack_kernel_layout
        packed = blocks[flat // 64, :, flat % 32]  # (n, K) bytes holding each row's nibbles
        q = torch.where((flat % 64 < 32)[:, None], packed & 0xF, packed >> 4).view(len(flat), -1, self.group_size)
        scales, offsets = (t[:, flat].t()[..., None] for t in self.scales_and_offsets.unbind(dim=-1))  # (n, K/G, 1)
        weights = torch.addcmul(offsets, q.to(INT4_KERNEL_DTYPE) - 8, scales)
        return weights.reshape(*ids.shape, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.dense_prefill and flat.shape[0] >= DENSE_PREFILL_ROWS:
            # Unpacked a block of rows at a time, so the temporaries stay small: unpacking a whole fused
            # 6144x1024 layer at once cost 1.6x more per weight than 3072 rows (fresh pages every call).
            blocks = range(0, self.out_features, DENSE_PREFILL_BLOCK)
            out = torch.cat([flat @ self.dense_weight(b, min(b + DENSE_PREFILL_BLOCK, self.out_features)).t() for b in blocks], dim=-1)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed_weight, self.group_size, self.scales_and_offsets)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out


# ----------------------------------------------------------------------------------------------
# LoRA (a PEFT adapter kept unmerged as A, B and scale, or merged into the base weight)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(lora_A.float(), requires_grad=False)  # (r, in), fp32 whatever the model's dtype
        self.lora_B = nn.Parameter(lora_B.float() * scale, requires_grad=False)  # (out, r), the scale folded in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The side matmuls run in the adapter's fp32: a rank-r bf16 GEMM costs ~7x an fp32 one here
        # (oneDNN's bf16 set-up dominates such small products), and the adapter was trained in fp32.
        side = F.linear(F.linear(x.float(), self.lora_A), self.lora_B)
        return self.base(x).add_(side)  # added in fp32, rounded once to the base's dtype

    def merge(self) -> nn.Linear:
        """The plain Linear with W + scale * B @ A (computed in fp32, cast to the weight dtype)."""
        delta = self.lora_B @ self.lora_A
        merged = nn.Linear(self.base.in_features, self.base.out_features, bias=self.base.bias is not None)
        merged.weight = nn.Parameter((self.base.weight.float() + delta).to(self.base.weight.dtype), requires_grad=False)
        merged.bias = self.base.bias
        return merged


# ----------------------------------------------------------------------------------------------
# Fused projections: q, k and v (and gate and up) read the same input, so after loading each group
# becomes one module with the outputs concatenated; a decode step then makes one INT4 kernel call and
# one pair of LoRA matmuls where it made three, which matters where per-call overhead is the cost.

FUSED_PROJECTIONS = {"self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "mlp": ("gate_up_proj", ("gate_proj", "up_proj"))}


class Concat(nn.Module):
    """The fallback when parts cannot share one matmul (mixed kinds): their outputs, concatenated."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def concat_outputs(parts: list[nn.Module]) -> nn.Module:
    """One module computing the parts' outputs concatenated, as a single matmul where their kinds allow."""
    adapters = [p for p in parts if isinstance(p, LoRALinear)]
    if adapters:
        # x A^T stacks every adapter's rank-r input; the block-diagonal B sends each to its own part's
        # outputs, and nothing to a part without an adapter (an empty block: its side output is exactly 0).
        bases = [p.base if isinstance(p, LoRALinear) else p for p in parts]
        lora_A = torch.cat([a.lora_A for a in adapters])  # (adapters * r, in)
        lora_B = torch.block_diag(*[p.lora_B if isinstance(p, LoRALinear) else torch.zeros(p.out_features, 0) for p in parts])
        return LoRALinear(concat_outputs(bases), lora_A, lora_B, scale=1.0)  # each B carries its own scale
    kinds, biases = {type(p) for p in parts}, [p.bias for p in parts]
    if len(kinds) > 1 or len({b is None for b in biases}) > 1:
        return Concat(parts)
    in_features, out_features = parts[0].in_features, sum(p.out_features for p in parts)
    bias = {} if biases[0] is None else {"bias": torch.cat(biases)}
    if kinds == {nn.Linear}:
        with torch.device("meta"):
            fused = nn.Linear(in_features, out_features, bias=bool(bias))
        fused.load_state_dict({"weight": torch.cat([p.weight for p in parts])} | bias, assign=True)
        return fused
    if kinds == {Int4Linear} and len({p.group_size for p in parts}) == 1 and all(p.out_features % 64 == 0 for p in parts):
        # The kernel stores 64 output rows per block, so whole blocks concatenate like rows.
        with torch.device("meta"):
            fused = Int4Linear(in_features, out_features, parts[0].group_size, bias=bool(bias))
        state = {
            "packed_weight": torch.cat([p.packed_weight for p in parts]),
            "scales_and_offsets": torch.cat([p.scales_and_offsets for p in parts], dim=1),  # (K/G, N, 2)
        }
        fused.load_state_dict(state | bias, assign=True)
        return fused
    return Concat(parts)


def fuse_projections(model: "Transformer") -> None:
    """Replace each layer's q/k/v and gate/up projections by their fused module (load_model calls this)."""
    for layer in model.layers:
        for block_name, (fused_name, names) in FUSED_PROJECTIONS.items():
            block = getattr(layer, block_name)
            setattr(block, fused_name, concat_outputs([getattr(block, name) for name in names]))
            for name in names:
                delattr(block, name)


# ----------------------------------------------------------------------------------------------
# Attention, MLP, block, model. Module names mirror transformers', so checkpoint keys map 1:1.


@dataclass
class ForwardInputs:
    """Where a forward reads and writes the KV cache. T = tokens per row in this forward."""

    positions: torch.Tensor  # (B, T) position of each token in its sequence
    write_slots: torch.Tensor  # (B, T) cache slot receiving each token's KV (the scratch slot for padding)
    read_slots: list[int]  # (B,) the slot each row attends over
    kv_len: int  # keys 0..kv_len-1 of each read slot may be attended (the mask narrows it per row)
    # Every row's tokens sit at positions 0..T-1 and the keys are exactly theirs (kv_len == T): the
    # plain causal mask, which attention applies without a mask tensor and skipping the masked blocks.
    causal: bool = False


class Attention(nn.Module):
    """q_proj, k_proj and v_proj carry the checkpoint's names; load_model fuses them into one qkv_proj
    (fuse_projections), which forward uses."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache: "KVCache", layer: int, at: ForwardInputs) -> torch.Tensor:
        B, T, _ = x.shape
        heads = self.qkv_proj(x).view(B, T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(layer, at.write_slots, at.positions, k, v)
        keys, values = cache.read(layer, at.read_slots, at.kv_len)  # (B, H_kv, kv_len, D)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """gate_proj and up_proj are fused into gate_up_proj at load, like q, k and v."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache: "KVCache", layer: int, at: ForwardInputs) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, at)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids (B, T) -> (B, T, hidden); without a table of its own, the rows of the INT4 lm_head."""
        return self.embed_tokens(token_ids) if self.embed_tokens is not None else self.lm_head.rows(token_ids)

    def forward(self, token_ids: torch.Tensor, cache: "KVCache", at: ForwardInputs) -> torch.Tensor:
        """token_ids (B, T) -> final hidden states (B, T, hidden); KV written to the cache on the way."""
        x = self.embed(token_ids)
        cos, sin = rope_cos_sin(at.positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        # A query sees every key at or before its own position in its row's slot: (B, 1, T, kv_len).
        key_positions = torch.arange(at.kv_len, device=token_ids.device)
        mask = None if at.causal else (key_positions[None, None, :] <= at.positions[:, :, None])[:, None]
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, mask, cache, i, at)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: argmax needs no fp32 copy of a 150k-wide row; probabilities take one."""
        return self.lm_head(hidden)


# ----------------------------------------------------------------------------------------------
# Loading: a model package (DESIGN section 5) or a Hugging Face checkpoint, strictly.

PACKAGE_WEIGHTS = "model_int4.safetensors"
PACKAGE_QUANT_CONFIG = "quant_config.json"
PACKAGE_LORA_WEIGHTS = "lora.safetensors"
PACKAGE_LORA_CONFIG = "lora_config.json"
PACKAGE_MODEL_CARD = "model_card.json"
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
PEFT_PREFIX = "base_model.model.model."


def _read_json(path: Path) -> dict:
    try:
        content = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing") from None
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(content, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(content).__name__}")
    return content


@dataclass(frozen=True)
class QuantConfig:
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    checkpoint_format: str
    modules_to_not_convert: tuple[str, ...]
    # Our extension, "quantized_embedding": {"group_size": G}: the tied embedding / lm_head table is stored
    # as GPTQ tensors too (model.embed_tokens.qweight ..., a linear of in=hidden, out=vocab).
    embedding_group_size: int | None = None

    @classmethod
    def from_dict(cls, raw: dict, source: Path) -> "QuantConfig":
        if raw.get("quant_method") != "gptq":
            raise ModelLoadError(f"{source}: quant_method {raw.get('quant_method')!r} is not supported; expected 'gptq'")
        if raw.get("bits") != 4:
            raise ModelLoadError(f"{source}: bits {raw.get('bits')!r} is not supported; expected 4")
        if not (isinstance(raw.get("group_size", 128), int) and raw.get("group_size", 128) > 0):
            raise ModelLoadError(f"{source}: group_size {raw.get('group_size')!r} is not supported; expected a positive group size such as 128")
        checkpoint_format = raw.get("checkpoint_format", "gptq")
        if checkpoint_format not in ZERO_OFFSET:
            raise ModelLoadError(f"{source}: checkpoint_format {checkpoint_format!r} is not supported; expected one of {list(ZERO_OFFSET)}")
        embedding = raw.get("quantized_embedding")
        if embedding is not None and not (isinstance(embedding, dict) and isinstance(embedding.get("group_size"), int) and embedding["group_size"] > 0):
            raise ModelLoadError(f"{source}: quantized_embedding {embedding!r} is not supported; expected {{\"group_size\": G}} with G > 0")
        return cls(
            bits=4,
            group_size=raw.get("group_size", 128),
            sym=raw.get("sym", True),
            desc_act=raw.get("desc_act", False),
            checkpoint_format=checkpoint_format,
            modules_to_not_convert=tuple(raw.get("modules_to_not_convert") or ()),
            embedding_group_size=embedding["group_size"] if embedding else None,
        )

    def describe(self) -> dict:
        return {"method": "gptq", "bits": self.bits, "group_size": self.group_size, "sym": self.sym, "desc_act": self.desc_act,
                "embedding_group_size": self.embedding_group_size}


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    scale: float
    target_modules: list[str] | str

    @classmethod
    def from_peft(cls, raw: dict, source: Path) -> "LoRAConfig":
        unsupported = {
            "use_dora": raw.get("use_dora"),
            "fan_in_fan_out": raw.get("fan_in_fan_out"),
            "layers_to_transform": raw.get("layers_to_transform"),
            "rank_pattern": raw.get("rank_pattern"),
            "alpha_pattern": raw.get("alpha_pattern"),
            "modules_to_save": raw.get("modules_to_save"),
        }
        for field, value in unsupported.items():
            if value:
                raise ModelLoadError(f"{source}: {field}={value!r} is not supported by this loader")
        if raw.get("bias", "none") != "none":
            raise ModelLoadError(f"{source}: bias={raw['bias']!r} is not supported; expected 'none'")
        _require(raw, ("r", "lora_alpha", "target_modules"), source)
        rank, alpha = raw["r"], raw["lora_alpha"]
        scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
        return cls(rank=rank, scale=scale, target_modules=raw["target_modules"])

    def targets(self, module_name: str) -> bool:
        """PEFT's rule: a regex string must match the whole name; a list matches the name or a suffix."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module_name) is not None
        return any(module_name == t or module_name.endswith("." + t) for t in self.target_modules)


def _linear_names(cfg: ModelConfig) -> list[str]:
    """Every projection inside the decoder layers, by its in-model name (layers.0.self_attn.q_proj)."""
    return [f"layers.{i}.{part}.{p}" for i in range(cfg.num_layers) for part, names in PROJECTIONS.items() for p in names]


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else "model." + name


def _expected_tensors(cfg: ModelConfig, quant: QuantConfig | None) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name (HF naming) -> shape, derived from a meta-device skeleton of the model."""
    with torch.device("meta"):
        skeleton = Transformer(cfg)
    expected = {_hf_name(name): tuple(p.shape) for name, p in skeleton.state_dict().items()}
    if cfg.tie_word_embeddings:
        del expected["lm_head.weight"]
    if quant is None:
        return expected
    quantized = {name: quant.group_size for name in _quantized_linears(cfg, quant)}
    if quant.embedding_group_size:
        if not cfg.tie_word_embeddings:
            raise ModelLoadError("quantized_embedding needs tie_word_embeddings: the INT4 table serves as embedding and lm_head")
        quantized["embed_tokens"] = quant.embedding_group_size
    for name, group_size in quantized.items():
        out_features, in_features = expected.pop(f"model.{name}.weight")
        if in_features % group_size or in_features % NIBBLES_PER_INT32 or out_features % NIBBLES_PER_INT32:
            raise ModelLoadError(f"{name}: shape [{out_features}, {in_features}] does not fit GPTQ group size {group_size}")
        n_groups = in_features // group_size
        expected[f"model.{name}.qweight"] = (in_features // NIBBLES_PER_INT32, out_features)
        expected[f"model.{name}.qzeros"] = (n_groups, out_features // NIBBLES_PER_INT32)
        expected[f"model.{name}.scales"] = (n_groups, out_features)
        expected[f"model.{name}.g_idx"] = (in_features,)
    return expected


def _quantized_linears(cfg: ModelConfig, quant: QuantConfig) -> list[str]:
    skipped = quant.modules_to_not_convert
    return [n for n in _linear_names(cfg) if not any(n == s or n.endswith("." + s) or _hf_name(n) == s for s in skipped)]


def _read_safetensors(files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of `files` on CPU, and the file each came from; a name in two files is refused."""
    tensors, origin = {}, {}
    for path in files:
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing")
        try:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():
                    if name in tensors:
                        raise ModelLoadError(f"tensor {name!r} appears in both {origin[name].name} and {path.name}")
                    tensors[name], origin[name] = handle.get_tensor(name), path
        except SafetensorError as error:
            raise ModelLoadError(f"{path}: not a readable safetensors file ({error})") from None
    return tensors, origin


def _check_tensors(tensors: dict[str, torch.Tensor], origin: dict[str, Path], expected: dict[str, tuple[int, ...]], where: str) -> None:
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelLoadError(f"{where}: missing tensor {missing[0]!r} with shape {list(expected[missing[0]])} ({len(missing)} missing in all)")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        name = unexpected[0]
        raise ModelLoadError(f"{origin[name]}: unexpected tensor {name!r} ({len(unexpected)} unexpected in all)")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ModelLoadError(f"{origin[name]}: tensor {name!r} has shape {list(tensors[name].shape)}, expected {list(shape)}")
        packed_ints = name.endswith((".qweight", ".qzeros", ".g_idx"))
        if (tensors[name].dtype == torch.int32) != packed_ints or not (packed_ints or tensors[name].is_floating_point()):
            wanted = "int32" if packed_ints else "a floating-point dtype"
            raise ModelLoadError(f"{origin[name]}: tensor {name!r} has dtype {tensors[name].dtype}, expected {wanted}")


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face checkpoint directory (single file or sharded with an index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no 'weight_map' object naming each tensor's shard")
        shards = sorted(set(weight_map.values()))
        files = [model_dir / shard for shard in shards]
        for path in files:
            if not path.exists():
                raise ModelLoadError(f"{index}: lists shard {path.name!r}, which is not in {model_dir}")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise ModelLoadError(f"{model_dir}: no {PACKAGE_WEIGHTS} (model package) and no model.safetensors or model.safetensors.index.json (Hugging Face checkpoint)")


def _load_state(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, quant: QuantConfig | None, dtype: torch.dtype, packed: bool
) -> tuple[dict[str, torch.Tensor], dict[str, int], dict[str, str]]:
    """Checkpoint tensors -> our state dict in the compute dtype.

    Each GPTQ linear becomes Int4Linear buffers when `packed` and the kernel can take it, else a dense
    dequantized weight; a quantized tied embedding becomes the INT4 lm_head (whose rows are the
    embedding) or a dense table. Returns the state, the packed layers (name -> group size) and, for
    every quantized tensor left dense, the reason.
    """
    state, int4_layers, dense_reasons = {}, {}, {}
    quantized = {name: (name, quant.group_size) for name in _quantized_linears(cfg, quant)} if quant else {}
    if quant and quant.embedding_group_size:
        quantized["embed_tokens"] = ("lm_head", quant.embedding_group_size)  # packed, the table lives in the head
    for name, (packed_name, group_size) in quantized.items():
        parts = {part: tensors.pop(f"model.{name}.{part}") for part in ("qweight", "qzeros", "scales", "g_idx")}
        out_features, in_features = parts["scales"].shape[1], parts["g_idx"].shape[0]
        reason = Int4Linear.unsupported(in_features, out_features, group_size, parts["g_idx"]) if packed else "dense weights chosen"
        if reason is None and name == "embed_tokens" and not (out_features % 64 == 0 and kernel_layout_is_known()):
            reason = "embedding rows are read in the kernel's 64-row layout: it must be known and the vocabulary a multiple of 64"
        if reason is None:
            state.update({f"{packed_name}.{k}": v for k, v in Int4Linear.pack_gptq(**parts, checkpoint_format=quant.checkpoint_format).items()})
            int4_layers[packed_name] = group_size
        else:
            dense_reasons[name] = reason
            state[f"{name}.weight"] = gptq_dequantize(**parts, checkpoint_format=quant.checkpoint_format).to(dtype)
    for hf_name, tensor in tensors.items():
        state[hf_name.removeprefix("model.")] = tensor.to(dtype)
    if cfg.tie_word_embeddings and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return state, int4_layers, dense_reasons


def _quantize_lm_head(state: dict[str, torch.Tensor], cfg: ModelConfig) -> int:
    """Swap the lm_head weight in `state` for round-to-nearest INT4 kernel buffers; the group size used.

    With a tied embedding the lookup keeps the dense table: only the vocab x hidden matmul, the
    largest one of a decode step for a small drafter, reads 4-bit weights."""
    group_size = next((g for g in (128, 64, 32) if cfg.hidden_size % g == 0), None)
    if group_size is None or cfg.vocab_size % 16:
        raise ModelLoadError(f"an INT4 lm_head needs hidden size % 32 == 0 and vocab size % 16 == 0, got {cfg.hidden_size} and {cfg.vocab_size}")
    gptq = rtn_quantize(state.pop("lm_head.weight"), group_size, sym=False)
    state.update({f"lm_head.{k}": v for k, v in Int4Linear.pack_gptq(**gptq, checkpoint_format="gptq").items()})
    return group_size


def _skeleton(cfg: ModelConfig, int4_layers: dict[str, int], table_in_head: bool) -> Transformer:
    """The model on the meta device, with Int4Linear (of the given group size) where packed weights go;
    table_in_head: no embedding table, the INT4 lm_head's rows are the embedding."""
    with torch.device("meta"):
        model = Transformer(cfg)
        for name, group_size in int4_layers.items():
            dense = model.get_submodule(name)
            _replace_module(model, name, Int4Linear(dense.in_features, dense.out_features, group_size, bias=dense.bias is not None))
        if table_in_head:
            model.embed_tokens = None
    return model


def _replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, module)


def _apply_lora(model: Transformer, lora_dir: Path, merge: bool) -> LoRAConfig:
    config_path, weights_path = lora_dir / PACKAGE_LORA_CONFIG, lora_dir / PACKAGE_LORA_WEIGHTS
    lora = LoRAConfig.from_peft(_read_json(config_path), config_path)
    targets = [name for name in _linear_names(model.cfg) if lora.targets(name)]
    if not targets:
        raise ModelLoadError(f"{config_path}: target_modules {lora.target_modules!r} match no projection of the model")
    expected = {}
    for name in targets:
        base = model.get_submodule(name)
        expected[f"{PEFT_PREFIX}{name}.lora_A.weight"] = (lora.rank, base.in_features)
        expected[f"{PEFT_PREFIX}{name}.lora_B.weight"] = (base.out_features, lora.rank)
    tensors, origin = _read_safetensors([weights_path])
    _check_tensors(tensors, origin, expected, str(weights_path))
    for name in targets:
        wrapped = LoRALinear(
            model.get_submodule(name),
            tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"],
            tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"],
            lora.scale,
        )
        keep_unmerged = not merge or isinstance(wrapped.base, Int4Linear)  # packed bits cannot absorb B @ A
        _replace_module(model, name, wrapped if keep_unmerged else wrapped.merge())
    return lora


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
WEIGHT_PATHS = ("auto", "packed", "dequant")


def _resolve_runtime(
    device: str | torch.device | None, dtype: str | torch.dtype | None, weights: str, quant: QuantConfig | None
) -> tuple[torch.device, torch.dtype, bool]:
    """(device, dtype, packed): the fastest path that keeps its promises, unless the caller chose.

    Packed INT4 runs on the CPU kernel with bf16 activations; dense weights default to bf16 on CUDA
    and fp32 on CPU (bf16 matmuls are not faster than fp32 on every CPU, and fp32 is the exact one).
    """
    if weights not in WEIGHT_PATHS:
        raise ValueError(f"weights {weights!r} is not one of {WEIGHT_PATHS}")
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)} or 'auto'")
        dtype = DTYPES[dtype]
    dtype = None if dtype == "auto" else dtype
    blocker = (
        "the model is not GPTQ-quantized" if quant is None
        else f"the INT4 kernel runs on cpu, not {device.type}" if device.type != "cpu"
        else f"torch {torch.__version__} has no CPU INT4 kernel" if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        else f"the INT4 kernel needs bfloat16 activations, not {dtype}" if dtype not in (None, INT4_KERNEL_DTYPE)
        else None
    )
    if weights == "packed" and blocker:
        raise ModelLoadError(f"weights='packed' is not possible: {blocker}")
    packed = weights != "dequant" and blocker is None
    if dtype is None:
        dtype = INT4_KERNEL_DTYPE if packed or device.type == "cuda" else torch.float32
    return device, dtype, packed


def load_model(
    model_dir: str | Path,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    cache_slots: int = 16,
    max_context: int | None = None,
    merge_lora: bool = True,
    use_lora: bool = True,
    weights: str = "auto",
    quantize_lm_head: bool = False,
) -> "Drafter":
    """Load a model package or a Hugging Face checkpoint directory, strictly (see DESIGN section 5).

    device: cuda when available, else cpu. weights: "packed" keeps GPTQ linears at 4 bits and
    multiplies with PyTorch's CPU INT4 kernel (bf16); "dequant" expands them to dense weights;
    "auto" packs whenever the kernel can run. dtype: bf16 when packed or on cuda, else fp32.
    cache_slots: prefix-cache slots (a batch uses at most half of them). max_context: tokens per
    slot, default min(max_position_embeddings, 4096). LoRA is merged into dense weights by default
    and always kept as side matmuls beside packed ones (use_lora=False ignores the adapter). quantize_lm_head: on the packed path, also
    round the lm_head to INT4 at load (faster decode steps; measure its effect on tau).
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir}: no config.json; expected a model package or a Hugging Face checkpoint directory")
    hf_config = _read_json(model_dir / "config.json")
    generation_path = model_dir / "generation_config.json"
    cfg = ModelConfig.from_hf(hf_config, _read_json(generation_path) if generation_path.exists() else None)

    is_package = (model_dir / PACKAGE_WEIGHTS).exists()
    if is_package:
        quant_path = model_dir / PACKAGE_QUANT_CONFIG
        if not quant_path.exists():
            raise ModelLoadError(f"{model_dir}: has {PACKAGE_WEIGHTS} but no {PACKAGE_QUANT_CONFIG}")
        quant, files = QuantConfig.from_dict(_read_json(quant_path), quant_path), [model_dir / PACKAGE_WEIGHTS]
    else:
        raw_quant = hf_config.get("quantization_config")
        quant = QuantConfig.from_dict(raw_quant, model_dir / "config.json") if raw_quant else None
        files = _weight_files(model_dir)

    device, dtype, packed = _resolve_runtime(device, dtype, weights, quant)
    tensors, origin = _read_safetensors(files)
    _check_tensors(tensors, origin, _expected_tensors(cfg, quant), str(model_dir))
    state, int4_layers, dense_reasons = _load_state(tensors, cfg, quant, dtype, packed)
    table_in_head = "embed_tokens.weight" not in state
    if quantize_lm_head and table_in_head:
        log.info("quantize_lm_head: the package's INT4 embedding table already is the lm_head")
    if quantize_lm_head and not table_in_head:
        if not packed:
            raise ModelLoadError("quantize_lm_head needs the packed INT4 path (a GPTQ model on cpu with bf16)")
        int4_layers["lm_head"] = _quantize_lm_head(state, cfg)
    model = _skeleton(cfg, int4_layers, table_in_head)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    if packed and dense_reasons:
        name, reason = next(iter(dense_reasons.items()))
        log.warning("%d of %d quantized linears stay dense (e.g. %s: %s)", len(dense_reasons), len(dense_reasons) + len(int4_layers), name, reason)

    lora = None
    if use_lora and ((model_dir / PACKAGE_LORA_CONFIG).exists() or (model_dir / PACKAGE_LORA_WEIGHTS).exists()):
        lora = _apply_lora(model, model_dir, merge=merge_lora)
    fuse_projections(model)

    card_path = model_dir / PACKAGE_MODEL_CARD
    model_card = _read_json(card_path) if card_path.exists() else {}
    model = model.to(device).eval().requires_grad_(False)
    context = min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT) if max_context is None else max_context
    if not 1 <= context <= cfg.max_position_embeddings:
        raise ModelLoadError(f"max_context {context} must lie in 1..{cfg.max_position_embeddings} (the model's max_position_embeddings)")
    return Drafter(model, cfg, KVCache(cfg, cache_slots, context, device, dtype), quant, lora, model_card, str(model_dir))


# ----------------------------------------------------------------------------------------------
# KV-cache pool: slots allocated once, written by index, matched by exact token prefix, LRU eviction


class KVCache:
    """`num_slots` sequences of up to `max_len` tokens each, plus one scratch slot that absorbs the
    writes of padding and finished rows so they can never touch a real sequence."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, device: torch.device, dtype: torch.dtype):
        if num_slots < 2:
            raise ValueError(f"cache_slots must be at least 2, got {num_slots}")
        shape = (cfg.num_layers, num_slots + 1, cfg.num_kv_heads, max_len, cfg.head_dim)
        # torch.empty on CPU does not touch the pages, so memory is committed only as slots fill.
        self.keys = torch.empty(shape, device=device, dtype=dtype)
        self.values = torch.empty(shape, device=device, dtype=dtype)
        self.num_slots, self.max_len, self.scratch = num_slots, max_len, num_slots
        self.zeroed = [0] * num_slots  # positions 0..zeroed-1 of a slot hold numbers, not uninitialised memory
        # The tokens whose KV each slot holds, on the CPU, -1 past a slot's length (no id matches it).
        self.tokens = torch.full((num_slots, max_len), -1, dtype=torch.long)
        self.lengths = [0] * num_slots
        self.prompt_len = [0] * num_slots  # how many of them a request sent; the rest are the slot's own drafts
        self.last_used = [0] * num_slots
        self.clock = 0

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots, positions (B, T); k, v (B, T, H_kv, D)."""
        self.keys[layer][slots, :, positions] = k
        self.values[layer][slots, :, positions] = v

    def read(self, layer: int, slots: list[int], kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H_kv, kv_len, D) keys and values of `slots`: a view when the slots are consecutive (always
        at batch size 1), else a gathered copy, which costs a pass over the batch's KV per layer and step."""
        keys, values = self.keys[layer, :, :, :kv_len], self.values[layer, :, :, :kv_len]
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return keys[slots[0] : slots[0] + len(slots)], values[slots[0] : slots[0] + len(slots)]
        index = torch.tensor(slots, device=keys.device)
        return keys.index_select(0, index), values.index_select(0, index)

    def longest_prefix(self, tokens: list[int]) -> tuple[int, int]:
        """(slot, length) of the longest common prefix between `tokens` and any slot; newest slot on ties."""
        n = min(len(tokens), self.max_len)
        differs = self.tokens[:, :n] != torch.tensor(tokens[:n])  # (slots, n)
        matched = torch.where(differs.any(dim=1), differs.int().argmax(dim=1), n).tolist()  # first mismatch per slot
        length, _, slot = max(zip(matched, self.last_used, range(self.num_slots)))
        return slot, length

    def assign(self, batch: list[list[int]]) -> tuple[list[int], list[int]]:
        """Choose a slot for each row and how many of its tokens are reused from the cache.

        A row that extends the request a slot last served continues in that slot: what the slot holds
        beyond the match is its own draft, which the row's accepted tokens supersede (the harness'
        loop). Otherwise the row takes the least recently used slot that no row of this batch reads
        from, and the matched prefix's KV is copied there, so a conversation sharing only a prefix
        (a system prompt) with another keeps its own slot.
        """
        if len(batch) > self.num_slots // 2:
            raise ValueError(f"a batch of {len(batch)} needs at least {2 * len(batch)} cache slots, have {self.num_slots}")
        matches = [self.longest_prefix(row) for row in batch]
        # At least one token per row must go through the model to produce its next-token logits.
        reuse = [min(n, len(row) - 1) for row, (_, n) in zip(batch, matches)]
        sources = {slot for (slot, _), r in zip(matches, reuse) if r > 0}
        targets: list[int | None] = [None] * len(batch)
        for i, (slot, n) in enumerate(matches):
            if reuse[i] > 0 and n >= self.prompt_len[slot] and slot not in targets:
                targets[i] = slot
        free = sorted((s for s in range(self.num_slots) if s not in sources and s not in targets), key=lambda s: self.last_used[s])
        for i, (slot, _) in enumerate(matches):
            if targets[i] is None:
                targets[i] = free.pop(0)
                if reuse[i] > 0:
                    self.copy_prefix(slot, targets[i], reuse[i])
        for row, slot, r in zip(batch, targets, reuse):
            # Until the forward finishes, only the reused prefix of a target slot is known to be valid.
            self.hold(slot, row[:r], prompt_len=r)
        return targets, reuse

    def clear_garbage(self, slots: list[int], length: int) -> None:
        """Zero positions below `length` of `slots` never written before. A shorter row reads past its
        end up to the batch's longest row; those keys are masked, but a NaN from uninitialised memory
        would still leak through the attention weights (0 * NaN = NaN)."""
        for slot in slots:
            if self.zeroed[slot] < length:
                self.keys[:, slot, :, self.zeroed[slot] : length] = 0
                self.values[:, slot, :, self.zeroed[slot] : length] = 0
                self.zeroed[slot] = length

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]
        self.zeroed[target] = max(self.zeroed[target], length)

    def commit(self, slot: int, prompt: list[int], fed_drafts: list[int]) -> None:
        """Record that `slot` now holds the KV of exactly `prompt` followed by `fed_drafts`."""
        self.hold(slot, prompt + fed_drafts, prompt_len=len(prompt))
        self.clock += 1
        self.last_used[slot] = self.clock

    def hold(self, slot: int, tokens: list[int], prompt_len: int) -> None:
        self.tokens[slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        self.tokens[slot, len(tokens) : self.lengths[slot]] = -1
        self.lengths[slot], self.prompt_len[slot] = len(tokens), prompt_len


def reuse_freed_memory() -> bool:
    """Have glibc's malloc keep freed blocks of up to 32 MiB for reuse instead of returning each to the
    OS. A long prefill allocates and frees tens of MiB per layer; by default every block over a few MiB
    is fresh pages on each call (faults and zeroing), which cost a quarter of a 2,000-token prefill here.
    The process then stays at its peak heap size. Process-wide, so servers and benchmarks call it, not
    load_model. False where the C library is not glibc (nothing changes)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_mmap_threshold, 32 * 2**20)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


# ----------------------------------------------------------------------------------------------
# The drafter and greedy drafting

PREFILL_CHUNK_TOKENS = 2048  # tokens per prefill forward across the batch; bounds the attention scores' memory


class Drafter:
    """A loaded model with its KV-cache pool, and what a server needs to validate and describe it."""

    def __init__(self, model: Transformer, cfg: ModelConfig, cache: KVCache, quant: QuantConfig | None, lora: LoRAConfig | None, model_card: dict, source: str):
        self.model, self.cfg, self.cache = model, cfg, cache
        self.quant, self.lora, self.model_card, self.source = quant, lora, model_card, source
        self.lock = threading.Lock()  # the cache pool is shared state: one draft_batch at a time
        self.weights = "packed" if any(isinstance(m, Int4Linear) for m in model.modules()) else "dense"

    vocab_size = property(lambda self: self.cfg.vocab_size)
    max_context = property(lambda self: self.cache.max_len)
    eos_token_ids = property(lambda self: self.cfg.eos_token_ids)
    architecture = property(lambda self: self.cfg.architecture)
    num_layers = property(lambda self: self.cfg.num_layers)
    quantization = property(lambda self: self.quant.describe() if self.quant else None)
    lora_rank = property(lambda self: self.lora.rank if self.lora else None)
    device = property(lambda self: self.model.norm.weight.device)
    dtype = property(lambda self: self.model.norm.weight.dtype)  # the compute dtype

    def weight_bytes(self) -> int:
        """Resident bytes of the model's parameters and buffers (a tied embedding counted once)."""
        tensors = {t.data_ptr(): t for t in [*self.model.parameters(), *self.model.buffers()]}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The dense weights under Hugging Face names (LoRA merged): load them into the matching
        transformers model to train or compare on exactly what this drafter computes with."""
        if any(isinstance(m, (Int4Linear, LoRALinear, Concat)) for m in self.model.modules()):
            raise ValueError("hf_state_dict needs dense, merged weights: load with weights='dequant' and merge_lora=True")
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        split_sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
        part_names = dict(FUSED_PROJECTIONS.values())
        state = {}
        for name, tensor in self.model.state_dict().items():
            module, leaf = name.rsplit(".", 1)  # layers.0.self_attn.qkv_proj, weight
            parent, _, fused = module.rpartition(".")
            if fused not in part_names:
                state[_hf_name(name)] = tensor
                continue
            for part, piece in zip(part_names[fused], tensor.split(split_sizes[fused])):
                state[_hf_name(f"{parent}.{part}.{leaf}")] = piece
        return state

    def describe(self) -> dict:
        """JSON-ready identity and limits (the server's /health)."""
        return {
            "name": self.model_card.get("name", Path(self.source).name),
            "architecture": self.architecture,
            "vocab_size": self.vocab_size,
            "num_layers": self.num_layers,
            "hidden_size": self.cfg.hidden_size,
            "quantization": self.quantization,
            "lora_rank": self.lora_rank,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "weights": self.weights,
            "weight_bytes": self.weight_bytes(),
            "max_context": self.max_context,
            "cache_slots": self.cache.num_slots,
            "eos_token_ids": list(self.eos_token_ids),
            "model_card": self.model_card,
        }


class Draft(list):
    """One row's draft tokens (compares equal to a plain list), plus where they came from."""

    def __init__(self, tokens: list[int], cached_tokens: int, logprobs: list[float] | None = None, source: str = "model"):
        super().__init__(tokens)
        self.cached_tokens = cached_tokens  # prompt tokens whose KV came from the prefix cache
        self.logprobs = logprobs  # the drafter's log-probability of each draft token (None for a lookup draft)
        self.source = source  # "model" (greedy decoding) or "lookup" (copied from the row's own tokens)


LOOKUP_MAX_MATCH = 8  # the longest suffix prompt lookup tries to find


def prompt_lookup(tokens: Sequence[int], max_tokens: int, min_match: int, max_match: int = LOOKUP_MAX_MATCH) -> list[int]:
    """Prompt-lookup drafting: find the latest earlier occurrence of the sequence's last n tokens, for the
    longest n from max_match down to min_match that occurs, and copy max_tokens tokens from just after
    it; [] if no such n-gram recurs. Uses nothing but `tokens`.

    The copy reads on into the tokens it has already copied, so a repeat that is still running (a loop
    of period p, whose latest occurrence is p tokens back) continues for all max_tokens, not just p."""
    if min_match < 1:
        raise ValueError(f"min_match must be at least 1, got {min_match}")
    sequence = list(tokens)
    as_tensor = torch.as_tensor(sequence, dtype=torch.long)  # [L]
    for n in range(min(max_match, len(sequence) - 1), min_match - 1, -1):
        windows = as_tensor[:-1].unfold(0, n, 1)  # [L - n, n]: every n-gram that has a token after it
        starts = (windows == as_tensor[-n:]).all(dim=1).nonzero()
        if len(starts):
            source = int(starts[-1]) + n  # at most L - 1: each copied token is already known when it is read
            copied: list[int] = []
            for position in range(source, source + max_tokens):
                copied.append(sequence[position] if position < len(sequence) else copied[position - len(sequence)])
            return copied
    return []


@torch.inference_mode()
def draft_batch(
    drafter: Drafter,
    batch: Sequence[Sequence[int]],
    max_tokens: int | Sequence[int] = 16,
    return_logprobs: bool = False,
    stop_token_ids: Sequence[int] | None = None,
    min_confidence: float | Sequence[float] = 0.0,
    lookup_min_match: int | None | Sequence[int | None] = None,
) -> list[Draft]:
    """Greedy drafts for each sequence of `batch`, up to `max_tokens` each (one value or one per row).

    A row stops after drafting a stop token (default: the model's eos ids), at the context limit, or
    after drafting a token whose probability is below its `min_confidence` (adaptive draft length:
    that token is still returned, since verifying one more token costs the target almost nothing).
    Prefixes already in the cache are not recomputed. In fp32 a row's draft does not depend on the
    rest of its batch nor on the cache; in bf16 (the packed INT4 path) a near-tie can flip with them.

    Hybrid drafting: a row with a `lookup_min_match` whose own tokens end in an n-gram of at least that
    many tokens seen earlier in the row gets what followed it (prompt_lookup; source "lookup", no
    logprobs) instead of a model draft: long repeats (code, quotes, edits) are copied better than guessed.
    """
    rows = [list(row) for row in batch]
    limits, thresholds = _per_row(max_tokens, len(rows), "max_tokens"), _per_row(min_confidence, len(rows), "min_confidence")
    min_matches = _per_row(lookup_min_match, len(rows), "lookup_min_match")
    _check_batch(drafter, rows, limits, thresholds, min_matches)
    budgets = [min(limit, drafter.max_context - len(row)) for row, limit in zip(rows, limits)]
    stop_ids = drafter.eos_token_ids if stop_token_ids is None else tuple(stop_token_ids)
    drafts: list[Draft | None] = [None] * len(rows)
    for i, (row, budget, min_match) in enumerate(zip(rows, budgets, min_matches)):
        copied = prompt_lookup(row, budget, min_match) if min_match and budget else []
        if copied:
            drafts[i] = Draft(_through_first_stop(copied, stop_ids), cached_tokens=0, source="lookup")
    modelled = [i for i, draft in enumerate(drafts) if draft is None]
    per_call = drafter.cache.num_slots // 2  # each row may need a fresh slot beside the one it matched
    with drafter.lock:
        for start in range(0, len(modelled), per_call):
            part = modelled[start : start + per_call]
            made = _draft_rows(drafter, [rows[i] for i in part], [budgets[i] for i in part], [thresholds[i] for i in part], stop_ids, return_logprobs)
            for i, draft in zip(part, made):
                drafts[i] = draft
    return drafts


def _through_first_stop(tokens: list[int], stop_ids: Sequence[int]) -> list[int]:
    stop = next((i for i, token in enumerate(tokens) if token in stop_ids), None)
    return tokens if stop is None else tokens[: stop + 1]


def _per_row(value, n_rows: int, name: str) -> list:
    values = list(value) if isinstance(value, Sequence) else [value] * n_rows
    if len(values) != n_rows:
        raise ValueError(f"{name} has {len(values)} values for {n_rows} rows")
    return values


def _check_batch(drafter: Drafter, rows: list[list[int]], limits: list[int], thresholds: list[float], min_matches: list[int | None]) -> None:
    for i, (row, limit, threshold, min_match) in enumerate(zip(rows, limits, thresholds, min_matches)):
        if not row:
            raise ValueError(f"row {i}: empty token sequence; send at least one token id")
        if len(row) > drafter.max_context:
            raise ValueError(f"row {i}: {len(row)} tokens exceed the context limit of {drafter.max_context}")
        not_int = next((j for j, t in enumerate(row) if type(t) is not int), None)  # bool is an int subclass, not a token
        if not_int is not None:
            raise ValueError(f"row {i}: token id {row[not_int]!r} at position {not_int} is not an int")
        bad = next((j for j, t in enumerate(row) if not 0 <= t < drafter.vocab_size), None)
        if bad is not None:
            raise ValueError(f"row {i}: token id {row[bad]} at position {bad} is outside the vocabulary 0..{drafter.vocab_size - 1}")
        if not (isinstance(limit, int) and limit >= 0):
            raise ValueError(f"row {i}: max_tokens must be a non-negative integer, got {limit!r}")
        if not (isinstance(threshold, (int, float)) and 0.0 <= threshold <= 1.0):
            raise ValueError(f"row {i}: min_confidence must be a probability in [0, 1], got {threshold!r}")
        if min_match is not None and not (type(min_match) is int and 0 <= min_match <= LOOKUP_MAX_MATCH):
            raise ValueError(f"row {i}: lookup_min_match must be None or 0 (off) or an integer in 1..{LOOKUP_MAX_MATCH}, got {min_match!r}")


def _draft_rows(
    drafter: Drafter, rows: list[list[int]], budgets: list[int], thresholds: list[float], stop_ids: Sequence[int], want_logprobs: bool
) -> list[Draft]:
    cache = drafter.cache
    slots, reused = cache.assign(rows)
    # Decode reads every row's slot up to the longest row plus the largest budget, whichever rows those are.
    cache.clear_garbage(slots, min(max(map(len, rows)) + max(budgets), cache.max_len))
    first_logits = _prefill(drafter.model, cache, rows, slots, reused)
    tokens, counts, logprobs = _decode(drafter.model, cache, first_logits, rows, slots, budgets, thresholds, stop_ids, want_logprobs)
    tokens, counts = tokens.tolist(), counts.tolist()  # the one device -> host transfer of the call
    logprobs = logprobs.tolist() if want_logprobs else None
    drafts = []
    for b, (row, slot) in enumerate(zip(rows, slots)):
        drafted = tokens[b][: counts[b]]
        cache.commit(slot, row, drafted[:-1])  # every draft token but the last was fed through the model
        drafts.append(Draft(drafted, reused[b], logprobs[b][: counts[b]] if logprobs else None))
    return drafts


def _prefill(model: Transformer, cache: KVCache, rows: list[list[int]], slots: list[int], reused: list[int]) -> torch.Tensor:
    """Run each row's uncached suffix through the model, in chunks; the last token's logits (B, vocab)."""
    device = model.norm.weight.device
    suffixes = [row[r:] for row, r in zip(rows, reused)]
    longest = max(len(s) for s in suffixes)
    chunk = max(1, PREFILL_CHUNK_TOKENS // len(rows))
    last_hidden = [None] * len(rows)
    for start in range(0, longest, chunk):
        width = min(chunk, longest - start)
        # Rows are right-padded; padding sits at position 0 and writes only to the scratch slot.
        token_ids, positions, write_slots = [], [], []
        for suffix, r, slot in zip(suffixes, reused, slots):
            part = suffix[start : start + width]
            pad = width - len(part)
            token_ids.append(part + [0] * pad)
            positions.append(list(range(r + start, r + start + len(part))) + [0] * pad)
            write_slots.append([slot] * len(part) + [cache.scratch] * pad)
        kv_len = max(r + min(len(s), start + width) for s, r in zip(suffixes, reused))
        # A padding query sees keys of its row's slot under the causal mask too; its output is dropped.
        causal = start == 0 and not any(reused)
        at = ForwardInputs(torch.tensor(positions, device=device), torch.tensor(write_slots, device=device), slots, kv_len, causal)
        hidden = model(torch.tensor(token_ids, device=device), cache, at)  # (B, width, hidden)
        for b, suffix in enumerate(suffixes):
            if start <= len(suffix) - 1 < start + width:
                last_hidden[b] = hidden[b, len(suffix) - 1 - start]
    return model.logits(torch.stack(last_hidden))


def _decode(
    model: Transformer,
    cache: KVCache,
    logits: torch.Tensor,
    rows: list[list[int]],
    slots: list[int],
    budgets: list[int],
    thresholds: list[float],
    stop_ids: Sequence[int],
    want_logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Greedy decoding of the whole batch, one forward per step; everything stays on the device.

    Returns draft tokens (B, steps), how many of them each row drafted (B,), and their logprobs.
    """
    device = logits.device
    steps = max(max(budgets), 1)
    lengths = torch.tensor([len(row) for row in rows], device=device)
    budget = torch.tensor(budgets, device=device)
    slot_ids = torch.tensor(slots, device=device)
    stop = torch.tensor(list(stop_ids), device=device, dtype=torch.long)
    min_confidence = torch.tensor(thresholds, device=device) if any(thresholds) else None
    tokens = torch.zeros(len(rows), steps, dtype=torch.long, device=device)
    logprobs = torch.zeros(len(rows), steps, device=device) if want_logprobs else None
    counts = torch.zeros(len(rows), dtype=torch.long, device=device)
    alive = budget > 0  # rows still drafting
    # Every step attends over the same keys, through the last step's: shapes stay static across steps
    # (what a captured CUDA graph needs), and the keys not yet written are masked and were zeroed.
    kv_len = min(max(len(row) for row in rows) + steps, cache.max_len)
    for step in range(steps):
        token = logits.max(dim=-1).indices  # (B,); the first maximum, as argmax, which is 4x slower on bf16 rows
        tokens[:, step] = token
        if want_logprobs:
            logprobs[:, step] = logits.float().log_softmax(dim=-1).gather(1, token[:, None])[:, 0]
        counts += alive
        alive = alive & ~torch.isin(token, stop) & (budget > step + 1)
        if min_confidence is not None:
            alive = alive & (logits.float().softmax(dim=-1).amax(dim=-1) >= min_confidence)
        if step + 1 == steps or not alive.any():
            break
        # Feed each live row's new token at the next position; finished rows write to scratch.
        positions = torch.where(alive, lengths + step, 0)[:, None]
        write_slots = torch.where(alive, slot_ids, cache.scratch)[:, None]
        at = ForwardInputs(positions, write_slots, slots, kv_len)
        logits = model.logits(model(token[:, None], cache, at)[:, -1])
    return tokens, counts, logprobs
