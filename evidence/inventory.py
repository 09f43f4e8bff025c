"""The tensor inventory of a model package: which tensors its safetensors files hold, with dtype and shape.

`package_inventory` computes it from a Hugging Face config and the pipeline's quantization and LoRA
settings without any weights: the model is built on the meta device (names and shapes only), the
projections become GPTQ tensors by shape arithmetic, every other tensor is kept in the store dtype
(a tied lm_head is left out), as gptq_drafter.py and lora_after_gptq.py write them. `file_inventory`
reads the same from a package on disk (safetensors headers only). architecture.json declares the
full-scale inventory in the compact form of `compact` (one layer's tensors, times the layer count).
Not a script: imported by run_pipeline.py (--plan) and the tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

import checkpoint

PROJECTIONS = tuple(name for names in checkpoint.PROJECTIONS.values() for name in names)  # q_proj .. down_proj
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int32: "I32"}
BYTES_PER_ELEMENT = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4}
LORA_PREFIX = "base_model.model."  # PEFT's key prefix for the wrapped model
LAYER_NAME = re.compile(r"^(?P<prefix>.*?layers\.)(?P<index>\d+)\.(?P<rest>.+)$")

Inventory = dict[str, dict[str, list]]  # file name -> tensor name -> [dtype, shape]


def meta_model(hf_config: dict) -> torch.nn.Module:
    """The transformers model of `hf_config` on the meta device: every tensor's name and shape, no memory."""
    config = AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def gptq_shapes(in_features: int, out_features: int, group_size: int) -> dict[str, list]:
    """The GPTQ tensors of one Linear (int4.gptq_pack): packed along inputs, zeros along outputs."""
    groups = in_features // group_size
    return {
        "qweight": ["I32", [in_features // 8, out_features]],
        "qzeros": ["I32", [groups, out_features // 8]],
        "scales": ["F16", [groups, out_features]],
        "g_idx": ["I32", [in_features]],
    }


def package_inventory(
    hf_config: dict,
    group_size: int,
    store_dtype: torch.dtype,
    embedding_group_size: int | None = None,
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] = PROJECTIONS,
    lora_dtype: torch.dtype = torch.bfloat16,
) -> Inventory:
    """What gptq_drafter.package_tensors and lora_after_gptq.write_adapter write for this model."""
    model = meta_model(hf_config)
    tied = bool(model.config.tie_word_embeddings)
    weights: dict[str, list] = {}
    adapter: dict[str, list] = {}
    for name, tensor in model.state_dict().items():
        module, _, kind = name.rpartition(".")
        projection = module.rpartition(".")[2]
        if projection in PROJECTIONS and kind == "weight":
            out_features, in_features = tensor.shape
            weights |= {f"{module}.{k}": v for k, v in gptq_shapes(in_features, out_features, group_size).items()}
            if lora_rank and projection in lora_targets:
                dtype = SAFETENSORS_DTYPES[lora_dtype]
                adapter[f"{LORA_PREFIX}{module}.lora_A.weight"] = [dtype, [lora_rank, in_features]]
                adapter[f"{LORA_PREFIX}{module}.lora_B.weight"] = [dtype, [out_features, lora_rank]]
        elif name == "lm_head.weight" and tied:
            continue  # the loader re-ties it to the embedding
        elif name == "model.embed_tokens.weight" and embedding_group_size:
            vocab, hidden = tensor.shape
            weights |= {
                f"model.embed_tokens.{k}": v for k, v in gptq_shapes(hidden, vocab, embedding_group_size).items()
            }
        else:
            weights[name] = [SAFETENSORS_DTYPES[store_dtype], list(tensor.shape)]
    inventory = {checkpoint.PACKAGE_WEIGHTS: dict(sorted(weights.items()))}
    if lora_rank:
        inventory[checkpoint.PACKAGE_LORA_WEIGHTS] = dict(sorted(adapter.items()))
    return inventory


def file_inventory(package_dir: Path) -> Inventory:
    """The inventory of a package on disk, read from the safetensors headers (no tensor is loaded)."""
    inventory = {}
    for file in (checkpoint.PACKAGE_WEIGHTS, checkpoint.PACKAGE_LORA_WEIGHTS):
        if (package_dir / file).is_file():
            with safe_open(str(package_dir / file), framework="pt") as handle:
                inventory[file] = {
                    name: [handle.get_slice(name).get_dtype(), list(handle.get_slice(name).get_shape())]
                    for name in sorted(handle.keys())
                }
    return inventory


def compact(inventory: Inventory) -> dict:
    """Per file: the tensors of layer 0 (standing for every layer), the others, the layer count, the
    number of tensors and their bytes. Refuses an inventory whose layers differ (it would not be exact)."""
    result = {}
    for file, tensors in inventory.items():
        layers: dict[int, dict[str, list]] = {}
        others = {}
        for name, spec in tensors.items():
            match = LAYER_NAME.match(name)
            if match:
                layers.setdefault(int(match["index"]), {})[f"{match['prefix']}N.{match['rest']}"] = spec
            else:
                others[name] = spec
        if layers and any(layer != layers[0] for layer in layers.values()):
            raise ValueError(f"{file}: the layers hold different tensors; a per-layer template would not be exact")
        result[file] = {
            "layers": len(layers),
            "per_layer": layers.get(0, {}),
            "other": others,
            "tensors": len(tensors),
            "bytes": sum(BYTES_PER_ELEMENT[dtype] * prod(shape) for dtype, shape in tensors.values()),
        }
    return result


def prod(shape: list[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total
