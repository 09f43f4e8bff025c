"""The drafter's public face: load a model, draft greedily for a batch of token sequences.

    drafter = load_model("model/")
    drafts = draft_batch(drafter, [[1, 2, 3], [4, 5]], max_tokens=16)   # [[...], [...]]
    drafts[0].cached_tokens                                            # prompt tokens reused from the cache

One forward serves prefill and decode: new tokens' keys/values are written into a preallocated cache
slot by index, then every query attends to its slot up to its own position. Prefix reuse is exact:
a slot is matched to a request by token equality, and KV beyond the matched prefix is never read.
Below this module: checkpoint.py (loading), kv_cache.py (the slot pool), transformer.py (the model),
int4.py (the GPTQ format and the INT4 kernel).
"""

import ctypes
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

import engine
import int4
from attention_kernel import attention_name, norm_name, wants_chunk_kernel, wants_norm_kernel, wants_query_kernel
from checkpoint import LoRAConfig, ModelLoadError, QuantConfig, hf_name, load_weights
from int4 import Int4Linear
from kv_cache import KVCache
from planning import BATCH_BUCKETS, bucket_problem, chunk_end, default_context, rows_per_call
from transformer import FUSED_PROJECTIONS, Concat, LoRALinear, ModelConfig, Transformer

__all__ = [
    "Draft",
    "Drafter",
    "ModelLoadError",
    "draft_batch",
    "load_model",
    "prompt_lookup",
    "reuse_freed_memory",
    "token_ids_problem",
]


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
    verify_integrity: bool = True,
    compiled: bool = False,
    batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
    int4_kernel: str = "auto",
    attention_kernel: str = "auto",
) -> "Drafter":
    """Load a model package or a Hugging Face checkpoint directory, strictly (docs/package-format.md).

    device: cuda when available, else cpu. weights: "packed" keeps GPTQ linears at 4 bits and
    multiplies with an INT4 kernel (bf16); "dequant" expands them to dense weights; "auto" packs whenever a
    kernel can run. int4_kernel: the packed CPU kernel (int4.PACKED_CPU_KERNELS); auto: int4.packed_cpu_kernel.
    dtype: bf16 when packed or on cuda, else fp32. attention_kernel: how queries attend
    (attention_kernel.ATTENTION_KERNELS); auto: the CPU kernels on a CPU with AVX512F in bf16 (chunk_attention
    for complete chunks where it also has AVX512-BF16), else PyTorch's.
    cache_slots: prefix-cache slots (a call uses planning.SLOTS_PER_ROW per row). max_context: tokens per
    slot, default the model's max_position_embeddings capped at planning.DEFAULT_MAX_CONTEXT. LoRA is merged into dense weights by default
    and always kept beside packed ones: side matmuls, or added inside the int4-bf16dot kernel (use_lora=False
    ignores the adapter).
    quantize_lm_head: on the packed path, also round the lm_head to INT4 at load (faster decode
    steps; measure its effect on tau). verify_integrity: check a package's files against its sha256
    manifest first (a directory without one loads unverified); False is for development only.
    compiled: decode with a step compiled per batch bucket (torch.compile; CUDA graphs on CUDA), built on
    first use of each bucket or by Drafter.warm_up. batch_buckets: increasing powers of two; a call drafts at
    most the largest at once (larger batches are split).
    """
    problem = bucket_problem(tuple(batch_buckets))
    if problem:
        raise ModelLoadError(problem)
    model_dir = Path(model_dir)
    loaded = load_weights(
        model_dir,
        device,
        dtype,
        merge_lora=merge_lora,
        use_lora=use_lora,
        weights=weights,
        quantize_lm_head=quantize_lm_head,
        verify_integrity=verify_integrity,
        int4_kernel=int4_kernel,
    )
    cfg = loaded.cfg
    context = default_context(cfg.max_position_embeddings) if max_context is None else max_context
    if not 1 <= context <= cfg.max_position_embeddings:
        raise ModelLoadError(
            f"max_context {context} must lie in 1..{cfg.max_position_embeddings} (the model's max_position_embeddings)"
        )
    device, dtype = loaded.model.norm.weight.device, loaded.model.norm.weight.dtype
    try:
        query_kernel = wants_query_kernel(attention_kernel, device, dtype)
        loaded.model.use_attention_kernels(query_kernel, wants_chunk_kernel(query_kernel))
        loaded.model.use_norm_kernel(wants_norm_kernel(query_kernel))
    except ValueError as error:
        raise ModelLoadError(str(error)) from None
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cache_slots, context, device, dtype)
    decoder = engine.Decoder(loaded.model, cache, tuple(batch_buckets), compiled)
    return Drafter(loaded.model, cfg, cache, decoder, loaded.quant, loaded.lora, loaded.model_card, str(model_dir))


