"""Write a small RANDOM-weight Qwen3 model package, in the real package format (docs/package-format.md).

It is not a trained drafter: its drafts are noise (tau ~ 1). The server tests and the speed benchmarks
use such packages: they have the real Qwen3 vocabulary and shapes, and random weights time exactly like
trained ones.

Reads nothing. Writes into --output (built in a temporary directory beside it, then renamed):
  config.json              Hugging Face Qwen3 config (real Qwen3 vocabulary size, so Qwen3 token ids validate)
  quant_config.json        GPTQ settings: 4 bits, symmetric, group 32, no act-order (with --embedding-group-size
                           also "quantized_embedding")
  model_int4.safetensors   every q/k/v/o/gate/up/down projection as GPTQ v1 tensors; the tied embedding in bf16
                           (or as GPTQ tensors with --embedding-group-size); norms in bf16
  lora.safetensors         a random PEFT LoRA adapter on every projection
  lora_config.json         its PEFT adapter config
  model_card.json          what this is: random weights, placeholder, the command that made it

Weights come from a seeded torch.Generator, so the same command writes the same tensors. The projections
are drawn in floating point and rounded to nearest onto the 4-bit grid (no GPTQ error feedback: there
is nothing to preserve in random weights). Then the package is loaded back with draft_model and drafts
once, so a broken package never lands.

    python -m evidence.quantize.make_random_package --output model --force
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

import draft_model
import int4
import package_manifest

QWEN3_BOS, QWEN3_EOS = 151643, 151645  # <|endoftext|>, <|im_end|>


def qwen3_config(args: argparse.Namespace) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "bos_token_id": QWEN3_BOS,
        "eos_token_id": QWEN3_EOS,
        "torch_dtype": "bfloat16",
    }


def projection_shapes(hf_config: dict) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every projection of one decoder layer, keyed by its module name in the
    layer (self_attn.q_proj); head_dim defaults to hidden_size / num_attention_heads, as in transformers."""
    hidden, inner = hf_config["hidden_size"], hf_config["intermediate_size"]
    head_dim = hf_config.get("head_dim") or hidden // hf_config["num_attention_heads"]
    q_width = hf_config["num_attention_heads"] * head_dim
    kv_width = hf_config["num_key_value_heads"] * head_dim
    return {
        "self_attn.q_proj": (q_width, hidden),
        "self_attn.k_proj": (kv_width, hidden),
        "self_attn.v_proj": (kv_width, hidden),
        "self_attn.o_proj": (hidden, q_width),
        "mlp.gate_proj": (inner, hidden),
        "mlp.up_proj": (inner, hidden),
        "mlp.down_proj": (hidden, inner),
    }


def random_weights(
    config: dict, group_size: int, embedding_group_size: int | None, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Every tensor of model_int4.safetensors under its Hugging Face name."""
    std = 0.1  # large enough that greedy argmaxes are well separated

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    table = normal(config["vocab_size"], config["hidden_size"])
    if embedding_group_size:  # the tied table as GPTQ tensors too (quant_config "quantized_embedding")
        tensors = {
            f"model.embed_tokens.{part}": t
            for part, t in int4.rtn_quantize(table, embedding_group_size, sym=False).items()
        }
    else:
        tensors = {"model.embed_tokens.weight": table.to(torch.bfloat16)}
    ones = {"hidden": torch.ones(config["hidden_size"]), "head": torch.ones(config["head_dim"])}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for module, (out_features, in_features) in projection_shapes(config).items():
            for part, tensor in int4.rtn_quantize(normal(out_features, in_features), group_size, sym=True).items():
                tensors[f"{prefix}.{module}.{part}"] = tensor
        tensors[f"{prefix}.input_layernorm.weight"] = ones["hidden"].to(torch.bfloat16)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = ones["hidden"].to(torch.bfloat16)
        tensors[f"{prefix}.self_attn.q_norm.weight"] = ones["head"].to(torch.bfloat16)
        tensors[f"{prefix}.self_attn.k_norm.weight"] = ones["head"].to(torch.bfloat16)
    tensors["model.norm.weight"] = ones["hidden"].to(torch.bfloat16)
    return tensors


def random_lora(config: dict, rank: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A PEFT-named LoRA adapter on every projection; B is random too (PEFT starts it at zero) so it matters."""
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (out_features, in_features) in projection_shapes(config).items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.1
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.1
    return tensors


def write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def write_package(directory: Path, args: argparse.Namespace, command: str) -> None:
    generator = torch.Generator().manual_seed(args.seed)
    config = qwen3_config(args)
    write_json(directory / "config.json", config)
    write_json(
        directory / "quant_config.json",
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": args.group_size,
            "sym": True,
            "desc_act": False,
            "checkpoint_format": "gptq",
            "modules_to_not_convert": ["lm_head"],
        }
        | (
            {"quantized_embedding": {"group_size": args.embedding_group_size, "method": "rtn", "sym": False}}
            if args.embedding_group_size
            else {}
        ),
    )
    save_file(
        random_weights(config, args.group_size, args.embedding_group_size, generator),
        directory / "model_int4.safetensors",
    )
    if args.lora_rank:
        save_file(random_lora(config, args.lora_rank, generator), directory / "lora.safetensors")
        write_json(
            directory / "lora_config.json",
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": args.lora_rank,
                "lora_alpha": 2 * args.lora_rank,
                "lora_dropout": 0.0,
                "target_modules": [module.rpartition(".")[2] for module in projection_shapes(config)],
                "bias": "none",
                "fan_in_fan_out": False,
                "use_rslora": False,
                "use_dora": False,
                "inference_mode": True,
                "base_model_name_or_path": None,
            },
        )
    write_json(
        directory / "model_card.json",
        {
            "name": "qwen3-random-int4-placeholder",
            "random_weights": True,
            "description": (
                "RANDOM weights, not a trained drafter: its drafts are noise and its tau is about 1. "
                "A placeholder in the real package format so serve.sh, the server tests and the benchmark run "
                "on a fresh clone, until the distilled drafter replaces model/."
            ),
            "target_model": "Qwen/Qwen3-8B",
            "vocabulary": f"Qwen3 token ids (vocab_size {args.vocab_size})",
            "made_by": command,
            "seed": args.seed,
        },
    )
    package_manifest.write_manifest(directory)  # last: it covers every file above


