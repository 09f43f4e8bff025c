"""Distillation of the drafter: the base model learns the teacher's greedy continuations.

Loss per continuation position (token-mean over the batch):

    ce_weight * CE(student logits, teacher greedy token)
  + kl_weight * KL(p || q),  p = teacher top-K probabilities renormalised over those K ids,
                             q = student softmax restricted to the same K ids, renormalised over them.

AdamW, linear warmup then cosine decay to `min_lr_ratio * lr`, gradient accumulation, bf16 autocast on
GPU and on a CPU that multiplies bf16 in hardware (AVX512-BF16 or AMX; elsewhere emulated bf16 is slower
than fp32, so those CPUs train in fp32). Under torchrun / accelerate launch (WORLD_SIZE set) it runs as DDP: each rank takes every
WORLD_SIZE-th example of the shuffled epoch, rank 0 evaluates and saves. The checkpoint kept is the one
with the best holdout tau measured by the exact offline estimator (evidence/measure/tau.py), step 0 included.

Hard-label data (gen_data.py --top-k 0) gives a top 1 of probability 1, so the KL term is zero and the
loss is cross-entropy on the teacher's tokens; --teacher DIR recomputes the teacher's top --teacher-top-k
log-probabilities on the fly for each batch instead (one teacher forward per micro-batch, no storage).

--checkpoint-every N saves the trainable weights, optimizer, schedule, history and best weights to
OUT.train_drafter.checkpoint.pt every N steps (atomically); a rerun with the same flags and data resumes
from it at that step (the same micro-batches follow) and refuses a checkpoint of other settings or data.

Reads: the base model (directory or hub id + --base-revision) and DATA_DIR from gen_data.py.
Writes: OUT (a Hugging Face model directory with the selected weights), OUT.train_drafter.json (history
and the selected step) and the log OUT.train_drafter.log.

    python -m evidence.train.train_drafter --base Qwen/Qwen3-1.7B --base-revision COMMIT --data WORK/data \
        --out WORK/student --k 16 --epochs 2 --lr 2e-5
    torchrun --nproc_per_node 8 -m evidence.train.train_drafter ...same flags...
    python -m evidence.train.train_drafter --base SMALL/student_init --data evidence/data/sharegpt_labels \
        --out WORK/student --teacher SMALL/teacher --checkpoint-every 50 --lr 3e-4 --epochs 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM

import int4
from evidence import common
from evidence.measure.tau import continuation_logits, offline_tau
from evidence.teacher.gen_data import collate, load_split


def distillation_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    ce_weight: float,
    kl_weight: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """logits [N, V] of the student at N continuation positions; targets [N] the teacher's tokens;
    topk_ids / topk_logprobs [N, K] the teacher's top K. Returns the loss and its parts (token means)."""
    logits = logits.float()
    cross_entropy = F.cross_entropy(logits, targets)
    teacher_log_p = torch.log_softmax(topk_logprobs.float(), dim=-1)  # renormalised over the K ids
    student_log_q = torch.log_softmax(logits.gather(-1, topk_ids), dim=-1)  # [N, K] restricted, renormalised
    kl = (teacher_log_p.exp() * (teacher_log_p - student_log_q)).sum(-1).mean()
    loss = ce_weight * cross_entropy + kl_weight * kl
    return loss, {"ce": cross_entropy.item(), "kl": kl.item()}


def learning_rate_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup from 0 to 1 over warmup_steps, then cosine from 1 down to min_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class TrainSettings:
    k: int = 16
    lr: float = 2e-5
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    warmup_steps: int = 20
    epochs: float = 1.0
    max_steps: int | None = None  # optimizer steps; default from epochs
    batch_size: int = 4  # examples per micro-batch per rank
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    ce_weight: float = 1.0
    kl_weight: float = 1.0
    eval_every: int = 100  # optimizer steps between holdout tau measurements
    eval_batch_size: int = 8
    seed: int = 0
    # micro-batches whose examples are drawn together and sorted by length before they are cut, so a batch
    # pads to its own length instead of the epoch's longest (1: plain shuffled chunks)
    length_groups: int = 1
    # train on the shards numbered first_shard..last_shard (None: the last there is): a run from an earlier
    # package takes the labels that arrived since, and a config names its range so a rerun reads the same
    # shards when more are committed. The holdout is every shard's through last_shard, not only the range's.
    first_shard: int = 0
    last_shard: int | None = None
    bf16: bool = True  # autocast on CUDA, and on a CPU with bf16 hardware