def reuse_freed_memory() -> bool:
    """Have glibc's malloc keep freed blocks of up to 32 MiB for reuse instead of returning each to the
    OS. A long prefill allocates and frees tens of MiB per layer; by default every block over a few MiB
    is fresh pages on each call (faults and zeroing), a large share of a long prefill.
    The process then stays at its peak heap size. Process-wide, so servers and benchmarks call it, not
    load_model. False where the C library is not glibc (nothing changes)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_mmap_threshold, 32 * 2**20)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


class Drafter:
    """A loaded model with its KV-cache pool, and what a server needs to validate and describe it."""

    def __init__(
        self,
        model: Transformer,
        cfg: ModelConfig,
        cache: KVCache,
        decoder: engine.Decoder,
        quant: QuantConfig | None,
        lora: LoRAConfig | None,
        model_card: dict,
        source: str,
    ):
        self.model, self.cfg, self.cache, self.decoder = model, cfg, cache, decoder
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

    def warm_up(self, max_batch_size: int) -> None:
        """Draft once in every batch bucket up to max_batch_size's, so a broken model fails at start-up, a
        compiled step is built before the first client arrives, and no client pays for either."""
        for bucket in self.decoder.buckets:
            rows = min(bucket, rows_per_call(self.cache.num_slots, self.decoder.buckets))
            draft_batch(self, [[0, 0]] * rows, max_tokens=2, stop_token_ids=[])
            if bucket >= max_batch_size:
                break

    def weight_bytes(self) -> int:
        """Resident bytes of the model's parameters and buffers (a tied embedding counted once)."""
        tensors = {t.data_ptr(): t for t in [*self.model.parameters(), *self.model.buffers()]}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The dense weights under Hugging Face names (LoRA merged): load them into the matching
        transformers model to train or compare on exactly what this drafter computes with."""
        if any(isinstance(m, (Int4Linear, LoRALinear, Concat)) for m in self.model.modules()):
            raise ValueError(
                "hf_state_dict needs dense, merged weights: load with weights='dequant' and merge_lora=True"
            )
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        split_sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
        part_names = dict(FUSED_PROJECTIONS.values())
        state = {}
        for name, tensor in self.model.state_dict().items():
            module, leaf = name.rsplit(".", 1)  # layers.0.self_attn.qkv_proj, weight
            parent, _, fused = module.rpartition(".")
            if fused not in part_names:
                state[hf_name(name)] = tensor
                continue
            for part, piece in zip(part_names[fused], tensor.split(split_sizes[fused])):
                state[hf_name(f"{parent}.{part}.{leaf}")] = piece
        return state

    def kernel(self) -> dict:
        """How the model's linear layers multiply: the kernel's name (int4.CPU_KERNELS on the CPU), what it
        does, and on the CPU the instruction sets it was chosen for; how the model attends (attention:
        attention_kernel.attention_name) and normalises (norm: rms-norm-kernel or torch)."""
        dtype = str(self.dtype).removeprefix("torch.").replace("bfloat", "bf").replace("float", "fp")
        attention = attention_name(
            self.model.layers[0].self_attn.query_kernel, self.model.layers[0].self_attn.chunk_kernel
        )
        norm = norm_name(self.model.norm.kernel)
        if self.device.type != "cpu":
            name = "cuda-int4" if self.weights == "packed" else f"dense-{dtype}"
            return {"name": name, "what": f"on {self.device.type}", "attention": attention, "norm": norm}
        packed = {m.cpu_kernel for m in self.model.modules() if isinstance(m, Int4Linear)}
        # The chosen kernel first; int4pack after it for layers too narrow for it.
        kernels = [k for k in reversed(int4.PACKED_CPU_KERNELS) if k in packed] or [f"dense-{dtype}"]
        what = "; ".join(int4.CPU_KERNELS[k].what if k in int4.CPU_KERNELS else "dense weights" for k in kernels)
        cpu = int4.cpu_description()
        return {"name": "+".join(kernels), "what": what, "cpu": cpu, "attention": attention, "norm": norm}

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
            "decode": {"compiled": self.decoder.compiled, "batch_buckets": list(self.decoder.buckets)},
            "weights": self.weights,
            "kernel": self.kernel(),
            "weight_bytes": self.weight_bytes(),
            "max_context": self.max_context,
            "cache_slots": self.cache.num_slots,
            "eos_token_ids": list(self.eos_token_ids),
            "model_card": self.model_card,
        }


class Draft(list):
    """One row's draft tokens (compares equal to a plain list), plus where they came from."""

    def __init__(
        self, tokens: list[int], cached_tokens: int, logprobs: list[float] | None = None, source: str = "model"
    ):
        super().__init__(tokens)
        self.cached_tokens = cached_tokens  # prompt tokens whose KV came from the prefix cache
        self.logprobs = logprobs  # the drafter's log-probability of each draft token (None for a lookup draft)
        self.source = source  # "model" (greedy decoding) or "lookup" (copied from the row's own tokens)