def check_package(directory: Path) -> None:
    """Load the package the way the server does and draft once; raises if anything is off."""
    drafter = draft_model.load_model(directory, device="cpu", dtype="float32", cache_slots=2)
    draft = draft_model.draft_batch(drafter, [[QWEN3_BOS, 872, 198]], max_tokens=4)[0]
    print(
        f"loaded back: {drafter.describe()['name']}, {drafter.num_layers} layers, vocab {drafter.vocab_size}; "
        f"draft for [{QWEN3_BOS}, 872, 198]: {list(draft)}"
    )


def replace_directory(new: Path, target: Path) -> None:
    """Move `new` into place as `target`; an existing `target` is swapped out first, then deleted."""
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        new.rename(target)
        shutil.rmtree(old)
    else:
        new.rename(target)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="package directory to write (e.g. model)")
    parser.add_argument("--force", action="store_true", help="replace --output if it exists")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=151936, help="default: Qwen3's")
    # hidden 32 keeps the bf16 embedding (vocab x hidden) under 10 MB; 64 would be 19 MB.
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--intermediate-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=32, help="GPTQ group size (divides every in_features)")
    parser.add_argument("--lora-rank", type=int, default=4, help="0 writes no adapter")
    parser.add_argument(
        "--embedding-group-size",
        type=int,
        default=None,
        help="store the tied embedding as INT4 in groups of G (default: bf16)",
    )
    args = parser.parse_args(argv)
    widths = {
        "--hidden-size": args.hidden_size,
        "--intermediate-size": args.intermediate_size,
        "--heads x --head-dim": args.heads * args.head_dim,
    }
    for flag, width in widths.items():
        if width % args.group_size or width % 8:
            parser.error(f"{flag} = {width} must be a multiple of --group-size {args.group_size} and of 8")
    if args.embedding_group_size is not None and (
        args.embedding_group_size < 8 or args.hidden_size % args.embedding_group_size or args.embedding_group_size % 8
    ):
        parser.error(
            f"--embedding-group-size {args.embedding_group_size} must divide --hidden-size {args.hidden_size} and be a multiple of 8"
        )
    if args.vocab_size <= QWEN3_EOS:
        parser.error(
            f"--vocab-size {args.vocab_size} is too small for the Qwen3 token ids the package declares "
            f"(bos {QWEN3_BOS}, eos {QWEN3_EOS}); use at least {QWEN3_EOS + 1}"
        )
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.output.exists() and not args.force:
        parser.error(f"{args.output} exists; pass --force to replace it")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python -m evidence.quantize.make_random_package " + " ".join(sys.argv[1:] if argv is None else argv)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{args.output.name}.tmp-", dir=args.output.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the package is meant to be read by anyone
    try:
        write_package(staging, args, command)
        check_package(staging)
        for file in staging.iterdir():
            file.chmod(0o644)  # safetensors writes owner-only files; a package is meant to be read by anyone
        replace_directory(staging, args.output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    size_mb = sum(f.stat().st_size for f in args.output.iterdir()) / 1e6
    print(f"wrote {args.output} ({size_mb:.1f} MB): {', '.join(sorted(f.name for f in args.output.iterdir()))}")


if __name__ == "__main__":
    main()
