"""Tiny random Hugging Face models, built and saved on the fly, for tests (no network)."""

from pathlib import Path

import torch
import transformers

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
