"""The decoder: a Qwen3 / Llama / Qwen2 transformer in plain PyTorch, read top to bottom.

config -> primitives (RMSNorm, RoPE) -> LoRA and fused projections -> attention, MLP, block -> model.
Module names mirror transformers', so checkpoint keys map 1:1; checkpoint.py builds and loads it.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from attention_kernel import chunk_attention, query_attention
from int4 import Int4Linear, blockwise_matmul, chunk_rows_matmul
from kv_cache import KVCache
from planning import CHUNK


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


# ----------------------------------------------------------------------------------------------
# Primitives


def _normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, rounded to x's dtype: PyTorch's fused kernel, which computes in fp32
    whatever x's dtype."""
    return F.rms_norm(x, x.shape[-1:], eps=eps)


# RMSNorm's normalisation is an operator of its own, so that a compiled step calls this same kernel: inductor
# would fuse it with the residual add before it and sum the squares in another order, a last-bit difference
# from the eager step that a near-tie turns into another token. It is registered with torch.library's plain
# API: torch.library.custom_op's Python wrapper costs more than the kernel at a decode step's sizes.
_NORM_LIBRARY = torch.library.Library("draft_server_norm", "DEF")
_NORM_LIBRARY.define("rms_norm(Tensor x, float eps) -> Tensor")
_NORM_LIBRARY.impl("rms_norm", _normalise, "CompositeExplicitAutograd")
normalised = torch.ops.draft_server_norm.rms_norm.default


@torch.library.register_fake("draft_server_norm::rms_norm")
def _normalised_shape(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernel = False  # normalise by rms_norm.cpp (Transformer.use_norm_kernel), else by PyTorch's operator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise, round to x's dtype, then scale: the order transformers uses.
        if self.kernel:
            return self.weight * torch.ops.draft_server_rms_norm.rms_norm.default(x.contiguous(), self.eps)
        return self.weight * normalised(x, self.eps)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for the half-split RoPE form. positions (N,) -> two (N, 1, head_dim) tensors."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq  # (N, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # (N, 1, head_dim), broadcast over heads
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, H, D): rotate each (i, i + D/2) pair by its position's angle."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------------------------
# Linear layers. An INT4 layer has two ways to multiply: unpacked to dense bf16 (fast for many rows)
# and the kernel (fast for a few); their results differ in the last bits. The caller says which rows
# take the dense way (`dense_rows`, the first rows of x), so the choice follows each token's place in
# its own sequence and never the size of the batch it happens to share.


# Dense matmuls run this many rows at a time: fewer rows take a matrix-vector kernel whose rows differ in the
# last bits from the matrix-matrix one, and more let the library change its blocking with the size.
MIN_MATMUL_ROWS = 16


def project(layer: nn.Module, x: torch.Tensor, dense_rows: int) -> torch.Tensor:
    """x (N, in) -> (N, out) through any of the model's linear kinds."""
    if isinstance(layer, nn.Linear):
        return row_invariant_linear(x, layer.weight, layer.bias, dense_rows)
    return layer(x, dense_rows)


def row_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, dense_rows: int = 0
) -> torch.Tensor:
    """F.linear whose rows do not depend on how many rows x (N, in) has. The first dense_rows rows (a prefill's
    complete chunks) go in blocks of whole chunks (int4.chunk_rows_matmul), which a matmul runs faster per row than
    the rest's blocks of MIN_MATMUL_ROWS; a row takes one or the other by its place in its sequence, never by its
    batch."""
    if 0 < dense_rows:  # both ways write into one output (blockwise_matmul's out), as Int4Linear's do
        out = x.new_empty(x.shape[0], weight.shape[0])
        chunk_rows_matmul(x[:dense_rows], weight.t(), out=out[:dense_rows])
        if dense_rows < x.shape[0]:
            blockwise_matmul(x[dense_rows:], weight.t(), MIN_MATMUL_ROWS, out=out[dense_rows:])
    else:
        out = blockwise_matmul(x, weight.t(), MIN_MATMUL_ROWS)
    return out if bias is None else out + bias