LOOKUP_MAX_MATCH = 8  # the longest suffix prompt lookup tries to find


def prompt_lookup(
    tokens: Sequence[int], max_tokens: int, min_match: int, max_match: int = LOOKUP_MAX_MATCH
) -> list[int]:
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
    Prefixes already in the cache are not recomputed. A row's draft is bit-identical whatever the rest
    of its batch and whether its prefix came from the cache, on every path (engine.py says how).

    Hybrid drafting: a row with a `lookup_min_match` whose own tokens end in an n-gram of at least that
    many tokens seen earlier in the row gets what followed it (prompt_lookup; source "lookup", no
    logprobs) instead of a model draft: long repeats (code, quotes, edits) are copied better than guessed.
    """
    rows = [list(row) for row in batch]
    limits, thresholds = (
        _per_row(max_tokens, len(rows), "max_tokens"),
        _per_row(min_confidence, len(rows), "min_confidence"),
    )
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
    per_call = rows_per_call(drafter.cache.num_slots, drafter.decoder.buckets)
    with drafter.lock:
        for start in range(0, len(modelled), per_call):
            part = modelled[start : start + per_call]
            made = _draft_rows(
                drafter,
                [rows[i] for i in part],
                [budgets[i] for i in part],
                [thresholds[i] for i in part],
                stop_ids,
                return_logprobs,
            )
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


def token_ids_problem(
    token_ids: Sequence[int], vocab_size: int, max_context: int, vocabulary: str | None = None
) -> str | None:
    """Why a drafter with this vocabulary and context cannot take `token_ids` (naming the offending
    position and the limit), or None. `vocabulary` (the model card's) names the tokenizer, since ids
    from another tokenizer are the likely cause of an id out of range. The server's 400s are these words."""
    if not token_ids:
        return "empty token sequence; send at least one token id"
    if len(token_ids) > max_context:
        return f"{len(token_ids)} tokens exceed the context limit of {max_context}"
    for position, token_id in enumerate(token_ids):
        if type(token_id) is not int:  # bool is an int subclass, not a token
            return f"token id {token_id!r} at position {position} is not an int"
        if token_id < 0:
            return f"token id {token_id} at position {position} is negative; token ids are 0..{vocab_size - 1}"
        if token_id >= vocab_size:
            tokenizer = (
                f" (this drafter reads {vocabulary}; ids from another tokenizer do not fit)" if vocabulary else ""
            )
            return (
                f"token id {token_id} at position {position} is outside the vocabulary 0..{vocab_size - 1}{tokenizer}"
            )
    return None


def _check_batch(
    drafter: Drafter, rows: list[list[int]], limits: list[int], thresholds: list[float], min_matches: list[int | None]
) -> None:
    for i, (row, limit, threshold, min_match) in enumerate(zip(rows, limits, thresholds, min_matches)):
        problem = token_ids_problem(row, drafter.vocab_size, drafter.max_context, drafter.model_card.get("vocabulary"))
        if problem:
            raise ValueError(f"row {i}: {problem}")
        if not (isinstance(limit, int) and limit >= 0):
            raise ValueError(f"row {i}: max_tokens must be a non-negative integer, got {limit!r}")
        if not (isinstance(threshold, (int, float)) and 0.0 <= threshold <= 1.0):
            raise ValueError(f"row {i}: min_confidence must be a probability in [0, 1], got {threshold!r}")
        if min_match is not None and not (type(min_match) is int and 0 <= min_match <= LOOKUP_MAX_MATCH):
            raise ValueError(
                f"row {i}: lookup_min_match must be None or 0 (off) or an integer in 1..{LOOKUP_MAX_MATCH}, got {min_match!r}"
            )


def _draft_rows(
    drafter: Drafter,
    rows: list[list[int]],
    budgets: list[int],
    thresholds: list[float],
    stop_ids: Sequence[int],
    want_logprobs: bool,
) -> list[Draft]:
    cache = drafter.cache
    slots, reused = cache.assign(rows)
    # Attention reads each slot to the end of the chunk of the last position its row will feed.
    for slot, row, budget in zip(slots, rows, budgets):
        cache.clear_garbage([slot], chunk_end(len(row) + budget, cache.capacity))
    first_logits = engine.prefill(drafter.model, cache, rows, slots, reused)
    decoded = drafter.decoder.decode(first_logits, rows, slots, budgets, thresholds, stop_ids, want_logprobs)
    drafts = []
    for b, (row, slot, drafted) in enumerate(zip(rows, slots, decoded.tokens)):
        cache.commit(slot, row, drafted[:-1])  # every draft token but the last was fed through the model
        drafts.append(Draft(drafted, reused[b], decoded.logprobs[b] if decoded.logprobs else None))
    return drafts
