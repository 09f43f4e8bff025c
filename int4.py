"""The GPTQ INT4 format and PyTorch's INT4 kernels (CPU and CUDA): one set of pure functions for writers and the runtime.

Per Linear with K inputs, N outputs and group size G, a GPTQ checkpoint holds qweight int32 [K/8, N]
(packed along inputs), qzeros int32 [K/G, N/8] (packed along outputs), scales fp16 [K/G, N] and g_idx
int32 [K]. Nibble j of an int32 holds bits 4j..4j+3, and W[n, k] = scales[g[k], n] * (q[k, n] - zero[g[k], n]).
"gptq" (v1) checkpoints store zero - 1 (masked to 4 bits); "gptq_v2" stores the zero itself.

One implementation of the 4-bit grid serves every writer and reader: `group_grid` (scale and zero of a
group), `quantize` (values onto a grid) and `dequantize` (integers back to weights). GPTQ
(evidence/quantize/gptq_drafter.py), the round-to-nearest baseline and the INT4 embedding table (`rtn_integers`,
`rtn_quantize`) are built from them and write with `gptq_pack`; the loader reads with `gptq_integers` /
`gptq_dequantize`; `Int4Linear` holds a layer in the kernel's layout.
"""

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kernel_build import build_cpu_kernel

log = logging.getLogger(__name__)

NIBBLES_PER_INT32 = 8
MAX_Q = 15  # 4-bit integers are 0..15
MIN_SCALE = 2**-14  # fp16's smallest normal number: the floor of every scale
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