# ----------------------------------------------------------------------------------------------
# LoRA (a PEFT adapter kept unmerged as A, B and scale, or merged into the base weight)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(lora_A.float(), requires_grad=False)  # (r, in), fp32 whatever the model's dtype
        self.lora_B = nn.Parameter(lora_B.float() * scale, requires_grad=False)  # (out, r), the scale folded in
        self.register_buffer("lora_Bt", None, persistent=False)  # B^T for a base that adds the side: prepare_fused_side

    def prepare_fused_side(self) -> None:
        """Lay B^T out as int4-bf16dot takes it, (out/64, r, 64), where the base layer adds the side product
        itself (Int4Linear.fuses_lora; Transformer.use_cpu_int4_kernel calls this); else keep none."""
        fuses = isinstance(self.base, Int4Linear) and self.base.fuses_lora
        blocks = self.lora_B.t().reshape(self.lora_B.shape[1], -1, 64).transpose(0, 1).contiguous() if fuses else None
        self.lora_Bt = blocks

    def forward(self, x: torch.Tensor, dense_rows: int = 0) -> torch.Tensor:
        if self.lora_Bt is not None:
            # int4-bf16dot adds the side product to each kernel row before rounding it; complete chunks merge
            # the adapter into their unpacked weight as below.
            lora, side = (self.lora_A, self.lora_B), (self.lora_A, self.lora_Bt)
            return self.base(x, dense_rows, lora=lora, side=side)
        if dense_rows and isinstance(self.base, Int4Linear) and self.base.dense_prefill:
            # A complete chunk's rows multiply an unpacked weight anyway: the adapter is merged into it (once
            # per call, not per row), which costs a prefill far less than side matmuls over every row.
            dense = self.base(x[:dense_rows], dense_rows, lora=(self.lora_A, self.lora_B))
            return dense if dense_rows == x.shape[0] else torch.cat([dense, self.with_side(x[dense_rows:], 0)])
        return self.with_side(x, dense_rows)

    def with_side(self, x: torch.Tensor, dense_rows: int) -> torch.Tensor:
        # The side matmuls run in the adapter's fp32: a rank-r bf16 GEMM pays oneDNN's bf16 set-up,
        # which dominates such small products, and the adapter was trained in fp32. Both take the same
        # MIN_MATMUL_ROWS-row blocks as row_invariant_linear, padded once (x A^T of a zero row is zero).
        rows = x.shape[0]
        padded = F.pad(x.float(), (0, 0, 0, -rows % MIN_MATMUL_ROWS))
        blocks = [block @ self.lora_A.t() @ self.lora_B.t() for block in padded.split(MIN_MATMUL_ROWS)]
        side = (blocks[0] if len(blocks) == 1 else torch.cat(blocks))[:rows]
        return project(self.base, x, dense_rows).add_(side)  # added in fp32, rounded once to the base's dtype

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

FUSED_PROJECTIONS = {
    "self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "mlp": ("gate_up_proj", ("gate_proj", "up_proj")),
}


class Concat(nn.Module):
    """The fallback when parts cannot share one matmul (mixed kinds): their outputs, concatenated."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor, dense_rows: int = 0) -> torch.Tensor:
        return torch.cat([project(part, x, dense_rows) for part in self.parts], dim=-1)


def concat_outputs(parts: list[nn.Module]) -> nn.Module:
    """One module computing the parts' outputs concatenated, as a single matmul where their kinds allow."""
    adapters = [p for p in parts if isinstance(p, LoRALinear)]
    if adapters:
        # x A^T stacks every adapter's rank-r input; the block-diagonal B sends each to its own part's
        # outputs, and nothing to a part without an adapter (an empty block: its side output is exactly 0).
        bases = [p.base if isinstance(p, LoRALinear) else p for p in parts]
        lora_A = torch.cat([a.lora_A for a in adapters])  # (adapters * r, in)
        lora_B = torch.block_diag(
            *[p.lora_B if isinstance(p, LoRALinear) else torch.zeros(p.out_features, 0) for p in parts]
        )
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
    if (
        kinds == {Int4Linear}
        and len({p.group_size for p in parts}) == 1
        and all(p.out_features % 64 == 0 for p in parts)
    ):
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


@dataclass(frozen=True)
class Segment:
    """Consecutive tokens of one sequence in a prefill, attending over their slot's keys 0..window-1.

    The window ends at the end of the chunk holding the tokens, whichever call computes them, so a
    token's attention reads the same keys (the later ones masked) alone, in a batch, or after a cached
    prefix: what makes drafts independent of batch-mates and of the cache.
    """

    start: int  # tokens start..stop-1 of the forward
    stop: int
    slot: int
    position: int  # the position of token `start` in its sequence
    window: int
    complete_chunk: bool  # a whole chunk of positions: dense weights and chunk attention, else a tail's few queries

    def mask(self, device: torch.device) -> torch.Tensor:
        """(T, window): 0 where query t may see the key, that is where key position <= position + t, and
        -inf elsewhere."""
        keys = torch.arange(self.window, device=device)
        queries = torch.arange(self.position, self.stop - self.start + self.position, device=device)
        return torch.zeros(len(queries), self.window, device=device).masked_fill_(
            keys > queries[:, None], float("-inf")
        )


