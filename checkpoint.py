"""Reading model packages and Hugging Face checkpoints, strictly: config, GPTQ tensors, PEFT LoRA adapters.

`load_weights(model_dir, ...)` returns the built Transformer and what it was built from; every problem is a
ModelLoadError naming the file and the tensor. Only safetensors and JSON are read: nothing in a package runs.
The package format is described in docs/package-format.md.
"""

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from int4 import (
    INT4_KERNEL_DTYPE,
    NIBBLES_PER_INT32,
    ZERO_OFFSET,
    Int4Linear,
    auto_cpu_kernel_weights,
    cuda_kernel_blocker,
    cuda_unsupported,
    gptq_dequantize,
    kernel_layout_is_known,
    packed_cpu_kernel,
    rtn_quantize,
)
from package_manifest import ManifestMismatch, verify_manifest
from planning import DEFAULT_MAX_CONTEXT
from transformer import LoRALinear, ModelConfig, Transformer, fuse_projections

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("qwen3", "llama", "qwen2")


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message names the file and the problem."""


def model_config(hf: dict, generation_config: dict | None = None) -> ModelConfig:
    """Read a Hugging Face config.json dict; refuse features this forward does not implement."""
    _require(
        hf,
        ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
        "config.json",
    )
    architecture = hf.get("model_type")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"config.json: model_type {architecture!r} is not supported; expected one of {SUPPORTED_ARCHITECTURES}"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(
            f"config.json: rope_type {rope_type!r} is not supported; only 'default' RoPE is implemented"
        )
    if hf.get("use_sliding_window"):
        raise ModelLoadError(
            "config.json: use_sliding_window=true is not supported; only full attention is implemented"
        )
    if hf.get("mlp_bias"):
        raise ModelLoadError("config.json: mlp_bias=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(
            f"config.json: hidden_act {hf['hidden_act']!r} is not supported; the MLP is SwiGLU ('silu')"
        )
    attention_bias = bool(hf.get("attention_bias", False))
    eos_ids = _as_id_tuple(hf.get("eos_token_id")) + _as_id_tuple((generation_config or {}).get("eos_token_id"))
    num_heads = hf["num_attention_heads"]
    return ModelConfig(
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
            raise ModelLoadError(
                f"{source}: quant_method {raw.get('quant_method')!r} is not supported; expected 'gptq'"
            )
        if raw.get("bits") != 4:
            raise ModelLoadError(f"{source}: bits {raw.get('bits')!r} is not supported; expected 4")
        if not (isinstance(raw.get("group_size", 128), int) and raw.get("group_size", 128) > 0):
            raise ModelLoadError(
                f"{source}: group_size {raw.get('group_size')!r} is not supported; expected a positive group size such as 128"
            )
        checkpoint_format = raw.get("checkpoint_format", "gptq")
        if checkpoint_format not in ZERO_OFFSET:
            raise ModelLoadError(
                f"{source}: checkpoint_format {checkpoint_format!r} is not supported; expected one of {list(ZERO_OFFSET)}"
            )
        embedding = raw.get("quantized_embedding")
        if embedding is not None and not (
            isinstance(embedding, dict) and isinstance(embedding.get("group_size"), int) and embedding["group_size"] > 0
        ):
            raise ModelLoadError(
                f'{source}: quantized_embedding {embedding!r} is not supported; expected {{"group_size": G}} with G > 0'
            )
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
        return {
            "method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "desc_act": self.desc_act,
            "embedding_group_size": self.embedding_group_size,
        }


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
    return [
        f"layers.{i}.{part}.{p}" for i in range(cfg.num_layers) for part, names in PROJECTIONS.items() for p in names
    ]


def hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else "model." + name


def _expected_tensors(cfg: ModelConfig, quant: QuantConfig | None) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name (HF naming) -> shape, derived from a meta-device skeleton of the model."""
    with torch.device("meta"):
        skeleton = Transformer(cfg)
    expected = {hf_name(name): tuple(p.shape) for name, p in skeleton.state_dict().items()}
    if cfg.tie_word_embeddings:
        del expected["lm_head.weight"]
    if quant is None:
        return expected
    quantized = {name: quant.group_size for name in _quantized_linears(cfg, quant)}
    if quant.embedding_group_size:
        if not cfg.tie_word_embeddings:
            raise ModelLoadError(
                "quantized_embedding needs tie_word_embeddings: the INT4 table serves as embedding and lm_head"
            )
        quantized["embed_tokens"] = quant.embedding_group_size
    for name, group_size in quantized.items():
        out_features, in_features = expected.pop(f"model.{name}.weight")
        if in_features % group_size or in_features % NIBBLES_PER_INT32 or out_features % NIBBLES_PER_INT32:
            raise ModelLoadError(
                f"{name}: shape [{out_features}, {in_features}] does not fit GPTQ group size {group_size}"
            )
        n_groups = in_features // group_size
        expected[f"model.{name}.qweight"] = (in_features // NIBBLES_PER_INT32, out_features)
        expected[f"model.{name}.qzeros"] = (n_groups, out_features // NIBBLES_PER_INT32)
        expected[f"model.{name}.scales"] = (n_groups, out_features)
        expected[f"model.{name}.g_idx"] = (in_features,)
    return expected


def _quantized_linears(cfg: ModelConfig, quant: QuantConfig) -> list[str]:
    skipped = quant.modules_to_not_convert
    return [n for n in _linear_names(cfg) if not any(n == s or n.endswith("." + s) or hf_name(n) == s for s in skipped)]


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


def _check_tensors(
    tensors: dict[str, torch.Tensor], origin: dict[str, Path], expected: dict[str, tuple[int, ...]], where: str
) -> None:
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelLoadError(
            f"{where}: missing tensor {missing[0]!r} with shape {list(expected[missing[0]])} ({len(missing)} missing in all)"
        )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        name = unexpected[0]
        raise ModelLoadError(f"{origin[name]}: unexpected tensor {name!r} ({len(unexpected)} unexpected in all)")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ModelLoadError(
                f"{origin[name]}: tensor {name!r} has shape {list(tensors[name].shape)}, expected {list(shape)}"
            )
        packed_ints = name.endswith((".qweight", ".qzeros", ".g_idx"))
        if (tensors[name].dtype == torch.int32) != packed_ints or not (
            packed_ints or tensors[name].is_floating_point()
        ):
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
    raise ModelLoadError(
        f"{model_dir}: no {PACKAGE_WEIGHTS} (model package) and no model.safetensors or model.safetensors.index.json (Hugging Face checkpoint)"
    )


def _load_state(
    tensors: dict[str, torch.Tensor],
    cfg: ModelConfig,
    quant: QuantConfig | None,
    dtype: torch.dtype,
    packed: bool,
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], dict[str, int], dict[str, str]]:
    """Checkpoint tensors -> our state dict in the compute dtype. Each GPTQ linear becomes Int4Linear buffers
    when `packed` and the device's kernel can take it, else a dense dequantized weight; a quantized tied
    embedding becomes the INT4 lm_head (whose rows are the embedding) or a dense table. Returns the state,
    the packed layers (name -> group size) and, for every quantized tensor left dense, the reason."""
    state, int4_layers, dense_reasons = {}, {}, {}
    quantized = {name: (name, quant.group_size) for name in _quantized_linears(cfg, quant)} if quant else {}
    if quant and quant.embedding_group_size:
        quantized["embed_tokens"] = ("lm_head", quant.embedding_group_size)  # packed, the table lives in the head
    for name, (packed_name, group_size) in quantized.items():
        parts = {part: tensors.pop(f"model.{name}.{part}") for part in ("qweight", "qzeros", "scales", "g_idx")}
        out_features, in_features = parts["scales"].shape[1], parts["g_idx"].shape[0]
        reason = (
            Int4Linear.unsupported(in_features, out_features, group_size, parts["g_idx"])
            or (cuda_unsupported(in_features, out_features) if device.type == "cuda" else None)
            if packed
            else "dense weights chosen"
        )
        if reason is None and name == "embed_tokens" and not (out_features % 64 == 0 and kernel_layout_is_known()):
            reason = "embedding rows are read in the kernel's 64-row layout: it must be known and the vocabulary a multiple of 64"
        if reason is None:
            packed_state = Int4Linear.pack_gptq(**parts, checkpoint_format=quant.checkpoint_format)
            state.update({f"{packed_name}.{k}": v for k, v in packed_state.items()})
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
        raise ModelLoadError(
            f"an INT4 lm_head needs hidden size % 32 == 0 and vocab size % 16 == 0, got {cfg.hidden_size} and {cfg.vocab_size}"
        )
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
            _replace_module(
                model, name, Int4Linear(dense.in_features, dense.out_features, group_size, bias=dense.bias is not None)
            )
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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPES |= {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # the short names
WEIGHT_PATHS = ("auto", "packed", "dequant")


def resolve_runtime(
    device: str | torch.device | None, dtype: str | torch.dtype | None, weights: str, quant: QuantConfig | None
) -> tuple[torch.device, torch.dtype, bool]:
    """(device, dtype, packed): the fastest path that keeps its promises, unless the caller chose.

    Packed INT4 runs on PyTorch's CPU or CUDA kernel with bf16 activations; dense weights default to bf16
    on CUDA and fp32 on CPU (bf16 matmuls are not faster than fp32 on every CPU, and fp32 is the exact one).
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
        "the model is not GPTQ-quantized"
        if quant is None
        else f"the INT4 kernels run on cpu and cuda, not {device.type}"
        if device.type not in ("cpu", "cuda")
        else f"torch {torch.__version__} has no CPU INT4 kernel"
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        else cuda_kernel_blocker(device)
        if device.type == "cuda"
        else f"the INT4 kernel needs bfloat16 activations, not {dtype}"
        if dtype not in (None, INT4_KERNEL_DTYPE)
        else None
    )
    if weights == "packed" and blocker:
        raise ModelLoadError(f"weights='packed' is not possible: {blocker}")
    packed = weights != "dequant" and blocker is None
    if packed and weights == "auto" and device.type == "cpu" and dtype is None:
        packed, dtype = auto_cpu_kernel_weights()  # chosen by the CPU's features: dense bf16 where AMX is
    if dtype is None:
        dtype = INT4_KERNEL_DTYPE if packed or device.type == "cuda" else torch.float32
    return device, dtype, packed


@dataclass(frozen=True)
class LoadedWeights:
    """A built model on its device, and what it was built from."""

    model: Transformer
    cfg: ModelConfig
    quant: QuantConfig | None
    lora: LoRAConfig | None
    model_card: dict


@dataclass(frozen=True)
class Layout:
    """What a model directory holds, read from its JSON files alone: the config, the quantization, the
    weight files."""

    cfg: ModelConfig
    quant: QuantConfig | None
    weight_files: list[Path]

    def weight_bytes(self, itemsize: int, packed: bool) -> int:
        """About how many bytes the built model holds: the files' size on the packed path (INT4 stays
        4-bit), else every weight in the compute dtype. Reads only the safetensors headers."""
        if packed:
            return sum(path.stat().st_size for path in self.weight_files)
        weights = 0
        for path in self.weight_files:
            try:
                with safe_open(path, framework="pt") as handle:
                    for name in handle.keys():
                        size = math.prod(handle.get_slice(name).get_shape())
                        if name.endswith(".qweight"):
                            weights += size * NIBBLES_PER_INT32
                        elif not name.endswith((".qzeros", ".scales", ".g_idx")):  # folded into the dense weight
                            weights += size
            except SafetensorError as error:
                raise ModelLoadError(f"{path}: not a readable safetensors file ({error})") from None
        return weights * itemsize


def read_layout(model_dir: Path) -> Layout:
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(
            f"{model_dir}: no config.json; expected a model package or a Hugging Face checkpoint directory"
        )
    hf_config = _read_json(model_dir / "config.json")
    generation_path = model_dir / "generation_config.json"
    cfg = model_config(hf_config, _read_json(generation_path) if generation_path.exists() else None)
    if (model_dir / PACKAGE_WEIGHTS).exists():
        quant_path = model_dir / PACKAGE_QUANT_CONFIG
        if not quant_path.exists():
            raise ModelLoadError(f"{model_dir}: has {PACKAGE_WEIGHTS} but no {PACKAGE_QUANT_CONFIG}")
        return Layout(cfg, QuantConfig.from_dict(_read_json(quant_path), quant_path), [model_dir / PACKAGE_WEIGHTS])
    raw_quant = hf_config.get("quantization_config")
    quant = QuantConfig.from_dict(raw_quant, model_dir / "config.json") if raw_quant else None
    return Layout(cfg, quant, _weight_files(model_dir))


def load_weights(
    model_dir: Path,
    device: str | torch.device | None,
    dtype: str | torch.dtype | None,
    *,
    merge_lora: bool,
    use_lora: bool,
    weights: str,
    quantize_lm_head: bool,
    verify_integrity: bool = True,
    int4_kernel: str = "auto",
) -> LoadedWeights:
    """Read, check and build the model of a package or Hugging Face checkpoint (draft_model.load_model
    documents the options); q/k/v and gate/up end fused. A package's files are first checked against
    its sha256 manifest unless verify_integrity is False (development only)."""
    if verify_integrity and (model_dir / "config.json").is_file():
        try:
            verified = verify_manifest(model_dir)
        except ManifestMismatch as error:
            raise ModelLoadError(str(error)) from None
        if not verified:
            log.info("%s has no sha256 manifest: its files are loaded unverified", model_dir)
    layout = read_layout(model_dir)
    cfg, quant, files = layout.cfg, layout.quant, layout.weight_files

    device, dtype, packed = resolve_runtime(device, dtype, weights, quant)
    try:
        cpu_kernel = packed_cpu_kernel(int4_kernel) if packed and device.type == "cpu" else None
    except ValueError as error:
        raise ModelLoadError(str(error)) from None
    tensors, origin = _read_safetensors(files)
    _check_tensors(tensors, origin, _expected_tensors(cfg, quant), str(model_dir))
    state, int4_layers, dense_reasons = _load_state(tensors, cfg, quant, dtype, packed, device)
    table_in_head = "embed_tokens.weight" not in state
    if quantize_lm_head and table_in_head:
        log.info("quantize_lm_head: the package's INT4 embedding table already is the lm_head")
    if quantize_lm_head and not table_in_head:
        if not packed:
            raise ModelLoadError("quantize_lm_head needs the packed INT4 path (a GPTQ model in bf16)")
        int4_layers["lm_head"] = _quantize_lm_head(state, cfg)
    model = _skeleton(cfg, int4_layers, table_in_head)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    if packed and dense_reasons:
        name, reason = next(iter(dense_reasons.items()))
        log.warning(
            "%d of %d quantized linears stay dense (e.g. %s: %s)",
            len(dense_reasons),
            len(dense_reasons) + len(int4_layers),
            name,
            reason,
        )

    lora = None
    if use_lora and ((model_dir / PACKAGE_LORA_CONFIG).exists() or (model_dir / PACKAGE_LORA_WEIGHTS).exists()):
        lora = _apply_lora(model, model_dir, merge=merge_lora)
    fuse_projections(model)

    card_path = model_dir / PACKAGE_MODEL_CARD
    model_card = _read_json(card_path) if card_path.exists() else {}
    model = model.to(device).eval().requires_grad_(False)
    if packed and device.type == "cuda":
        model.use_cuda_int4_kernels()
    if cpu_kernel:
        model.use_cpu_int4_kernel(cpu_kernel)
    return LoadedWeights(model, cfg, quant, lora, model_card)