def gptq_pack(
    int_weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors for one Linear. int_weight [N, K] and zeros [K/G, N] hold 0..15; scales [K/G, N]."""
    stored_zeros = (zeros.to(torch.int64) - ZERO_OFFSET["gptq"]) & 0xF
    return {
        "qweight": pack_int4(int_weight.t(), dim=0),
        "qzeros": pack_int4(stored_zeros, dim=1),
        "scales": scales.to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }


def gptq_integers(
    qweight: torch.Tensor, qzeros: torch.Tensor, checkpoint_format: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit weights q (K, N) and the real zero points (K/G, N) of GPTQ tensors."""
    zeros = (unpack_int4(qzeros, dim=1) + ZERO_OFFSET[checkpoint_format]) & 0xF
    return unpack_int4(qweight, dim=0), zeros


def dequantize(
    int_weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """W [N, K] = scales[g[k], n] * (q[n, k] - zeros[g[k], n]): what 4-bit weights [N, K] mean, in fp32."""
    groups = g_idx.to(torch.int64)
    return (scales.float()[groups] * (int_weight.t() - zeros[groups]).float()).t().contiguous()


def gptq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    checkpoint_format: str = "gptq",
) -> torch.Tensor:
    """The fp32 weight [N, K] (nn.Linear layout) that a GPTQ checkpoint means."""
    q, zeros = gptq_integers(qweight, qzeros, checkpoint_format)
    return dequantize(q.t(), zeros, scales, g_idx)


def group_grid(values: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit grid (fp16-representable scale, integer zero 0..15) of each group: values [..., G] -> two
    tensors [...]. The grid spans [min(v, 0), max(v, 0)]; symmetric grids span +-max|v| around zero 8.

    The scale is rounded to fp16 here because the stored fp16 scale is what dequantizes, and floored at
    2^-14 (fp16's smallest normal): an all-zero group then still has a usable scale and dequantizes to 0."""
    low, high = values.amin(dim=-1).clamp(max=0), values.amax(dim=-1).clamp(min=0)
    if sym:
        high = torch.maximum(high, -low)
        low = -high
    scales = ((high - low) / MAX_Q).clamp(min=MIN_SCALE).half().float()
    zeros = torch.full_like(scales, (MAX_Q + 1) // 2) if sym else torch.round(-low / scales).clamp(0, MAX_Q)
    return scales, zeros.long()


def quantize(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Round values onto their grids (broadcast): the integers 0..15 of clamp(round(v / scale) + zero)."""
    return torch.clamp(torch.round(values / scales) + zeros, 0, MAX_Q).long()


def rtn_integers(
    weight: torch.Tensor, group_size: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of a weight [N, K] per group of `group_size` inputs: (int_weight [N, K],
    zeros [K/G, N], scales [K/G, N], g_idx [K]), the arguments of gptq_pack and dequantize."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"rtn: input width {in_features} is not a multiple of the group size {group_size}")
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)  # (N, K/G, G)
    scales, zeros = group_grid(groups, sym)  # (N, K/G)
    ints = quantize(groups, scales[..., None], zeros[..., None]).reshape(out_features, in_features)
    return ints, zeros.t(), scales.t(), torch.arange(in_features, device=weight.device) // group_size


def rtn_quantize(weight: torch.Tensor, group_size: int, sym: bool) -> dict[str, torch.Tensor]:
    """Round-to-nearest 4-bit GPTQ tensors of a weight [N, K] (see rtn_integers). GPTQ's baseline, and
    the quantizer of an INT4 embedding table."""
    return gptq_pack(*rtn_integers(weight, group_size, sym))


INT4_KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's CPU and CUDA INT4 kernels accept
INT4_KERNEL_DTYPE = torch.bfloat16  # its fast path; fp32 activations take a much slower one
# The kernel is a matrix-vector one: its cost grows with every row, so for a prefill's many rows
# unpacking the layer to bf16 and one dense matmul is faster (transformer.py decides which rows).
DENSE_PREFILL_BLOCK = 2048  # output rows unpacked at a time (a multiple of the kernel's 64-row blocks)
DENSE_ROW_BLOCK = 64  # input rows per unpacked matmul: a prefill's dense rows come in chunks of 64
WIDE_ROW_BLOCK = 256  # input rows per matmul over runs of complete chunks, where chunk_rows_matmul may take them
KERNEL_ROWS = 4  # rows per CPU kernel call on a large layer (see Int4Linear.kernel)
LARGE_LAYER_BYTES = 8 * 2**20  # packed bytes from which a layer counts as large


def blockwise_matmul(a: torch.Tensor, b: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """a (M, K) @ b (K, N), `block` rows of a at a time (the last block zero-padded), so each row's result is
    that of the same (block, K) x (K, N) product whatever M is. BLAS libraries choose kernels, and with several
    threads split the K reduction, by the sizes of the whole product. With `out` (an (M, N) view, such as some
    columns of a wider output) the blocks are written there, in place of a new tensor made by concatenation:
    the same products, so the same bits."""
    rows = a.shape[0]
    if out is None and rows <= block:  # one block (a decode step's rows): one product, no output to fill
        return (torch.nn.functional.pad(a, (0, 0, 0, block - rows)) @ b)[:rows]
    out = a.new_empty(rows, b.shape[1]) if out is None else out
    for start in range(0, rows, block):
        part = a[start : start + block]
        if part.shape[0] == block:
            torch.matmul(part, b, out=out[start : start + block])
        else:
            padded = torch.nn.functional.pad(part, (0, 0, 0, block - part.shape[0]))
            out[start:] = (padded @ b)[: part.shape[0]]
    return out


def chunk_rows_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out (M, N) = a (M, K) @ b (K, N) for a prefill's complete chunks (M a multiple of DENSE_ROW_BLOCK, a
    chunk's rows): WIDE_ROW_BLOCK rows at a time while that many remain, then a chunk at a time. A matmul of more
    rows runs nearer the core's peak, so this is taken only where the library gives each row the same bits in
    either block at any place (wide_blocks_keep_rows): a row's bits then follow from its chunk alone, not from
    the chunks beside it in the forward."""
    wide = a.shape[0] // WIDE_ROW_BLOCK * WIDE_ROW_BLOCK if wide_blocks_keep_rows(a.shape[1], b) else 0
    if wide:
        blockwise_matmul(a[:wide], b, WIDE_ROW_BLOCK, out=out[:wide])
    if wide < a.shape[0]:
        blockwise_matmul(a[wide:], b, DENSE_ROW_BLOCK, out=out[wide:])


def wide_blocks_keep_rows(K: int, b: torch.Tensor) -> bool:
    """Does a (WIDE_ROW_BLOCK, K) @ b product give every chunk of its rows the bits that chunk gets as a
    (DENSE_ROW_BLOCK, K) product of its own? A property of the library's kernels for this shape, layout, dtype,
    device and thread count, probed once each with random values (a kernel that reduces in another order shows
    it at once): true of PyTorch's bf16 and fp32 CPU matmuls on the Zen 4 measured, assumed nowhere."""
    return _wide_blocks_keep_rows(K, tuple(b.shape), b.stride(), b.dtype, b.device, torch.get_num_threads())


@functools.cache
def _wide_blocks_keep_rows(K: int, shape: tuple, stride: tuple, dtype, device, threads: int) -> bool:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(WIDE_ROW_BLOCK, K, generator=generator).to(device, dtype)
    b = torch.empty_strided(shape, stride, dtype=dtype, device=device).copy_(torch.randn(shape, generator=generator))
    together = a @ b
    chunks = range(0, WIDE_ROW_BLOCK, DENSE_ROW_BLOCK)
    return all(torch.equal(together[s : s + DENSE_ROW_BLOCK], a[s : s + DENSE_ROW_BLOCK] @ b) for s in chunks)


KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")  # what the choice reads
BF16_HARDWARE = ("avx512_bf16", "amx_bf16")  # a CPU that multiplies bf16 in hardware has one of these


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction sets of this CPU that the kernel choice reads (/proc/cpuinfo; none where it is absent)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return frozenset(flags) & frozenset(KERNEL_FLAGS)


def cpu_description() -> str:
    """What this CPU offers the kernels, in words: its flags and the SIMD level torch dispatches to."""
    flags = ", ".join(f for f in KERNEL_FLAGS if f in cpu_flags()) or "none of " + ", ".join(KERNEL_FLAGS)
    return f"{flags} (torch dispatches {torch.backends.cpu.get_cpu_capability()})"


@dataclass(frozen=True)
class CpuKernel:
    """One way to multiply a GPTQ model's INT4 layers on the CPU: the weights it keeps and its compute dtype."""

    weights: str  # "packed" (4-bit, PyTorch's INT4 kernel) or "dequant" (dense, dequantized once at load)
    dtype: torch.dtype
    needs: tuple[str, ...]  # CPU flags, any one of which it needs (empty: any CPU)
    what: str


CPU_KERNELS = {
    "int4pack": CpuKernel(
        "packed",
        torch.bfloat16,
        (),
        "PyTorch's INT4 matrix-vector kernel for decode rows (4-bit weights read once per few rows); a prefill's "
        "complete chunks multiply the layer unpacked per call (bf16 where the CPU has bf16 hardware, else fp32)",
    ),
    "int4-bf16dot": CpuKernel(
        "packed",
        torch.bfloat16,
        ("avx512_bf16",),
        "this project's INT4 kernel (int4_bf16dot.cpp, built at first use): 4-bit weights unpacked once per call "
        "for all its rows and multiplied with AVX512-BF16 dot products, so a batch's rows cost little more than one, "
        "a LoRA adapter's side product added inside; a prefill's complete chunks as int4pack",
    ),
    "dense-bf16": CpuKernel(
        "dequant",
        torch.bfloat16,
        BF16_HARDWARE,
        "weights dequantized once at load to bf16 (LoRA merged, 3x the memory of INT4): every row a dense bf16 "
        "matmul, which hardware bf16 (AMX above all) runs for many rows at the cost of one",
    ),
    "dense-fp32": CpuKernel(
        "dequant", torch.float32, (), "weights dequantized once at load to fp32 (LoRA merged, 6x the memory): exact"
    ),
}
PACKED_CPU_KERNELS = tuple(name for name, kernel in CPU_KERNELS.items() if kernel.weights == "packed")
BF16DOT_SOURCE = Path(__file__).with_name("int4_bf16dot.cpp")
# Compiled for these instruction sets whatever the build machine has; it runs only where cpu_flags() has them.
BF16DOT_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]


@functools.cache
def bf16dot_build_problem() -> str | None:
    """Build and load the int4-bf16dot kernel (build_cpu_kernel). Why it cannot, or None."""
    fake = {"draft_server::int4_bf16dot_mm": _bf16dot_shape}
    return build_cpu_kernel(
        "int4-bf16dot", "draft_server_int4_bf16dot", BF16DOT_SOURCE, BF16DOT_CFLAGS, "int4pack serves", fake
    )


def _bf16dot_shape(x, packed, scales_and_offsets, group_size, lora_A=None, lora_Bt=None):
    """int4_bf16dot_mm's output, for torch.compile's tracing: (M, N)."""
    return x.new_empty(x.shape[0], packed.shape[0])


def packed_cpu_kernel(name: str = "auto") -> str:
    """The kernel packed INT4 layers multiply with on this CPU: `name` where it names a packed kernel (checked
    as choose_cpu_kernel does), else int4-bf16dot where the CPU has AVX512-BF16 and the kernel builds, else
    int4pack."""
    if name in PACKED_CPU_KERNELS:
        return choose_cpu_kernel(name)
    has_needs = bool(set(CPU_KERNELS["int4-bf16dot"].needs) & cpu_flags())
    return "int4-bf16dot" if has_needs and bf16dot_build_problem() is None else "int4pack"


def choose_cpu_kernel(name: str) -> str:
    """The kernel `name` ("auto" or one of CPU_KERNELS) stands for on this CPU. auto: dense bf16 where AMX
    multiplies bf16 tiles (there a dense matmul over many rows beats any INT4 kernel's few-row products), else
    the best packed kernel (packed_cpu_kernel). Raises ValueError, one line, for an unknown name, a kernel this
    CPU lacks or one that cannot be built here."""
    if name == "auto":
        return "dense-bf16" if "amx_bf16" in cpu_flags() else packed_cpu_kernel()
    if name not in CPU_KERNELS:
        raise ValueError(f"unknown INT4 kernel {name!r}; choose one of auto, {', '.join(CPU_KERNELS)}")
    needs = CPU_KERNELS[name].needs
    if needs and not set(needs) & cpu_flags():
        raise ValueError(
            f"the INT4 kernel {name} needs a CPU with {' or '.join(needs)}; this CPU has {cpu_description()}; "
            f"choose int4pack or dense-fp32"
        )
    problem = bf16dot_build_problem() if name == "int4-bf16dot" else None
    if problem:
        raise ValueError(f"the INT4 kernel int4-bf16dot could not be built here ({problem}); choose int4pack")
    return name


def auto_cpu_kernel_weights() -> tuple[bool, torch.dtype]:
    """(packed, dtype) of the kernel choose_cpu_kernel("auto") names: what a CPU load with weights and dtype
    left at auto runs (checkpoint.resolve_runtime)."""
    kernel = CPU_KERNELS[choose_cpu_kernel("auto")]
    return kernel.weights == "packed", kernel.dtype


@functools.cache
def dense_matmul_dtype() -> torch.dtype:
    """The dtype a prefill's unpacked matmuls run in: bf16 where the CPU multiplies bf16 in hardware (AMX or
    AVX512-BF16), else fp32, since oneDNN's emulated bf16 matmul is slower than fp32 there."""
    if not Path("/proc/cpuinfo").exists():
        return INT4_KERNEL_DTYPE
    return INT4_KERNEL_DTYPE if has_bf16_hardware() else torch.float32


def has_bf16_hardware() -> bool:
    """Does this CPU multiply bf16 in hardware (AVX512-BF16 or AMX)?"""
    return bool(set(BF16_HARDWARE) & cpu_flags())


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


CUDA_INNER_K_TILES = (8, 4, 2)  # the CUDA kernel's tiles of 16 inputs per step: the largest that divides K


def nibble_pairs(q: torch.Tensor) -> torch.Tensor:
    """4-bit values (N, K) -> uint8 (N, K/2) with input 2i in the high nibble and 2i+1 in the low one: the
    plain layout PyTorch's CUDA INT4 kernel (tinygemm) takes and tiles with _convert_weight_to_int4pack."""
    return (q[:, 0::2] << 4 | q[:, 1::2]).to(torch.uint8)


def unpack_nibble_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """Inverse of nibble_pairs: uint8 (N, K/2) -> int64 (N, K) values 0..15."""
    return torch.stack([pairs >> 4, pairs & 0xF], dim=-1).flatten(-2).to(torch.int64)


def cuda_unsupported(in_features: int, out_features: int) -> str | None:
    """Why a layer cannot run on the CUDA kernel (beyond Int4Linear.unsupported), or None when it can. It is
    repacked from the CPU layout, which reads back in blocks of 64 output rows."""
    if in_features % (16 * CUDA_INNER_K_TILES[-1]):
        return f"the CUDA INT4 kernel needs input features in multiples of 32, got {in_features}"
    if out_features % 64 or not kernel_layout_is_known():
        return f"the CUDA INT4 kernel is repacked from 64-row blocks: {out_features} output features"
    return None


def cuda_kernel_blocker(device: torch.device) -> str | None:
    """Why the CUDA INT4 kernel (tinygemm, tensor cores) cannot run on `device`, or None."""
    if not torch.cuda.is_available():
        return None  # the device check at start-up refuses this with its own message
    major, minor = torch.cuda.get_device_capability(device)
    return None if major >= 8 else f"the CUDA INT4 kernel needs compute capability 8.0 or newer, not {major}.{minor}"


class Int4Linear(nn.Module):
    """A GPTQ linear kept packed at 4 bits per weight and multiplied by PyTorch's INT4 kernel: the CPU one,
    or after use_cuda_kernel() the CUDA one (tinygemm).

    Both kernels dequantize W = (q - 8) * scale + offset per group, so GPTQ's scale * (q - zero) becomes
    offset = scale * (8 - zero), and both take the same (K/G, N, 2) scales_and_offsets. Only plain group
    order (g_idx[k] = k // group_size) maps onto them.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.on_cuda_kernel = False
        self.cpu_kernel = "int4pack"  # one of PACKED_CPU_KERNELS: see use_cpu_kernel
        self.dense_prefill = out_features % 64 == 0 and kernel_layout_is_known()
        self.register_buffer("packed_weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer(
            "scales_and_offsets", torch.empty(in_features // group_size, out_features, 2, dtype=INT4_KERNEL_DTYPE)
        )
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

    def cpu_layout(self) -> torch.Tensor:
        """packed_weight in the CPU kernel's layout, the only one that reads back."""
        if self.on_cuda_kernel:
            raise RuntimeError("this layer is tiled for the CUDA kernel: its weights no longer read back")
        return self.packed_weight

    def integers(self) -> torch.Tensor:
        """The layer's 4-bit values (N, K)."""
        return _unpack_kernel_layout(self.cpu_layout(), self.out_features, self.in_features).t()

    def use_cpu_kernel(self, name: str) -> None:
        """Multiply the kernel's rows with `name`, one of PACKED_CPU_KERNELS (int4-bf16dot reads the layout in
        strips of 64 output rows: a layer of other widths keeps int4pack)."""
        self.cpu_kernel = name if name == "int4pack" or self.out_features % 64 == 0 else "int4pack"

    def use_cuda_kernel(self) -> None:
        """Repack a layer that sits on a CUDA device for the CUDA kernel. Its tiled layout cannot be read
        back row by row, so dense_weight and rows (a tied table) are the CPU layout's alone."""
        tiles = next(t for t in CUDA_INNER_K_TILES if self.in_features % (16 * t) == 0)
        pairs = nibble_pairs(self.integers()).contiguous()
        self.packed_weight = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
        self.on_cuda_kernel, self.dense_prefill = True, False

    def dense_weight(
        self,
        start: int = 0,
        stop: int | None = None,
        dtype: torch.dtype = INT4_KERNEL_DTYPE,
        lora: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Rows start..stop-1 (multiples of 64; default all) of the (N, K) weight the kernel multiplies by,
        (q - 8) * scale + offset per group, in `dtype`, as the transposed view of a contiguous (K, rows)
        tensor: the layout the kernel's bytes unpack to cheaply, and the one a prefill's x @ W^T wants.

        lora: an adapter's fp32 (A (r, K), B (N, r)), scale folded into B, merged as W + B A in fp32 and
        rounded once to `dtype`, so the rows multiplied by this weight need no side matmuls."""
        K, G = self.in_features, self.group_size
        stop = self.out_features if stop is None else stop
        unpack_dtype = torch.float32 if lora is not None else dtype
        centred = _unpack_kernel_layout(self.cpu_layout()[start:stop], stop - start, K).view(torch.int8) - 8
        # Contiguous (K/G, 1, rows) scales: broadcasting the strided halves of scales_and_offsets is slower.
        scales, offsets = (
            t[:, start:stop].to(unpack_dtype).contiguous()[:, None] for t in self.scales_and_offsets.unbind(dim=-1)
        )
        weight = torch.addcmul(offsets, centred.view(K // G, G, stop - start).to(unpack_dtype), scales)
        weight = weight.view(K, stop - start)
        if lora is not None:
            lora_A, lora_B = lora
            weight = weight.addmm_(lora_A.t(), lora_B[start:stop].t()).to(dtype)  # (K, r) @ (r, rows)
        return weight.t()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) of the (N, K) weight, dequantized as dense_weight does: (*ids.shape, K).
        A tied INT4 lm_head serves as the embedding table this way, so one 4-bit copy does both jobs."""
        flat = ids.reshape(-1)
        blocks = self.cpu_layout().view(self.out_features // 64, self.in_features, 32)  # see _unpack_kernel_layout
        packed = blocks[flat // 64, :, flat % 32]  # (n, K) bytes holding each row's nibbles
        q = torch.where((flat % 64 < 32)[:, None], packed & 0xF, packed >> 4).view(len(flat), -1, self.group_size)
        scales, offsets = (t[:, flat].t()[..., None] for t in self.scales_and_offsets.unbind(dim=-1))  # (n, K/G, 1)
        weights = torch.addcmul(offsets, q.to(INT4_KERNEL_DTYPE) - 8, scales)
        return weights.reshape(*ids.shape, self.in_features)

    def forward(
        self,
        x: torch.Tensor,
        dense_rows: int = 0,
        lora: tuple[torch.Tensor, torch.Tensor] | None = None,
        side: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x (N, in) -> (N, out): rows 0..dense_rows-1 through the unpacked weight (with `lora`, an adapter
        merged into it: see dense_weight), the rest through the kernel (leading dimensions are flattened
        into N). `side`: the same adapter as (A, B^T), added inside the kernel (only where fuses_lora); a
        caller passing `lora` without `side` sends only dense rows.

        Each row's result depends only on the row and on which of the two ways it takes: the kernel and
        the dense matmul both compute a row independently of how many others share the call."""
        if not self.dense_prefill:
            dense_rows = 0
        leading, x = x.shape[:-1], x.reshape(-1, self.in_features)
        if dense_rows:
            out = x.new_empty(x.shape[0], self.out_features)
            self.dense_product(x[:dense_rows], lora, out[:dense_rows])
            if dense_rows < x.shape[0]:
                out[dense_rows:] = self.kernel(x[dense_rows:], side)
        else:
            out = self.kernel(x, side)
        out = out.view(*leading, self.out_features)
        return out + self.bias if self.bias is not None else out

    def dense_product(self, x: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor) -> None:
        """out (M, N) = x (M, K), a prefill's complete chunks, through the unpacked weight (with `lora` merged).
        The weight is unpacked a block of output rows at a time, so the temporaries stay small (a whole fused
        layer at once is fresh pages on every call), and each block's products go straight to their columns."""
        dtype = dense_matmul_dtype()
        dense = x.to(dtype)
        products = out if dtype == x.dtype else dense.new_empty(out.shape)
        for start in range(0, self.out_features, DENSE_PREFILL_BLOCK):
            stop = min(start + DENSE_PREFILL_BLOCK, self.out_features)
            weight = self.dense_weight(start, stop, dtype, lora).t()  # (K, stop - start)
            chunk_rows_matmul(dense, weight, out=products[:, start:stop])
        if products is not out:
            out.copy_(products)

    @property
    def fuses_lora(self) -> bool:
        """Does the kernel add a LoRA adapter's side product itself (int4-bf16dot), so that the layer's
        LoRALinear passes the adapter in rather than running side matmuls?"""
        return self.cpu_kernel == "int4-bf16dot" and not self.on_cuda_kernel and self.in_features % 16 == 0

    def kernel(self, x: torch.Tensor, side: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x (M, in) -> (M, out) on the layer's INT4 kernel (with `side`, an adapter's fp32 (A, B^T) added in:
        fuses_lora only). On int4pack a large layer (an lm_head over the vocabulary) takes its rows KERNEL_ROWS
        at a time: that kernel streams the weight once per few rows, and beyond that the weight falls out of
        cache, so two calls of a few rows cost less than one of many (figures in evidence/RESULTS.md). The rows
        are independent either way."""
        if side is not None and not self.fuses_lora:
            raise RuntimeError(f"the {self.cpu_kernel} kernel does not add a LoRA side product; add it outside")
        if self.on_cuda_kernel:
            return torch.ops.aten._weight_int4pack_mm(x, self.packed_weight, self.group_size, self.scales_and_offsets)
        if self.cpu_kernel == "int4-bf16dot":  # unpacks the weights once per call, whatever its rows
            lora_A, lora_Bt = side if side is not None else (None, None)
            return torch.ops.draft_server.int4_bf16dot_mm(
                x.contiguous(), self.packed_weight, self.scales_and_offsets, self.group_size, lora_A, lora_Bt
            )
        multiply = functools.partial(
            torch.ops.aten._weight_int4pack_mm_for_cpu,
            mat2=self.packed_weight,
            qGroupSize=self.group_size,
            qScaleAndZeros=self.scales_and_offsets,
        )
        if x.shape[0] <= KERNEL_ROWS or self.packed_weight.numel() < LARGE_LAYER_BYTES:
            return multiply(x)
        return torch.cat([multiply(rows) for rows in x.split(KERNEL_ROWS)])
