"""Tiny random Hugging Face models, built and saved on the fly, for tests (no network)."""

import json
import shutil
from pathlib import Path

import peft
import torch
import transformers
from safetensors.torch import save_file

import draft_model
import engine
import int4
import planning

ARCHITECTURES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


def make_hf_model(architecture: str = "qwen3", seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random fp32 causal LM; weights scaled up (std 0.2) so greedy drafts vary and top-1 logits lead by a clear margin (no near-ties)."""
    config_class, model_class = ARCHITECTURES[architecture]
    settings = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_class(config_class(**settings)).eval()
    return model


def write_hf_checkpoint(model: transformers.PreTrainedModel, directory: Path) -> Path:
    """Save `model` the way the hub holds checkpoints: config.json + safetensors."""
    model.save_pretrained(directory, safe_serialization=True)
    return Path(directory)


def quantize_into(hf_model, group_size: int, sym: bool, desc_act: bool, seed: int) -> dict[str, torch.Tensor]:
    """Give every decoder projection of `hf_model` known INT4 weights; return their GPTQ tensors (HF names).

    The dense weight each layer gets is computed here from the integers by the format's definition,
    W[n, k] = scale[g[k], n] * (q[n, k] - zero[g[k], n]), independently of draft_model's unpacking.
    """
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in hf_model.named_modules():
        if not name.startswith("model.layers.") or not isinstance(module, torch.nn.Linear):
            continue
        out_features, in_features = module.weight.shape
        n_groups = in_features // group_size
        ints = torch.randint(0, 16, (out_features, in_features), generator=generator)
        zeros = (
            torch.full((n_groups, out_features), 8)
            if sym
            else torch.randint(0, 16, (n_groups, out_features), generator=generator)
        )
        scales = (torch.rand(n_groups, out_features, generator=generator) * 0.03 + 0.005).half()
        columns = torch.randperm(in_features, generator=generator) if desc_act else torch.arange(in_features)
        g_idx = (columns // group_size).int()  # act-order: each column's group follows its quantization order
        module.weight.data = (scales.float()[g_idx.long()] * (ints.t() - zeros[g_idx.long()]).float()).t().contiguous()
        for part, tensor in int4.gptq_pack(ints, zeros, scales, g_idx).items():
            tensors[f"{name}.{part}"] = tensor
    return tensors


def write_gptq_checkpoint(hf_model, directory, gptq_tensors, quant_config: dict, as_package: bool) -> None:
    """A GPTQ checkpoint as the ecosystem writes it (quantization_config in config.json, model.safetensors)
    or as our model package (quant_config.json, model_int4.safetensors)."""
    directory.mkdir(parents=True, exist_ok=True)
    dense = {
        k: v
        for k, v in hf_model.state_dict().items()
        if not (k.endswith(".weight") and k[: -len(".weight")] + ".qweight" in gptq_tensors)
    }
    if hf_model.config.tie_word_embeddings:
        del dense["lm_head.weight"]
    config = hf_model.config.to_dict()
    if as_package:
        (directory / "quant_config.json").write_text(json.dumps(quant_config))
        save_file({**dense, **gptq_tensors}, directory / "model_int4.safetensors")
    else:
        config["quantization_config"] = quant_config
        save_file({**dense, **gptq_tensors}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))


def write_package_with_int4_embedding(hf_model, directory, seed: int) -> None:
    """A package whose tied embedding is GPTQ tensors too (quant_config "quantized_embedding"); hf_model
    gets the dequantized table, so it is the reference for what the package means."""
    gptq = quantize_into(hf_model, 32, True, False, seed=seed)
    table = int4.rtn_quantize(hf_model.model.embed_tokens.weight.detach(), 32, sym=False)
    hf_model.model.embed_tokens.weight.data = int4.gptq_dequantize(**table)
    gptq.update({f"model.embed_tokens.{part}": tensor for part, tensor in table.items()})
    quant_config = gptq_quant_config(group_size=32) | {"quantized_embedding": {"group_size": 32}}
    write_gptq_checkpoint(hf_model, directory, gptq, quant_config, as_package=True)


def add_peft_adapter(hf_model, directory, **overrides):
    """Wrap `hf_model` in a random (non-zero) PEFT LoRA, save it under the package's file names."""
    settings = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    settings.update(overrides)
    torch.manual_seed(13)
    peft_model = peft.get_peft_model(hf_model, peft.LoraConfig(**settings)).eval()
    adapter_dir = directory.parent / "adapter"
    peft_model.save_pretrained(adapter_dir)
    shutil.copy(adapter_dir / "adapter_model.safetensors", directory / "lora.safetensors")
    shutil.copy(adapter_dir / "adapter_config.json", directory / "lora_config.json")
    return peft_model


def reference_greedy(hf_model, row: list[int], max_new_tokens: int) -> list[int]:
    out = hf_model.generate(
        torch.tensor([row]),
        attention_mask=torch.ones(1, len(row), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, len(row) :].tolist()


def random_rows(lengths: list[int], seed: int, vocab: int = 256) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def forward_all(drafter: draft_model.Drafter, tokens: list[int]) -> torch.Tensor:
    """Our logits for every position of one sequence in one forward through cache slot 0: (T, vocab)."""
    drafter.cache.clear_garbage([0], drafter.max_context)
    pieces = planning.prefill_pieces([len(tokens)], reused=[0])  # one row: its tokens stay in order
    plan = engine.plan_for(pieces, slots=[0], capacity=drafter.cache.capacity, device=torch.device("cpu"))
    return drafter.model.logits(drafter.model(torch.tensor(tokens), drafter.cache, plan))


def gptq_quant_config(group_size: int, sym: bool = True, desc_act: bool = False) -> dict:
    """A quant_config.json (Hugging Face GPTQConfig field names) for a 4-bit GPTQ v1 checkpoint."""
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "sym": sym,
        "desc_act": desc_act,
        "checkpoint_format": "gptq",
    }


def write_default_path_package(directory: Path) -> Path:
    """A GPTQ package with an INT4 table and a LoRA adapter, weights at the usual 0.02 scale (near-ties are
    common): the default load runs it packed INT4 in bf16."""
    hf_model = make_hf_model("qwen3", seed=5, initializer_range=0.02)
    write_package_with_int4_embedding(hf_model, directory, seed=6)
    add_peft_adapter(hf_model, directory)
    return directory
