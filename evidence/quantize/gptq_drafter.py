"""GPTQ INT4 quantization of the distilled drafter, calibrated on its own training data, written as the
model package (docs/package-format.md).

GPTQ (Frantar et al., 2022) quantizes a Linear's weight W [out, in] one input column at a time and
spreads each column's rounding error over the columns not yet quantized, weighted by the inverse of
the Hessian H = 2 X^T X / n of the layer's inputs X, so that ||X W^T - X Q^T|| stays small where the
inputs actually live. Here: per decoder layer, in the order q/k/v -> o -> gate/up -> down, each Hessian
is collected from calibration sequences flowing through the already-quantized earlier layers and
sub-layers; dampening adds `damp_percent * mean(diag H)` to the diagonal; optional act-order visits
columns by decreasing diag(H) (groups are contiguous in that order; g_idx maps each column, in its
original place, to its group), or with --static-groups keeps the groups at G consecutive columns, their
grids fixed up front, so g_idx = k // G as INT4 kernels expect. Scales are rounded to fp16 before use,
since that is what is stored. With --embedding-group-size G the tied embedding / lm_head table is
rounded to 4 bits too (asymmetric, groups of G along the hidden size; --embedding-method gptq: GPTQ with
error feedback on the Hessian of the lm_head's inputs, collected after the layers are quantized, with
act-order and static groups; rtn: round-to-nearest) and stored as
GPTQ tensors model.embed_tokens.{qweight,qzeros,scales,g_idx}; quant_config.json then says
"quantized_embedding": {"group_size": G, ...}. For a small drafter the table is most of the bytes.

Reads: the student (HF directory from train_drafter.py), DATA_DIR (gen_data.py; train rows calibrate,
holdout rows measure). Writes PACKAGE_DIR: config.json, generation_config.json, quant_config.json,
model_int4.safetensors (packed with int4.gptq_pack), model_card.json; beside it
PACKAGE_DIR.gptq_drafter.json (holdout tau of the student and of INT4, top-1 agreement INT4 vs student)
and the log PACKAGE_DIR.gptq_drafter.log.

    python -m evidence.quantize.gptq_drafter --student WORK/student --data WORK/data --out WORK/package \
        --group-size 128 --sym --act-order --static-groups --calib-samples 256 --k 16
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM

import checkpoint
import int4
import package_manifest
from evidence import common
from evidence.measure.tau import argmax_agreement, tau_from_matches, teacher_forced_argmax
from evidence.teacher.gen_data import load_split

# Sub-layers quantized in this order; each group's Hessians see the earlier groups already quantized.
SEQUENTIAL_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


@dataclass
class QuantSettings:
    group_size: int = 128
    sym: bool = True
    act_order: bool = False
    damp_percent: float = 0.01
    static_groups: bool = False  # grids fixed per original column group up front: g_idx stays k // G


@dataclass
class QuantizedLinear:
    int_weight: torch.Tensor  # [out, in] int64, 0..15
    zeros: torch.Tensor  # [groups, out] int64, the real zero point 0..15
    scales: torch.Tensor  # [groups, out] fp32 holding fp16-representable values
    g_idx: torch.Tensor  # [in] int64, group of each input column

    def dequantize(self) -> torch.Tensor:
        """W [out, in] = scale * (q - zero) of each column's group (the GPTQ definition)."""
        return int4.dequantize(self.int_weight, self.zeros, self.scales, self.g_idx)

    def to(self, device: str | torch.device) -> QuantizedLinear:
        return QuantizedLinear(*(t.to(device) for t in (self.int_weight, self.zeros, self.scales, self.g_idx)))

    def pack(self) -> dict[str, torch.Tensor]:
        return int4.gptq_pack(self.int_weight, self.zeros, self.scales, self.g_idx)


