"""The exact offline tau estimator: tokens committed per target verify step under greedy verification.

With greedy verification the target commits, at each verify step, the longest prefix of the k drafted
tokens that equals its own greedy tokens, plus one token of its own (the bonus). While the drafts agree
with the target they are conditioned on exactly the target's tokens, so the drafter's token at each
position is its *teacher-forced* argmax on the target's greedy continuation. Hence one teacher-forced
forward over the target's continuation c[0..n) gives, per position t, match[t] = (argmax_t == c[t]), and
the verify loop is replayed from the match vector alone:

    s = 0; steps = 0
    while s < n:  run = number of consecutive matches from s, capped at k and at n - s
                  s += min(run + 1, n - s); steps += 1      # accepted drafts + bonus, stopping at n
    tau = n / steps  (summed over sequences: total committed / total steps)

This equals what a draft-and-verify harness measures on the same continuation (tests/test_tau.py runs
the real loop and checks equality).

Reads: a model (Hugging Face directory, or a model package with quant_config.json) and data shards from
gen_data.py. Writes: a JSON report on stdout (and to --out if given).

    python -m evidence.measure.tau --model STUDENT_DIR --data DATA_DIR --k 16 [--split holdout] [--out tau.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import draft_model
from evidence import common
from evidence.packages import dequantized_model, load_any_model
from evidence.teacher.gen_data import collate, generate_transformers, load_examples


@dataclass
class TauReport:
    tau: float  # committed / steps
    committed: int  # tokens of the teacher's continuations
    steps: int  # verify steps needed to commit them
    top1_agreement: float  # fraction of positions where the student's argmax is the teacher's token
    sequences: int
    k: int


def committed_per_step(matches: Sequence[bool], k: int) -> list[int]:
    """Tokens committed at each verify step of one sequence, given its teacher-forced match vector."""
    n = len(matches)
    committed = []
    start = 0
    while start < n:
        run = 0
        while run < k and start + run < n and matches[start + run]:
            run += 1
        step = min(run + 1, n - start)  # accepted drafts + the bonus, never past the continuation
        committed.append(step)
        start += step
    return committed


def tau_from_matches(match_rows: Sequence[Sequence[bool]], k: int) -> TauReport:
    """Replay greedy verification on every sequence's match vector and pool the counts."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    committed = steps = agreeing = positions = 0
    for matches in match_rows:
        per_step = committed_per_step([bool(m) for m in matches], k)
        committed += sum(per_step)
        steps += len(per_step)
        agreeing += int(sum(bool(m) for m in matches))
        positions += len(matches)
    return TauReport(
        tau=committed / steps if steps else float("nan"),
        committed=committed,
        steps=steps,
        top1_agreement=agreeing / positions if positions else float("nan"),
        sequences=len(match_rows),
        k=k,
    )


def backbone_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The decoder stack and the lm_head of a causal LM, looking through DDP and PEFT wrappers."""
    while hasattr(model, "module"):  # DistributedDataParallel
        model = model.module
    if hasattr(model, "get_base_model"):  # PEFT: the base model with the LoRA layers injected
        model = model.get_base_model()
    return model.model, model.lm_head


def continuation_logits(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Logits at the positions that predict the continuation tokens only: [N, vocab] for N targets.

    Computing the head on those positions alone keeps memory at N x vocab instead of B x T x vocab."""
    backbone, head = backbone_and_head(model)
    hidden = backbone(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state  # [B, T, H]
    selected = hidden[batch["row_index"], batch["position_index"]]  # [N, H]
    return head(selected)  # [N, V]


@torch.no_grad()
def teacher_forced_argmax(
    model: torch.nn.Module, examples: list[dict], batch_size: int = 8, progress: bool = True
) -> list[torch.Tensor]:
    """Per example, the model's argmax at every continuation position given the teacher's tokens: [n]."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    predictions: list[torch.Tensor] = []
    for first in tqdm(range(0, len(examples), batch_size), desc="teacher-forced", disable=not progress, leave=False):
        chunk = examples[first : first + batch_size]
        batch = {key: value.to(device) for key, value in collate(chunk).items()}
        argmax = continuation_logits(model, batch).argmax(-1).cpu()  # [N]
        predictions.extend(argmax.split([len(e["tokens"]) for e in chunk]))
    model.train(was_training)
    return predictions


def offline_tau(
    model: torch.nn.Module, examples: list[dict], k: int, batch_size: int = 8, progress: bool = True
) -> TauReport:
    """The tau a greedy draft-and-verify harness would measure with `model` drafting k tokens."""
    predictions = teacher_forced_argmax(model, examples, batch_size, progress)
    return tau_from_matches([p == e["tokens"] for p, e in zip(predictions, examples)], k)


def argmax_agreement(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    """Fraction of positions where two models' teacher-forced argmaxes agree."""
    same = sum(int((a == b).sum()) for a, b in zip(first, second))
    total = sum(len(a) for a in first)
    return same / total if total else float("nan")


@torch.no_grad()
def package_draft_agreement(package: Path, data: Path, k: int, rows: int = 4) -> float:
    """draft_model's greedy drafts from the package vs greedy decoding of the Hugging Face model the
    pipeline measured (dequantized INT4 + merged LoRA), on a few holdout prompts: the fraction of the
    compared draft tokens that are equal (1.0 means the package means what was measured)."""
    device = common.pick_device(None)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    examples = load_examples(data, "holdout")[:rows]
    drafter = draft_model.load_model(package, device=device, dtype=dtype)
    prompts = [e["prompt_ids"].tolist() for e in examples]
    drafts = draft_model.draft_batch(drafter, prompts, max_tokens=k)
    reference = dequantized_model(package, device=device, dtype=dtype)
    same = total = 0
    for prompt, draft in zip(prompts, drafts):
        expected = generate_transformers(reference, [prompt], max_new_tokens=k, top_k=1, eos_ids=[-1])[0][0].tolist()
        compared = min(len(draft), len(expected))
        same += sum(int(a == b) for a, b in zip(list(draft)[:compared], expected[:compared]))
        total += compared
    return same / total if total else float("nan")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="HF model directory or model package")
    parser.add_argument("--data", type=Path, required=True, help="directory of gen_data.py shards")
    parser.add_argument("--k", type=int, default=16, help="draft tokens per verify step")
    parser.add_argument("--split", choices=("holdout", "train", "all"), default="holdout")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here (JSON)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> TauReport:
    args = parse_args(argv)
    if args.k < 1:
        raise common.UserError(f"--k must be at least 1, got {args.k}")
    device = common.pick_device(args.device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    examples = load_examples(args.data, args.split)
    model = load_any_model(args.model, device, dtype)
    report = offline_tau(model, examples, args.k, args.batch_size)
    text = json.dumps(asdict(report), indent=2)
    print(text)
    if args.out:
        common.atomic_write_text(args.out, text + "\n")
    return report


if __name__ == "__main__":
    common.run_cli(main)