class Distiller(torch.nn.Module):
    """The causal LM with a forward that returns logits at continuation positions only, so that DDP
    (which hooks the forward of the module it wraps) sees the whole computation."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return continuation_logits(self.model, batch)


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Distributed:
    """torch.distributed from torchrun's environment when WORLD_SIZE > 1; a single process otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Distributed()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    return Distributed(rank=dist.get_rank(), world_size=world_size, local_rank=local_rank)


@dataclass
class TrainOptions:
    """What train_drafter.py adds to the shared training loop: checkpoints to resume from, and a teacher
    whose top-k replaces the stored one."""

    checkpoint: Path | None = None  # resume from it when it exists; save to it every checkpoint_every steps
    checkpoint_every: int = 0
    fingerprint: str = ""  # settings and data; a checkpoint of another fingerprint is refused
    teacher: torch.nn.Module | None = None
    teacher_top_k: int = 20


@torch.no_grad()
def teacher_top_k(teacher: torch.nn.Module, batch: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    """The teacher's top-k ids and log-probabilities at the batch's continuation positions: [N, k] each."""
    logprobs = torch.log_softmax(continuation_logits(teacher, batch).float(), dim=-1)
    values, ids = logprobs.topk(k, dim=-1)
    return {"topk_ids": ids, "topk_logprobs": values}


def save_checkpoint(path: Path, step: int, state: dict) -> None:
    with common.atomic_path(path) as temporary:
        torch.save({"step": step, **state}, temporary)


def load_checkpoint(path: Path, fingerprint: str) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("fingerprint") != fingerprint:
        raise common.UserError(
            f"{path} was saved by a run with other settings or data; rerun with the same flags and data, or delete it"
        )
    return state


def train(
    model: torch.nn.Module,
    train_examples: list[dict],
    holdout_examples: list[dict],
    settings: TrainSettings,
    logger,
    distributed: Distributed | None = None,
    options: TrainOptions | None = None,
) -> dict:
    """Optimise the parameters of `model` that require grad; leave `model` holding the weights with the
    best holdout tau. Returns the history and the selected step."""
    distributed = distributed or Distributed()
    options = options or TrainOptions()
    device = next(model.parameters()).device
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise common.UserError("the model has no trainable parameters")
    distiller: torch.nn.Module = Distiller(model)
    if distributed.world_size > 1:
        ids = [distributed.local_rank] if device.type == "cuda" else None
        distiller = torch.nn.parallel.DistributedDataParallel(distiller, device_ids=ids)
    examples_per_step = settings.batch_size * settings.grad_accum * distributed.world_size
    total_steps = settings.max_steps or max(1, math.ceil(settings.epochs * len(train_examples) / examples_per_step))
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate_factor(step, settings.warmup_steps, total_steps, settings.min_lr_ratio)
    )
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if settings.bf16 and (device.type == "cuda" or int4.has_bf16_hardware())
        else nullcontext()
    )
    micro_batches = micro_batch_stream(train_examples, settings, distributed)
    history: list[dict] = []
    best = {"step": -1, "tau": -math.inf, "state": None}

    def evaluate(step: int, train_parts: dict | None) -> None:
        if distributed.is_main:
            report = offline_tau(model, holdout_examples, settings.k, settings.eval_batch_size, progress=False)
            history.append(
                {"step": step, "holdout_tau": report.tau, "holdout_top1": report.top1_agreement, **(train_parts or {})}
            )
            logger.info(
                "step %d: holdout tau %.4f, top-1 %.4f %s", step, report.tau, report.top1_agreement, train_parts or ""
            )
            if report.tau > best["tau"]:
                best.update(
                    step=step,
                    tau=report.tau,
                    state={n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad},
                )
        if distributed.world_size > 1:
            dist.barrier()

    named_trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start_step = 0
    if options.checkpoint is not None and options.checkpoint.is_file():
        state = load_checkpoint(options.checkpoint, options.fingerprint)
        with torch.no_grad():
            for name, value in state["trainable"].items():
                named_trainable[name].copy_(value.to(device))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        history[:] = state["history"]
        best.update(state["best"])
        start_step = state["step"]
        for _ in range(start_step * settings.grad_accum):  # the micro-batches the saved run already used
            next(micro_batches)
        logger.info("resumed from %s at step %d of %d", options.checkpoint, start_step, total_steps)
    model.train()
    if start_step == 0:
        evaluate(0, None)
    progress = tqdm(
        range(start_step + 1, total_steps + 1),
        desc="train",
        initial=start_step,
        total=total_steps,
        disable=not distributed.is_main,
    )
    for step in progress:
        parts = {"loss": 0.0, "ce": 0.0, "kl": 0.0}
        for micro in range(settings.grad_accum):
            batch = {key: value.to(device) for key, value in collate(next(micro_batches)).items()}
            if options.teacher is not None:
                batch.update(teacher_top_k(options.teacher, batch, options.teacher_top_k))
            last_micro = micro == settings.grad_accum - 1
            sync = nullcontext() if last_micro or distributed.world_size == 1 else distiller.no_sync()
            with sync:
                with autocast:
                    logits = distiller(batch)  # [N, V]
                loss, loss_parts = distillation_loss(
                    logits,
                    batch["targets"],
                    batch["topk_ids"],
                    batch["topk_logprobs"],
                    settings.ce_weight,
                    settings.kl_weight,
                )
                (loss / settings.grad_accum).backward()
            parts["loss"] += loss.item() / settings.grad_accum
            for key, value in loss_parts.items():
                parts[key] += value / settings.grad_accum
        torch.nn.utils.clip_grad_norm_(trainable, settings.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % settings.eval_every == 0 or step == total_steps:
            evaluate(step, {**parts, "lr": scheduler.get_last_lr()[0]})
        if options.checkpoint is not None and options.checkpoint_every and step % options.checkpoint_every == 0:
            if distributed.is_main:
                trainable_state = {n: p.detach().cpu().clone() for n, p in named_trainable.items()}
                state = dict(
                    fingerprint=options.fingerprint,
                    trainable=trainable_state,
                    optimizer=optimizer.state_dict(),
                    scheduler=scheduler.state_dict(),
                    history=history,
                    best=best,
                )
                save_checkpoint(options.checkpoint, step, state)
                logger.info("step %d: checkpoint saved to %s", step, options.checkpoint)
    model.eval()
    if distributed.is_main:
        with torch.no_grad():
            parameters = dict(model.named_parameters())
            for name, value in best["state"].items():
                parameters[name].copy_(value.to(parameters[name].device))
        logger.info("selected step %d with holdout tau %.4f", best["step"], best["tau"])
    return {
        "history": history,
        "selected_step": best["step"],
        "selected_holdout_tau": best["tau"],
        "total_steps": total_steps,
    }


def micro_batch_stream(examples: list[dict], settings: TrainSettings, distributed: Distributed):
    """Endless micro-batches: each epoch a fresh seeded shuffle, this rank's share of it, in chunks."""
    if len(examples) < distributed.world_size:
        raise common.UserError(f"{len(examples)} training examples cannot be shared by {distributed.world_size} ranks")
    shuffler = random.Random(settings.seed)
    epoch_examples = list(examples)
    while True:
        shuffler.shuffle(epoch_examples)
        mine = epoch_examples[distributed.rank :: distributed.world_size]
        if len(mine) < settings.batch_size:
            yield mine
        else:
            yield from epoch_batches(mine, settings.batch_size, settings.length_groups, shuffler)


def epoch_batches(examples: list[dict], batch_size: int, length_groups: int, shuffler: random.Random) -> list[list]:
    """One epoch's full micro-batches of the shuffled `examples`. With length_groups > 1, each window of
    length_groups batches is sorted by example length before it is cut and the batches are shuffled again, so
    a batch holds examples of similar length (less padding) while windows still mix the whole epoch."""
    window = batch_size * length_groups
    batches = []
    for start in range(0, len(examples), window):
        chunk = examples[start : start + window]
        if length_groups > 1:
            chunk = sorted(chunk, key=lambda e: len(e["prompt_ids"]) + len(e["tokens"]))
        batches += [chunk[first : first + batch_size] for first in range(0, len(chunk) - batch_size + 1, batch_size)]
    if length_groups > 1:
        shuffler.shuffle(batches)
    return batches


def add_train_arguments(parser: argparse.ArgumentParser, defaults: TrainSettings) -> None:
    """The TrainSettings fields as flags (shared with lora_after_gptq.py)."""
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            kind = int if name in ("max_steps", "last_shard") else type(value)
            parser.add_argument(flag, type=kind, default=value)


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    settings = TrainSettings(**{name: getattr(args, name) for name in asdict(TrainSettings())})
    for name in ("k", "batch_size", "grad_accum", "eval_every", "eval_batch_size", "length_groups"):
        if getattr(settings, name) < 1:
            raise common.UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(settings, name)}")
    if settings.first_shard < 0 or (settings.last_shard is not None and settings.last_shard < settings.first_shard):
        raise common.UserError(
            f"--first-shard must be 0 or more and --last-shard at least --first-shard, got {settings.first_shard} "
            f"and {settings.last_shard}"
        )
    if settings.lr <= 0 or settings.epochs <= 0:
        raise common.UserError(f"--lr and --epochs must be positive, got {settings.lr} and {settings.epochs}")
    return settings


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="base model: local directory or hub id")
    parser.add_argument("--base-revision", default=None, help="hub commit (required for a hub id)")
    parser.add_argument("--data", type=Path, required=True, help="gen_data.py output directory")
    parser.add_argument("--out", type=Path, required=True, help="output model directory")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--teacher", default=None, help="teacher directory: its top-k is computed per batch (for hard-label data)"
    )
    parser.add_argument("--teacher-top-k", type=int, default=20)
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="save a resumable checkpoint every N steps (0: never)"
    )
    add_train_arguments(parser, TrainSettings())
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:

    args = parse_args(argv)
    settings = settings_from_args(args)
    distributed = init_distributed()
    log_name = f"train_drafter.rank{distributed.rank}" if distributed.world_size > 1 else "train_drafter"
    logger = common.setup_logging(common.log_path_beside(args.out, log_name), "train_drafter")
    logger.info("command: python -m evidence.train.train_drafter %s", " ".join(sys.argv[1:] if argv is None else argv))
    base, revision = common.resolve_model(args.base, args.base_revision)
    torch.manual_seed(settings.seed)
    train_examples, holdout_examples = load_split(args.data, settings.first_shard, settings.last_shard)
    device = (
        f"cuda:{distributed.local_rank}"
        if torch.cuda.is_available() and not args.device
        else common.pick_device(args.device)
    )
    model = AutoModelForCausalLM.from_pretrained(base, revision=revision, dtype=torch.float32).to(device)
    check_vocabulary(model, train_examples + holdout_examples)
    logger.info("%d train / %d holdout examples; %s", len(train_examples), len(holdout_examples), settings)
    options = train_options(args, settings, train_examples, holdout_examples, device)
    result = train(model, train_examples, holdout_examples, settings, logger, distributed, options)
    report = {
        "base": args.base,
        "base_revision": revision,
        "settings": asdict(settings),
        **result,
        "train_examples": len(train_examples),
        "holdout_examples": len(holdout_examples),
    }
    if distributed.is_main:
        with common.atomic_directory(args.out) as staging:
            model.save_pretrained(staging, safe_serialization=True)
        common.atomic_write_json(common.log_path_beside(args.out, "train_drafter").with_suffix(".json"), report)
    if distributed.world_size > 1:
        dist.destroy_process_group()
    return report