@dataclass(frozen=True)
class Outputs:
    """The tokens of a prefill whose final hidden states the caller reads (the segments that end their rows).
    After its attention the last layer computes only these: of the other tokens a prefill needs only the keys
    and values. They are whole segments, so the dense path's 64-row blocks are the ones the full forward makes
    and each kept token's bits are the same."""

    rows: torch.Tensor  # (M,) indices into the forward's N tokens, complete chunks' tokens first
    dense_rows: int  # rows 0..dense_rows-1 of them fill complete chunks


@dataclass
class Plan:
    """What one prefill forward computes: N tokens of one or more sequences, flattened in one row each."""

    positions: torch.Tensor  # (N,) each token's position in its sequence
    write_slots: torch.Tensor  # (N,) the cache slot receiving each token's keys and values
    segments: list[Segment]
    dense_rows: int  # tokens 0..dense_rows-1 fill complete chunks and take the dense-weight path
    outputs: Outputs | None = None  # the tokens whose final hidden states the forward returns; None: all
    # Segment i's mask for SDPA, made at its first use and kept for every layer (the CPU kernels need none).
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, i: int, device: torch.device) -> torch.Tensor:
        if i not in self.masks:
            self.masks[i] = self.segments[i].mask(device)
        return self.masks[i]


@dataclass
class StepPlan:
    """What one decode step computes: one token per row, all tensors on the device, fixed shapes.

    Row b feeds its token at positions[b], writes its keys and values to write_slots[b] (the scratch
    slot for padding and finished rows) and attends over keys 0..window-1 of read_slots[b]. The window
    is the length of a tensor, not an int, so that a compiled step takes it as a dynamic size."""

    positions: torch.Tensor  # (B,)
    write_slots: torch.Tensor  # (B,)
    read_slots: torch.Tensor  # (B,)
    key_positions: torch.Tensor  # (window / KEY_BLOCK, KEY_BLOCK): 0..window-1 by blocks
    dense_rows: int = 0  # a step's tokens all take the INT4 kernel


def chunk_attention_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A complete chunk's queries q (T, H, D) over keys, values (H_kv, window, D), mask (T, window), in the
    model's dtype by the flash kernel, which is built for many queries -> (T, H, D)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask.to(q.dtype), enable_gqa=True
    )
    return out[0].transpose(0, 1)


KEY_BLOCK = CHUNK  # keys per attention block: a chunk, so a chunk's window is whole blocks


def stack_queries(products: list[torch.Tensor]) -> torch.Tensor:
    """Per-query results stacked on a new first dimension; a decode step's one query without a copy."""
    return products[0][None] if len(products) == 1 else torch.stack(products)