def rtn_quantize(weight: torch.Tensor, settings: QuantSettings) -> QuantizedLinear:
    """Round-to-nearest with the same grids: the baseline GPTQ has to beat."""
    return QuantizedLinear(*int4.rtn_integers(weight, settings.group_size, settings.sym))


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, settings: QuantSettings) -> QuantizedLinear:
    """GPTQ of one weight [out, in] given the Hessian [in, in] of its inputs."""
    out_features, in_features = weight.shape
    size = settings.group_size
    if in_features % size:
        raise common.UserError(f"input width {in_features} is not a multiple of the group size {size}")
    W = weight.detach().float().clone()  # [out, in], updated in place as errors are spread
    H = hessian.detach().float().clone()  # [in, in]
    dead = H.diagonal() == 0  # columns never active in calibration: zero them, keep H invertible
    H[dead, dead] = 1
    W[:, dead] = 0
    device = W.device
    order = (
        torch.argsort(H.diagonal(), descending=True) if settings.act_order else torch.arange(in_features, device=device)
    )
    W, H = W[:, order], H[order][:, order]
    H.diagonal().add_(settings.damp_percent * H.diagonal().mean())
    # Upper Cholesky factor of H^-1: row i holds the update coefficients for the columns after i.
    H_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    ints = torch.zeros((out_features, in_features), dtype=torch.long, device=device)
    scales = torch.zeros((in_features // size, out_features), device=device)
    zeros = torch.zeros((in_features // size, out_features), dtype=torch.long, device=device)
    original_group = torch.arange(in_features, device=device)[order] // size  # [in] group of each visited column
    if settings.static_groups:  # each original group's grid from the weights before any error feedback
        unpermuted = W[:, torch.argsort(order)]
        for group in range(in_features // size):
            scales[group], zeros[group] = int4.group_grid(
                unpermuted[:, group * size : (group + 1) * size], settings.sym
            )
    for start in range(0, in_features, size):  # one group per block, so a group's grid sees its current values
        end = start + size
        block = W[:, start:end].clone()  # [out, G]
        errors = torch.zeros_like(block)
        if not settings.static_groups:
            scales[start // size], zeros[start // size] = int4.group_grid(block, settings.sym)
        for i in range(size):
            group = original_group[start + i] if settings.static_groups else start // size
            scale, zero = scales[group], zeros[group]
            q = int4.quantize(block[:, i], scale, zero)  # [out]
            dequantized = scale * (q - zero).float()  # int4.dequantize of this one column
            ints[:, start + i] = q
            error = (block[:, i] - dequantized) / H_inv[start + i, start + i]  # [out]
            block[:, i:] -= error[:, None] * H_inv[start + i, start + i : end][None, :]
            errors[:, i] = error
        W[:, end:] -= errors @ H_inv[start:end, end:]  # lazy batch update of the later columns
    inverse = torch.argsort(order)
    if settings.static_groups:
        g_idx = torch.arange(in_features, device=device) // size
    else:  # groups are contiguous in the visiting order; map each column, in its original place, to its group
        g_idx = (torch.arange(in_features, device=device) // size)[inverse]
    return QuantizedLinear(ints[:, inverse], zeros, scales, g_idx)


# ---------------------------------------------------------------------------------------------------
# Layer-by-layer calibration


class StopForward(Exception):
    """Raised by the capture hook once the first decoder layer's inputs are recorded."""


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.model.layers


@torch.no_grad()
def first_layer_inputs(model: torch.nn.Module, sequences: list[torch.Tensor]) -> list[tuple[torch.Tensor, dict]]:
    """For each calibration sequence, the hidden states [1, T, H] and keyword arguments (rotary
    embeddings, mask, positions) with which the model calls its first decoder layer."""
    captured = []

    def capture(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append((hidden, {key: value for key, value in kwargs.items() if key != "hidden_states"}))
        raise StopForward

    handle = decoder_layers(model)[0].register_forward_pre_hook(capture, with_kwargs=True)
    device = next(model.parameters()).device
    try:
        for sequence in sequences:
            try:
                model(input_ids=sequence[None].to(device), use_cache=False)
            except StopForward:
                pass
    finally:
        handle.remove()
    return captured


def run_layer(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    output = layer(hidden, **kwargs)
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def collect_hessians(
    layer: torch.nn.Module, names: tuple[str, ...], inputs: list[tuple[torch.Tensor, dict]]
) -> dict[str, torch.Tensor]:
    """H = 2 X^T X / n [in, in] for each named Linear of `layer`, over every calibration token."""
    sums: dict[str, torch.Tensor] = {}
    counts = dict.fromkeys(names, 0)

    def accumulate(name: str):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()  # [tokens, in]
            sums[name] = sums.get(name, 0) + x.t() @ x
            counts[name] += x.shape[0]

        return hook

    handles = [layer.get_submodule(name).register_forward_pre_hook(accumulate(name)) for name in names]
    try:
        for hidden, kwargs in inputs:
            run_layer(layer, hidden, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return {name: 2 * sums[name] / counts[name] for name in names}


def quantize_model(
    model: torch.nn.Module, sequences: list[torch.Tensor], settings: QuantSettings, logger
) -> dict[str, QuantizedLinear]:
    """GPTQ every projection of every decoder layer in place (the model's weights become the
    dequantized INT4 weights); returns the quantized tensors by HF module name."""
    quantized: dict[str, QuantizedLinear] = {}
    inputs = first_layer_inputs(model, sequences)
    for index, layer in enumerate(tqdm(decoder_layers(model), desc="GPTQ layers")):
        for names in SEQUENTIAL_GROUPS:
            hessians = collect_hessians(layer, names, inputs)
            for name in names:
                linear = layer.get_submodule(name)
                original = linear.weight.detach().float().clone()  # the copy_ below overwrites the weight
                result = gptq_quantize(original, hessians[name], settings).to("cpu")
                with torch.no_grad():
                    linear.weight.copy_(packed_weight(result).to(linear.weight))
                quantized[f"model.layers.{index}.{name}"] = result
                error = hessian_error(original.cpu(), result, hessians[name].cpu())
                logger.info("layer %d %s: relative output error %.5f", index, name, error)
        with torch.no_grad():  # the next layer calibrates on what this quantized layer produces
            inputs = [(run_layer(layer, hidden, kwargs), kwargs) for hidden, kwargs in inputs]
    return quantized


def packed_weight(result: QuantizedLinear) -> torch.Tensor:
    """The weight [out, in] exactly as a loader reads it back from the package."""
    return int4.gptq_dequantize(**result.pack(), checkpoint_format="gptq")


def hessian_error(original: torch.Tensor, result: QuantizedLinear, hessian: torch.Tensor) -> float:
    """tr(D H D^T) / tr(W H W^T) with D = W - Q: the relative squared output error on calibration inputs."""
    difference = original - result.dequantize()
    return float(
        torch.einsum("oi,ij,oj->", difference, hessian, difference)
        / torch.einsum("oi,ij,oj->", original, hessian, original).clamp_min(1e-30)
    )


# ---------------------------------------------------------------------------------------------------
# The package


def is_tied(model: torch.nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def package_tensors(
    model: torch.nn.Module,
    quantized: dict[str, QuantizedLinear],
    store_dtype: torch.dtype,
    embedding: dict[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """Quantized projections (and the quantized embedding, if any) as GPTQ tensors; every other tensor
    under its HF name in `store_dtype`; a tied lm_head is left out (the loader re-ties it)."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        module, _, kind = name.rpartition(".")
        if (module in quantized and kind == "weight") or (name == "lm_head.weight" and is_tied(model)):
            continue
        if name == "model.embed_tokens.weight" and embedding is not None:
            continue
        tensors[name] = tensor.detach().to(store_dtype).cpu().contiguous()
    for module, result in quantized.items():
        for kind, tensor in result.pack().items():
            tensors[f"{module}.{kind}"] = tensor.contiguous()
    for kind, tensor in (embedding or {}).items():
        tensors[f"model.embed_tokens.{kind}"] = tensor.contiguous()
    return tensors


def check_embedding_group_size(model: torch.nn.Module, group_size: int, logger) -> None:
    """Refuse, before any work, a table --embedding-group-size cannot quantize; warn when draft_model's
    packed path would have to keep it dense."""
    if not is_tied(model):
        raise common.UserError(
            "--embedding-group-size needs a tied embedding (tie_word_embeddings): the INT4 table serves both ends"
        )
    vocab, hidden = model.get_input_embeddings().weight.shape
    if hidden % group_size:
        raise common.UserError(f"--embedding-group-size {group_size} does not divide the hidden size {hidden}")
    if group_size not in int4.INT4_KERNEL_GROUP_SIZES or vocab % 64:
        logger.warning(
            "the packed INT4 path reads the table with groups in %s and a vocabulary divisible by 64 (here %d, %d): it will load dense",
            int4.INT4_KERNEL_GROUP_SIZES,
            group_size,
            vocab,
        )


@torch.no_grad()
def head_hessian(model: torch.nn.Module, sequences: list[torch.Tensor]) -> torch.Tensor:
    """H = 2 X^T X / n of the lm_head's inputs (the final norm's output) over the calibration sequences,
    with the model as it is now (its layers already quantized)."""
    head = model.get_output_embeddings()
    hidden = head.weight.shape[1]
    total, count = torch.zeros(hidden, hidden, dtype=torch.float64), 0

    def accumulate(module, args):
        nonlocal total, count
        x = args[0].reshape(-1, hidden).double().cpu()
        total += x.t() @ x
        count += x.shape[0]

    hook = head.register_forward_pre_hook(accumulate)
    try:
        for sequence in sequences:
            model(sequence[None].to(head.weight.device))
    finally:
        hook.remove()
    return (2 * total / max(count, 1)).float()


@torch.no_grad()
def quantize_embedding(
    model: torch.nn.Module, group_size: int, hessian: torch.Tensor | None = None, damp_percent: float = 0.01
) -> dict[str, torch.Tensor]:
    """Round the tied embedding table to 4 bits (asymmetric, groups of `group_size` along the hidden size)
    in place; its GPTQ tensors. With the lm_head inputs' Hessian, GPTQ with error feedback (act-order with
    static groups, so g_idx stays k // G for the INT4 kernel); without, round-to-nearest."""
    table = model.get_input_embeddings().weight  # [vocab, hidden]: a linear of in=hidden, out=vocab
    if hessian is None:
        gptq = int4.rtn_quantize(table.float().cpu(), group_size, sym=False)
    else:
        settings = QuantSettings(group_size, sym=False, act_order=True, damp_percent=damp_percent, static_groups=True)
        gptq = gptq_quantize(table.float().cpu(), hessian.cpu(), settings).pack()
    table.copy_(int4.gptq_dequantize(**gptq).to(table.dtype))
    return gptq


def round_unquantized(model: torch.nn.Module, quantized: dict[str, QuantizedLinear], store_dtype: torch.dtype) -> None:
    """Round the model's other tensors through `store_dtype`, so measurements match the package."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.rpartition(".")[0] not in quantized:
                parameter.copy_(parameter.to(store_dtype).to(parameter.dtype))


def write_package(
    out_dir: Path, model: torch.nn.Module, tensors: dict[str, torch.Tensor], quant_config: dict, model_card: dict
) -> None:
    with common.atomic_directory(out_dir) as staging:
        model.config.save_pretrained(staging)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(staging)
        (staging / checkpoint.PACKAGE_QUANT_CONFIG).write_text(json.dumps(quant_config, indent=2) + "\n")
        (staging / checkpoint.PACKAGE_MODEL_CARD).write_text(json.dumps(model_card, indent=2) + "\n")
        save_file(tensors, str(staging / checkpoint.PACKAGE_WEIGHTS), metadata={"format": "pt"})
        package_manifest.write_manifest(staging)


def quant_config(
    settings: QuantSettings, calib_samples: int, embedding_group_size: int | None, embedding_method: str = "gptq"
) -> dict:
    """HF GPTQConfig field names. desc_act tells loaders whether g_idx is a reordering; with static groups
    it is not (columns were visited in act-order, but every group is still G consecutive columns).
    quantized_embedding is this project's extension (draft_model reads it)."""
    embedding = (
        {"quantized_embedding": {"group_size": embedding_group_size, "method": embedding_method, "sym": False}}
        if embedding_group_size
        else {}
    )
    return embedding | {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": settings.group_size,
        "sym": settings.sym,
        "desc_act": settings.act_order and not settings.static_groups,
        "static_groups": settings.static_groups,
        "act_order": settings.act_order,
        "damp_percent": settings.damp_percent,
        "checkpoint_format": "gptq",
        "modules_to_not_convert": ["lm_head"],
        "calibration_samples": calib_samples,
    }


# ---------------------------------------------------------------------------------------------------


def calibration_sequences(examples: list[dict], count: int, max_tokens: int) -> list[torch.Tensor]:
    """`count` training sequences (prompt + teacher continuation), chosen by id hash, cut to max_tokens."""
    chosen = sorted(examples, key=lambda e: common.stable_hash_fraction(e["id"]))[:count]
    return [torch.cat([e["prompt_ids"], e["tokens"]])[:max_tokens].long() for e in chosen]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--student", type=Path, required=True, help="student model directory (train_drafter.py output)")
    parser.add_argument("--data", type=Path, required=True, help="gen_data.py output directory")
    parser.add_argument("--out", type=Path, required=True, help="model package directory to write")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument(
        "--sym", action=argparse.BooleanOptionalAction, default=True, help="symmetric grids (--no-sym: asymmetric)"
    )
    parser.add_argument(
        "--act-order",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="quantize columns by decreasing Hessian diagonal",
    )
    parser.add_argument(
        "--static-groups",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --act-order: fix each group's grid up front so g_idx stays k // group (INT4 kernels need that)",
    )
    parser.add_argument(
        "--embedding-group-size",
        type=int,
        default=None,
        help="also round the tied embedding to INT4 in groups of G (default: keep it in --store-dtype)",
    )
    parser.add_argument(
        "--embedding-method",
        choices=("gptq", "rtn"),
        default="gptq",
        help="how the table is rounded: GPTQ on the lm_head's inputs, or round-to-nearest",
    )
    parser.add_argument("--damp-percent", type=float, default=0.01)
    parser.add_argument(
        "--last-shard", type=int, default=None, help="read the shards through this number (default: all)"
    )
    parser.add_argument("--calib-samples", type=int, default=256)
    parser.add_argument("--calib-max-tokens", type=int, default=2048)
    parser.add_argument(
        "--store-dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="dtype of the unquantized tensors",
    )
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--name", default="drafter-int4", help="model_card.json name")
    parser.add_argument("--card", type=Path, default=None, help="JSON file of extra model_card.json fields")
    parser.add_argument("--device", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    for flag, value in (("--group-size", args.group_size), ("--embedding-group-size", args.embedding_group_size or 8)):
        if value < 8 or value % 8:
            raise common.UserError(f"{flag} must be a positive multiple of 8, got {value}")
    if not 0 <= args.damp_percent < 1 or args.calib_samples < 1 or args.k < 1:
        raise common.UserError(
            f"need --damp-percent in [0, 1), --calib-samples >= 1, --k >= 1; got {args.damp_percent}, {args.calib_samples}, {args.k}"
        )
    logger = common.setup_logging(common.log_path_beside(args.out, "gptq_drafter"), "gptq_drafter")
    logger.info(
        "command: python -m evidence.quantize.gptq_drafter %s", " ".join(sys.argv[1:] if argv is None else argv)
    )
    if not (args.student / "config.json").is_file():
        raise common.UserError(f"--student {args.student} is not a model directory (no config.json)")
    settings = QuantSettings(args.group_size, args.sym, args.act_order, args.damp_percent, args.static_groups)
    device = common.pick_device(args.device)
    store_dtype = getattr(torch, args.store_dtype)
    model = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32).to(device).eval()
    if args.embedding_group_size:
        check_embedding_group_size(model, args.embedding_group_size, logger)
    train_examples, holdout = load_split(args.data, last_shard=args.last_shard)
    student_argmax = teacher_forced_argmax(model, holdout)
    sequences = calibration_sequences(train_examples, args.calib_samples, args.calib_max_tokens)
    quantized = quantize_model(model, sequences, settings, logger)
    round_unquantized(model, quantized, store_dtype)
    embedding = None
    if args.embedding_group_size:
        hessian = head_hessian(model, sequences) if args.embedding_method == "gptq" else None
        embedding = quantize_embedding(model, args.embedding_group_size, hessian, args.damp_percent)
    int4_argmax = teacher_forced_argmax(model, holdout)
    card = {
        "name": args.name,
        "description": "GPTQ INT4 drafter distilled from the target's greedy continuations",
        "random_weights": False,
        **(common.read_json(args.card, "model card") if args.card else {}),
    }
    config = quant_config(settings, len(sequences), args.embedding_group_size, args.embedding_method)
    write_package(args.out, model, package_tensors(model, quantized, store_dtype, embedding), config, card)
    report = {
        "settings": asdict(settings),
        "store_dtype": args.store_dtype,
        "embedding_group_size": args.embedding_group_size,
        "embedding_method": args.embedding_method if args.embedding_group_size else None,
        "calibration_sequences": len(sequences),
        "calibration_tokens": sum(len(s) for s in sequences),
        "student_holdout": asdict(
            tau_from_matches([p == e["tokens"] for p, e in zip(student_argmax, holdout)], args.k)
        ),
        "int4_holdout": asdict(tau_from_matches([p == e["tokens"] for p, e in zip(int4_argmax, holdout)], args.k)),
        "int4_vs_student_top1_agreement": argmax_agreement(int4_argmax, student_argmax),
    }
    common.atomic_write_json(common.log_path_beside(args.out, "gptq_drafter").with_suffix(".json"), report)
    logger.info(
        "holdout tau: student %.4f, INT4 %.4f; INT4 vs student top-1 agreement %.4f",
        report["student_holdout"]["tau"],
        report["int4_holdout"]["tau"],
        report["int4_vs_student_top1_agreement"],
    )
    return report


if __name__ == "__main__":
    common.run_cli(main)