def train_options(
    args: argparse.Namespace, settings: TrainSettings, train_examples: list[dict], holdout_examples: list[dict], device
) -> TrainOptions:
    if args.checkpoint_every < 0 or args.teacher_top_k < 1:
        raise common.UserError(
            f"--checkpoint-every must be 0 or more and --teacher-top-k at least 1; got {args.checkpoint_every}, "
            f"{args.teacher_top_k}"
        )
    teacher = None
    if args.teacher is not None:
        teacher_dir, _ = common.resolve_model(args.teacher, None)
        teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).to(device).eval()
    identity = {
        "base": args.base,
        "settings": asdict(settings),
        "teacher": args.teacher,
        "teacher_top_k": args.teacher_top_k,
        "train_ids": [e["id"] for e in train_examples],
        "holdout_ids": [e["id"] for e in holdout_examples],
    }
    return TrainOptions(
        checkpoint=common.log_path_beside(args.out, "train_drafter").with_suffix(".checkpoint.pt"),
        checkpoint_every=args.checkpoint_every,
        fingerprint=hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest(),
        teacher=teacher,
        teacher_top_k=args.teacher_top_k,
    )


def check_vocabulary(model: torch.nn.Module, examples: list[dict]) -> None:
    """The student must score every token id the teacher produced."""
    vocab = model.get_output_embeddings().weight.shape[0]
    largest = max(int(torch.cat([e["tokens"], e["topk_ids"].flatten(), e["prompt_ids"]]).max()) for e in examples)
    if largest >= vocab:
        raise common.UserError(
            f"the data holds token id {largest} but the student's vocabulary has {vocab} entries; teacher and base must share a tokenizer"
        )


if __name__ == "__main__":
    common.run_cli(main)