def block_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Causal attention of a few queries per row, exact whatever the window: q (G, T, H, D) at positions (G, T)
    over keys, values (G, H_kv, W, D) with W a multiple of KEY_BLOCK -> (G, T, H, D), in fp32 math.

    Each query is its own set of products: its `group` heads sharing a kv head, against KEY_BLOCK keys at a
    time, always the same (group, D) x (D, KEY_BLOCK) shape whatever T, G or W. Each block's scores, maximum,
    exponentials, sum and weighted values are combined by a running (cumulative) sum read at the query's own
    last block. So a query's result depends only on its own keys up to its position: not on the window (the
    blocks after its own are never added in), nor on the other queries or rows of the call. A decode step
    (T = 1, a row per sequence) and a prefill's last chunk (G = 1) give the same bits for the same token,
    which lets the cache reuse either. No query rows are padding, so a decode step computes only its own
    heads. No SDPA backend is involved: on CUDA an explicit mask with GQA would fall back to its math kernel."""
    G, T, H, D = q.shape
    H_kv, W = keys.shape[1], keys.shape[2]
    group, blocks = H // H_kv, W // KEY_BLOCK
    products = (T, G, H_kv, blocks)  # one (group, D) x (D, KEY_BLOCK) product each
    # Every operand laid out contiguously, whatever the strides of q (a view of the fused projection) and
    # whatever T: batched matmul may take another code path, with other bits, for other layouts. The queries
    # come first, so that one batched product per query serves all its blocks, and the keys and values are
    # read as they are rather than copied once per query.
    grouped = q.float().view(G, T, H_kv, group, D).transpose(0, 1)[:, :, :, None]  # (T, G, H_kv, 1, group, D)
    grouped = grouped.expand(*products, group, D).contiguous().view(T, -1, group, D)  # (T, G*H_kv*blocks, group, D)
    k = keys.float().reshape(-1, KEY_BLOCK, D).transpose(1, 2)  # (G*H_kv*blocks, D, KEY_BLOCK)
    v = values.float().reshape(-1, KEY_BLOCK, D)  # (G*H_kv*blocks, KEY_BLOCK, D)
    row_positions = positions.t().reshape(T, G, 1, 1, 1, 1)
    key_positions = torch.arange(W, device=q.device).view(blocks, 1, KEY_BLOCK)
    scores = stack_queries([torch.bmm(query, k) for query in grouped]).mul_(D**-0.5)  # (T, G*H_kv*blocks, group, KB)
    scores = scores.view(*products, group, KEY_BLOCK)
    scores = scores.masked_fill_(key_positions > row_positions, float("-inf"))  # also hides unwritten memory
    block_max = scores.amax(dim=-1, keepdim=True)  # (..., group, 1)
    probs = (scores - block_max).exp_()
    block_sum = probs.sum(dim=-1, keepdim=True)
    block_out = stack_queries([torch.bmm(p.view(-1, group, KEY_BLOCK), v) for p in probs]).view(*products, group, D)
    weight = (block_max - block_max.amax(dim=3, keepdim=True)).exp_()  # each block's share of the softmax
    last = (row_positions // KEY_BLOCK).clamp_(min=0).expand(T, G, H_kv, 1, group, 1)
    total = (weight * block_sum).cumsum(dim=3).gather(3, last)
    out = (weight * block_out).cumsum(dim=3).gather(3, last.expand(*last.shape[:-1], D)).div_(total)
    return out.view(T, G, H_kv, group, D).transpose(0, 1).reshape(G, T, H, D).to(q.dtype)


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
        # attention_kernel's CPU kernels (Transformer.use_attention_kernels): query_kernel for few_queries, and for
        # complete chunks too unless chunk_kernel takes them.
        self.query_kernel = self.chunk_kernel = False
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache: KVCache, layer: int, plan: Plan | StepPlan, keep: Outputs | None = None):
        """x (N, hidden) -> (N, hidden), or the keep.rows only (keys and values are written for all N)."""
        N, H, H_kv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        heads = project(self.qkv_proj, x, plan.dense_rows).view(N, H + 2 * H_kv, D)
        q_and_k, v = heads.split([H + H_kv, H_kv], dim=1)
        if hasattr(self, "q_norm"):
            q_and_k = torch.cat([self.q_norm(q_and_k[:, :H]), self.k_norm(q_and_k[:, H:])], dim=1)
        q, k = apply_rope(q_and_k, cos, sin).split([H, H_kv], dim=1)  # one rotation for both
        cache.write(layer, plan.write_slots, plan.positions, k, v)
        if isinstance(plan, StepPlan):
            window = plan.key_positions.numel()
            out = self.few_queries(q[:, None], cache, layer, plan.read_slots, plan.positions[:, None], window)[:, 0]
        else:
            out = self.prefill_attention(q, cache, layer, plan)
        if keep is not None:
            return project(self.o_proj, out[keep.rows].flatten(1), keep.dense_rows)
        return project(self.o_proj, out.reshape(N, H * D), plan.dense_rows)

    def prefill_attention(self, q: torch.Tensor, cache: KVCache, layer: int, plan: Plan) -> torch.Tensor:
        """q (N, H, D) -> (N, H, D), segment by segment. With the CPU kernels, the complete chunks (the first
        plan.dense_rows tokens, a chunk each CHUNK of them) go in one call."""
        out = torch.empty_like(q)
        chunks = plan.dense_rows // CHUNK
        if self.query_kernel and chunks:
            kernel = chunk_attention if self.chunk_kernel else query_attention
            slots = plan.write_slots[: plan.dense_rows : CHUNK]  # (chunks,)
            positions = plan.positions[: plan.dense_rows].view(chunks, CHUNK)
            queries = q[: plan.dense_rows].view(chunks, CHUNK, *q.shape[1:])
            attended = kernel(queries, cache.keys[layer], cache.values[layer], slots, positions)
            out[: plan.dense_rows] = attended.flatten(0, 1)  # (chunks, CHUNK, H, D) -> (dense_rows, H, D)
        for i, segment in enumerate(plan.segments):
            queries = q[segment.start : segment.stop]  # (T, H, D)
            if segment.complete_chunk and not self.query_kernel:
                keys, values = cache.window(layer, segment.slot, segment.window)  # views of the slot: no copy
                out[segment.start : segment.stop] = chunk_attention_sdpa(queries, keys, values, plan.mask(i, q.device))
            elif not segment.complete_chunk:
                slots = plan.write_slots[segment.start : segment.start + 1]
                positions = plan.positions[None, segment.start : segment.stop]
                out[segment.start : segment.stop] = self.few_queries(
                    queries[None], cache, layer, slots, positions, segment.window
                )[0]
        return out

    def few_queries(self, q, cache: KVCache, layer: int, slots, positions, window: int) -> torch.Tensor:
        """q (G, T, H, D) at positions (G, T) of cache slots (G,), whose keys end by `window` -> (G, T, H, D):
        by the CPU kernel reading the cache in place where the model uses it, else by block_attention."""
        if self.query_kernel:
            return query_attention(q, cache.keys[layer], cache.values[layer], slots, positions)
        keys, values = cache.window(layer, slots, window)  # (G, H_kv, window, D)
        return block_attention(q, keys, values, positions)


class MLP(nn.Module):
    """gate_proj and up_proj are fused into gate_up_proj at load, like q, k and v."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, dense_rows: int) -> torch.Tensor:
        gate, up = project(self.gate_up_proj, x, dense_rows).chunk(2, dim=-1)
        return project(self.down_proj, F.silu(gate) * up, dense_rows)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache: KVCache, layer: int, plan: Plan | StepPlan, keep: Outputs | None = None):
        """x (N, hidden) -> (N, hidden), or the keep.rows only (keys and values are written for all N)."""
        attended = self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, plan, keep)
        x, dense_rows = (x, plan.dense_rows) if keep is None else (x[keep.rows], keep.dense_rows)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x), dense_rows)


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

    def use_cpu_int4_kernel(self, name: str) -> None:
        """Multiply every Int4Linear's kernel rows with `name` (one of int4.PACKED_CPU_KERNELS)."""
        for module in self.modules():
            if isinstance(module, Int4Linear):
                module.use_cpu_kernel(name)
        for module in self.modules():
            if isinstance(module, LoRALinear):
                module.prepare_fused_side()

    def use_attention_kernels(self, query_kernel: bool, chunk_kernel: bool) -> None:
        """Attend with attention_kernel's CPU kernels: a decode step's and a prefill tail's queries by
        query_attention (else block_attention), a prefill's complete chunks by chunk_attention (chunk_kernel),
        else by query_attention (query_kernel), else by SDPA."""
        for layer in self.layers:
            layer.self_attn.query_kernel, layer.self_attn.chunk_kernel = query_kernel, chunk_kernel

    def use_norm_kernel(self, on: bool) -> None:
        """Normalise every RMSNorm by rms_norm.cpp (attention_kernel.wants_norm_kernel), or by PyTorch's operator."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = on

    def use_cuda_int4_kernels(self) -> None:
        """Repack every Int4Linear (on a CUDA device) for the CUDA kernel. A tied INT4 table is first copied
        out as a dense embedding: the kernel's tiles cannot be read row by row."""
        if self.embed_tokens is None:
            self.embed_tokens = nn.Embedding.from_pretrained(self.lm_head.dense_weight().contiguous(), freeze=True)
        for module in self.modules():
            if isinstance(module, Int4Linear):
                module.use_cuda_kernel()

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids (N,) -> (N, hidden); without a table of its own, the rows of the INT4 lm_head."""
        return self.embed_tokens(token_ids) if self.embed_tokens is not None else self.lm_head.rows(token_ids)

    def forward(self, token_ids: torch.Tensor, cache: KVCache, plan: Plan | StepPlan) -> torch.Tensor:
        """token_ids (N,) -> final hidden states (N, hidden), or of a prefill's plan.outputs.rows only; keys and
        values of all N written to the cache on the way."""
        x = self.embed(token_ids)
        cos, sin = rope_cos_sin(plan.positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        outputs = plan.outputs if isinstance(plan, Plan) else None
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, cache, i, plan, outputs if i == len(self.layers) - 1 else None)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) in the model's dtype: argmax needs no fp32 copy of a 150k-wide row;
        probabilities take one. An INT4 head always runs on the kernel, whose rows do not depend on N."""
        return project(self.lm_head, hidden, dense_rows=0)
