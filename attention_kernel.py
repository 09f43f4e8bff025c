"""The CPU attention kernels (query_attention.cpp) and RMSNorm's kernel beside them (rms_norm.cpp): their build,
and the choice.

A decode step, and a prefill's last incomplete chunk, attend a few queries per row over keys that lie in
the KV cache. In PyTorch operators (transformer.block_attention) that means gathering each row's window of
keys and values, converting it to fp32 and masking what lies past each query; for a batch of rows that is
most of a decode step. query_attention reads the bf16 cache in place instead, with the same fp32 math and the
same rule: a query's result depends only on its own keys. A prefill's complete chunks take chunk_attention,
which shares each key among a chunk's 64 queries, in place of the flash kernel (SDPA) and its mask. Where the
attention kernels run, RMSNorm's normalisation takes one pass of its own kernel instead of PyTorch's eight
operators; `--attention-kernel torch` keeps PyTorch's operators for both.
"""

import functools
from pathlib import Path

import torch

from int4 import cpu_flags
from kernel_build import build_cpu_kernel

ATTENTION_KERNELS = ("auto", "query-kernel", "torch")  # what draft_model.load_model's attention_kernel takes
SOURCE = Path(__file__).with_name("query_attention.cpp")
NORM_SOURCE = Path(__file__).with_name("rms_norm.cpp")
NEEDS = "avx512f"
CHUNK_NEEDS = "avx512_bf16"  # chunk_attention's dot products; without it, complete chunks take query_attention
# Compiled for AVX512F whatever the build machine has; it runs only where cpu_flags() has it.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mavx512f"]


@functools.cache
def build_problem() -> str | None:
    """Build and load the kernel (kernel_build.build_cpu_kernel). Why it cannot, or None."""
    fake = {f"draft_server_attention::{op}": _output_shape for op in ("query_attention", "chunk_attention")}
    return build_cpu_kernel("query-attention", "draft_server_query_attention", SOURCE, CFLAGS, "PyTorch attends", fake)


@functools.cache
def norm_build_problem() -> str | None:
    """Build and load RMSNorm's kernel (kernel_build.build_cpu_kernel). Why it cannot, or None."""
    fake = {"draft_server_rms_norm::rms_norm": lambda x, eps: torch.empty_like(x)}
    return build_cpu_kernel("rms-norm", "draft_server_rms_norm", NORM_SOURCE, CFLAGS, "PyTorch's rms_norm serves", fake)


def wants_norm_kernel(query_kernel: bool) -> bool:
    """Do RMSNorm's normalisations take rms_norm.cpp? Wherever the query kernel runs (a CPU with AVX512F, bf16)
    and it builds."""
    return query_kernel and norm_build_problem() is None


def _output_shape(q, keys, values, slots, positions):
    """The kernels' output, for torch.compile's tracing: q's shape."""
    return torch.empty_like(q)


def wants_query_kernel(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Does a model on `device` in `dtype` attend with the kernel? `name` is one of ATTENTION_KERNELS: auto takes
    it on a CPU with AVX512F, in bf16, where it builds; query-kernel insists (ValueError, one line, where it
    cannot run); torch never takes it."""
    if name not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {', '.join(ATTENTION_KERNELS)}")
    if name == "torch":
        return False
    why_not = None
    if device.type != "cpu" or dtype != torch.bfloat16:
        why_not = f"it runs on the CPU in bf16, not on {device.type} in {str(dtype).removeprefix('torch.')}"
    elif NEEDS not in cpu_flags():
        why_not = f"it needs a CPU with {NEEDS}"
    elif build_problem() is not None:
        why_not = f"it could not be built here ({build_problem()})"
    if why_not and name == "query-kernel":
        raise ValueError(f"the attention kernel query-kernel cannot run: {why_not}; choose auto or torch")
    return why_not is None


def wants_chunk_kernel(query_kernel: bool) -> bool:
    """Do a prefill's complete chunks take chunk_attention? Where the query kernel runs and the CPU has
    AVX512-BF16; else they take query_attention where it runs, and SDPA where it does not."""
    return query_kernel and CHUNK_NEEDS in cpu_flags()


def attention_name(query_kernel: bool, chunk_kernel: bool) -> str:
    """The attention a model runs, by name: query-kernel+chunk-kernel, query-kernel (for complete chunks too) or
    torch (block_attention, and SDPA for complete chunks)."""
    return "query-kernel+chunk-kernel" if chunk_kernel else "query-kernel" if query_kernel else "torch"


def norm_name(norm_kernel: bool) -> str:
    """How a model normalises, by name: rms-norm-kernel (rms_norm.cpp) or torch (PyTorch's operators)."""
    return "rms-norm-kernel" if norm_kernel else "torch"


def cpu_choice() -> str:
    """What auto attends with in a bf16 model on this CPU, by name (benchmarks print it)."""
    query_kernel = wants_query_kernel("auto", torch.device("cpu"), torch.bfloat16)
    return attention_name(query_kernel, wants_chunk_kernel(query_kernel))


def norm_choice() -> str:
    """What RMSNorm takes by default in a bf16 model on this CPU, by name (benchmarks print it)."""
    return norm_name(wants_norm_kernel(wants_query_kernel("auto", torch.device("cpu"), torch.bfloat16)))


def query_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """q (G, T, H, D) at positions (G, T) of cache slots (G,), over a layer's cache keys, values (S, H_kv, C, D)
    -> (G, T, H, D), as transformer.block_attention computes it from the gathered window."""
    return torch.ops.draft_server_attention.query_attention(
        q.contiguous(), keys, values, slots.contiguous(), positions.contiguous()
    )


def chunk_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Complete chunks' queries q (G, CHUNK, H, D) at positions (G, CHUNK) of cache slots (G,), over a layer's
    cache keys, values (S, H_kv, C, D) -> (G, CHUNK, H, D): query_attention's computation with each chunk's keys
    shared by its queries, its sums over q . k in another order (so other bits)."""
    return torch.ops.draft_server_attention.chunk_attention(
        q.contiguous(), keys, values, slots.contiguous(), positions.contiguous()
    )
