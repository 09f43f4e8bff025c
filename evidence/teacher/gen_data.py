"""Teacher data: the target's greedy continuation of every prompt with its top-k logprobs at every step.

Reads `prompts.jsonl` (prepare_prompts.py / add_aya.py: id, source, messages, token_ids) and the teacher
model (a Hugging Face directory, or a hub id with --teacher-revision). Writes DATA_DIR/shard-NNNNN.safetensors,
each holding `--shard-size` prompts in file order:

    prompt_ids int32 [sum P]      prompt_lengths int32 [R]     the prompts' token ids, concatenated
    tokens int32 [sum N]          token_lengths int32 [R]      the greedy continuations (EOS included)
    topk_ids int32 [sum N, K]     topk_logprobs float32 [sum N, K]   the teacher's top-K at each position
    holdout uint8 [R]             1 for holdout rows: the row's "split" field when the prompts have one
                                  (prepare_sharegpt.py splits by conversation), else sha256 of the id < fraction
    metadata: "ids" (JSON list of prompt ids), "settings" (JSON of everything that determines the shard)
    (--holdout-fraction 1 makes a measurement-only set, e.g. MT-bench)

With --top-k 0 a shard holds hard labels only (no topk tensors; load_examples gives each position its
greedy token with log-probability 0, so distillation is cross-entropy on the teacher's tokens) and its ids
are uint16 when the teacher's vocabulary fits: about 1 KB per prompt, small enough to commit (--out
evidence/data/...). Plus DATA_DIR/index.json (counts, and the sha256 of every shard and of the prompts
file: the manifest a fresh clone checks) and the log DATA_DIR.gen_data.log. Each shard is written under a
temporary name and renamed when complete, so a killed run leaves no partial shard; a rerun skips every
shard whose settings match and refuses one made with different settings. Greedy decoding with a fixed
batch composition makes the output deterministic on a given machine.

    python -m evidence.teacher.gen_data --prompts WORK/prompts.jsonl --teacher Qwen/Qwen3-8B \
        --teacher-revision COMMIT --out WORK/data --max-new-tokens 512 --backend vllm
    python -m evidence.teacher.gen_data --prompts WORK/sharegpt.jsonl --teacher SMALL/teacher --top-k 0 \
        --dtype bfloat16 --threads 1 --batch-size 64 --shard-size 256 --max-new-tokens 128 \
        --out evidence/data/sharegpt_labels              # one process per core: --workers N --worker I

A CPU worker should run one thread (--threads 1): the teacher's matmuls are too small to share cores well.

Backends: `transformers` (always; batched, left-padded, KV-cached) and `vllm` (when vLLM is installed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, GenerationConfig

from evidence import common

try:  # optional: the fast backend for full-scale runs on GPU
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
except ImportError:
    vllm = SamplingParams = TokensPrompt = None

SHARD_PATTERN = "shard-*.safetensors"


def shard_path(out_dir: Path, index: int) -> Path:
    return out_dir / f"shard-{index:05d}.safetensors"


def holdout_flag(row: dict, fraction: float) -> bool:
    if "split" in row:
        return row["split"] == "holdout"
    return common.stable_hash_fraction(row["id"]) < fraction


# ---------------------------------------------------------------------------------------------------
# Backends: both return, per prompt, (continuation [n], topk_ids [n, K], topk_logprobs [n, K]).


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] left-padded with `pad_id` and the attention mask [B, T] (1 = real token)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


@torch.no_grad()
def generate_transformers(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, top_k: int, eos_ids: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Greedy decoding of one batch with a KV cache, keeping the top-k log-probabilities of each step."""

    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(prompts, pad_id=0)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]: pads share position 0, masked anyway
    cache = DynamicCache(config=model.config)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache, use_cache=True
    ).logits[:, -1]
    eos = torch.tensor(eos_ids, device=device)
    batch = len(prompts)
    tokens = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
    topk_ids = torch.zeros((batch, max_new_tokens, top_k), dtype=torch.long, device=device)  # K = 0: empty
    topk_logprobs = torch.zeros((batch, max_new_tokens, top_k), dtype=torch.float32, device=device)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    next_position = positions[:, -1] + 1  # [B]
    for step in range(max_new_tokens):
        next_token = logits.argmax(-1)  # greedy: the first maximal id, as the drafter and verifier use
        if top_k:
            logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
            topk_logprobs[:, step], topk_ids[:, step] = logprobs.topk(top_k, dim=-1)
        tokens[:, step] = next_token
        newly_finished = ~finished & torch.isin(next_token, eos)
        lengths[newly_finished] = step + 1
        finished |= newly_finished
        if bool(finished.all()) or step + 1 == max_new_tokens:
            break
        attention_mask = torch.cat(
            [attention_mask, torch.ones((batch, 1), dtype=attention_mask.dtype, device=device)], dim=1
        )
        logits = model(
            input_ids=next_token[:, None],
            attention_mask=attention_mask,
            position_ids=next_position[:, None],
            cache=cache,
            use_cache=True,
        ).logits[:, -1]
        next_position = next_position + 1
    return [
        (tokens[r, : lengths[r]].cpu(), topk_ids[r, : lengths[r]].cpu(), topk_logprobs[r, : lengths[r]].cpu())
        for r in range(batch)
    ]


def generate_vllm(
    engine, prompts: list[list[int]], max_new_tokens: int, top_k: int, eos_ids: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Greedy decoding with vLLM; each step's logprobs dict is sorted by logprob and cut to the top k
    (vLLM adds the sampled token when it falls outside the top k; greedy never does)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, logprobs=top_k, stop_token_ids=eos_ids)
    outputs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        step_ids, step_logprobs = [], []
        for position in completion.logprobs:
            best = sorted(position.items(), key=lambda item: -item[1].logprob)[:top_k]
            step_ids.append([token for token, _ in best])
            step_logprobs.append([entry.logprob for _, entry in best])
        results.append(
            (
                torch.tensor(completion.token_ids),
                torch.tensor(step_ids),
                torch.tensor(step_logprobs, dtype=torch.float32),
            )
        )
    return results


# ---------------------------------------------------------------------------------------------------
# Shards


def write_shard(path: Path, rows: list[dict], generations: list[tuple], settings: dict) -> None:
    """One shard, written under a temporary name and renamed when complete. Hard-label shards (top_k 0)
    store their ids as uint16 when every id fits."""
    prompt_ids = torch.tensor([t for row in rows for t in row["token_ids"]], dtype=torch.int64)
    tokens = torch.cat([g[0] for g in generations]).long()
    hard_labels = settings["top_k"] == 0
    fits_uint16 = max(int(prompt_ids.max()), int(tokens.max()) if len(tokens) else 0) < 1 << 16
    id_dtype = torch.uint16 if hard_labels and fits_uint16 else torch.int32
    tensors = {
        "prompt_ids": prompt_ids.to(id_dtype),
        "prompt_lengths": torch.tensor([len(row["token_ids"]) for row in rows], dtype=torch.int32),
        "tokens": tokens.to(id_dtype),
        "token_lengths": torch.tensor([len(g[0]) for g in generations], dtype=torch.int32),
        "holdout": torch.tensor([holdout_flag(row, settings["holdout_fraction"]) for row in rows], dtype=torch.uint8),
    }
    if not hard_labels:
        tensors["topk_ids"] = torch.cat([g[1] for g in generations]).to(torch.int32)
        tensors["topk_logprobs"] = torch.cat([g[2] for g in generations]).to(torch.float32)
    metadata = {"ids": json.dumps([row["id"] for row in rows]), "settings": json.dumps(settings, sort_keys=True)}
    with common.atomic_path(path) as temporary:
        save_file(tensors, str(temporary), metadata=metadata)


def shard_settings(run_settings: dict, rows: list[dict]) -> dict:
    """What determines a shard: the run's settings and the exact prompts it holds."""
    digest = hashlib.sha256(json.dumps([[row["id"], row["token_ids"]] for row in rows]).encode()).hexdigest()
    return {**run_settings, "prompts_sha256": digest}


def read_shard_settings(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as shard:
        return json.loads(shard.metadata()["settings"])


def shard_number(path: Path) -> int:
    """N of a shard-NNNNN.safetensors name."""
    match = re.fullmatch(r"shard-(\d+)", path.stem)
    if match is None:
        raise common.UserError(f"{path} is not named shard-NNNNN.safetensors; move it out of the labels directory")
    return int(match.group(1))


def load_examples(
    data_dir: Path, split: str = "all", first_shard: int = 0, last_shard: int | None = None
) -> list[dict]:
    """Every example of split ('train', 'holdout' or 'all') in the shards of `data_dir` numbered
    `first_shard` through `last_shard` (None: the last there is), as dicts with id, prompt_ids [P],
    tokens [n], topk_ids [n, K], topk_logprobs [n, K], holdout."""
    paths = sorted(Path(data_dir).glob(SHARD_PATTERN))
    if not paths:
        raise common.UserError(f"{data_dir} holds no {SHARD_PATTERN} files; run gen_data.py first")
    last = float("inf") if last_shard is None else last_shard
    paths = [path for path in paths if first_shard <= shard_number(path) <= last]
    if not paths:
        raise common.UserError(
            f"{data_dir} holds no shard numbered {first_shard} to {'the end' if last_shard is None else last_shard}; "
            "check --first-shard and --last-shard"
        )
    examples = []
    for path in paths:
        with safe_open(str(path), framework="pt") as shard:
            ids = json.loads(shard.metadata()["ids"])
            tensors = {key: shard.get_tensor(key) for key in shard.keys()}
        # kept as stored (int32 ids): at full scale the top-k tensors are most of the memory
        prompts = tensors["prompt_ids"].to(torch.int32).split(tensors["prompt_lengths"].tolist())
        lengths = tensors["token_lengths"].tolist()
        tokens = tensors["tokens"].to(torch.int32).split(lengths)  # uint16 in hard-label shards
        if "topk_ids" in tensors:
            topk_ids = tensors["topk_ids"].split(lengths)
            topk_logprobs = tensors["topk_logprobs"].split(lengths)
        else:  # hard labels: the greedy token is the teacher's top 1, with all the (renormalised) mass
            topk_ids = [t.to(torch.int32)[:, None] for t in tokens]
            topk_logprobs = [torch.zeros((len(t), 1)) for t in tokens]
        for row, prompt_id in enumerate(ids):
            examples.append(
                dict(
                    id=prompt_id,
                    prompt_ids=prompts[row],
                    tokens=tokens[row],
                    topk_ids=topk_ids[row],
                    topk_logprobs=topk_logprobs[row],
                    holdout=bool(tensors["holdout"][row]),
                )
            )
    if split == "all":
        return examples
    chosen = [e for e in examples if e["holdout"] == (split == "holdout")]
    if not chosen:
        raise common.UserError(
            f"{data_dir} has no {split} examples ({len(examples)} in all); change --holdout-fraction"
        )
    return chosen


def load_split(data_dir: Path, first_shard: int = 0, last_shard: int | None = None) -> tuple[list[dict], list[dict]]:
    """(train, holdout): the train examples of shards first_shard..last_shard, and the holdout of every
    shard through last_shard, so holdout tau compares across runs that trained on different ranges."""
    train = load_examples(data_dir, "train", first_shard, last_shard)
    return train, load_examples(data_dir, "holdout", last_shard=last_shard)


def collate(examples: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A right-padded batch of prompt + continuation, with the flat indices of the positions that predict
    each continuation token (position p predicts token p + 1) and their targets."""
    sequences = [torch.cat([e["prompt_ids"].long(), e["tokens"].long()]) for e in examples]
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    row_index, position_index = [], []
    for row, (sequence, example) in enumerate(zip(sequences, examples)):
        input_ids[row, : len(sequence)] = sequence
        attention_mask[row, : len(sequence)] = 1
        first = len(example["prompt_ids"]) - 1  # the last prompt position predicts the first new token
        positions = torch.arange(first, first + len(example["tokens"]))
        row_index.append(torch.full_like(positions, row))
        position_index.append(positions)
    return {
        "input_ids": input_ids,  # [B, T]
        "attention_mask": attention_mask,  # [B, T]
        "row_index": torch.cat(row_index),  # [N]
        "position_index": torch.cat(position_index),  # [N]
        "targets": torch.cat([e["tokens"].long() for e in examples]),  # [N]
        "topk_ids": torch.cat([e["topk_ids"].long() for e in examples]),  # [N, K]
        "topk_logprobs": torch.cat([e["topk_logprobs"].float() for e in examples]),  # [N, K]
    }


# ---------------------------------------------------------------------------------------------------


def eos_token_ids(teacher: str, revision: str | None, override: list[int] | None) -> list[int]:
    if override:
        return override
    try:
        eos = GenerationConfig.from_pretrained(teacher, revision=revision).eos_token_id
    except OSError:
        eos = AutoConfig.from_pretrained(teacher, revision=revision).eos_token_id
    if eos is None:
        raise common.UserError(f"teacher {teacher} declares no eos_token_id; give --eos-token-ids")
    return [eos] if isinstance(eos, int) else list(eos)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, required=True, help="prompts.jsonl from prepare_prompts.py")
    parser.add_argument("--teacher", required=True, help="teacher model: local directory or hub id")
    parser.add_argument("--teacher-revision", default=None, help="hub commit (required for a hub id)")
    parser.add_argument("--out", type=Path, required=True, help="output directory of shards")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument(
        "--top-k", type=int, default=20, help="teacher logprobs kept per position; 0: hard labels only (uint16 ids)"
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--shard-size", type=int, default=1024, help="prompts per shard")
    parser.add_argument(
        "--holdout-fraction",
        type=float,
        default=0.02,
        help="share of prompt ids held out (by hash); 1 for a measurement-only set",
    )
    parser.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument(
        "--eos-token-ids", type=int, nargs="*", default=None, help="default: the teacher's generation config"
    )
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="default: bf16 on GPU, fp32 on CPU"
    )
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts (smoke runs)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of this process (CPU workers: 1)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes sharing the shards")
    parser.add_argument("--worker", type=int, default=0, help="this worker's number: it makes shards i %% N == I")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if args.top_k < 0:
        raise common.UserError(f"--top-k must be 0 (hard labels) or more, got {args.top_k}")
    if not 0 <= args.worker < args.workers:
        raise common.UserError(
            f"--worker must be in 0..{args.workers - 1} (--workers {args.workers}), got {args.worker}"
        )
    if args.threads is not None and args.threads < 1:
        raise common.UserError(f"--threads must be at least 1, got {args.threads}")
    for flag in ("max_new_tokens", "batch_size", "shard_size"):
        if getattr(args, flag) < 1:
            raise common.UserError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if not 0.0 <= args.holdout_fraction <= 1.0:
        raise common.UserError(f"--holdout-fraction must be in [0, 1], got {args.holdout_fraction}")
    if args.backend == "vllm" and vllm is None:
        raise common.UserError(
            "--backend vllm needs the vllm package, which is not installed; use --backend transformers"
        )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    check_args(args)
    logger = common.setup_logging(common.log_path_beside(args.out, "gen_data"), "gen_data")
    logger.info("command: python -m evidence.teacher.gen_data %s", " ".join(sys.argv[1:] if argv is None else argv))
    teacher, revision = common.resolve_model(args.teacher, args.teacher_revision)
    rows = common.read_jsonl(args.prompts)[: args.limit]
    if not rows:
        raise common.UserError(f"{args.prompts} holds no prompts")
    for row in rows:
        if not {"id", "token_ids"} <= row.keys():
            raise common.UserError(f"{args.prompts}: row {row.get('id', '?')} lacks 'id' or 'token_ids'")
    device = common.pick_device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    eos_ids = eos_token_ids(teacher, revision, args.eos_token_ids)
    if args.threads:
        torch.set_num_threads(args.threads)
    run_settings = dict(
        teacher=teacher_identity(args.teacher, revision),
        teacher_revision=revision,
        backend=args.backend,
        dtype=dtype_name,
        max_new_tokens=args.max_new_tokens,
        top_k=args.top_k,
        eos_token_ids=eos_ids,
        holdout_fraction=args.holdout_fraction,
        batch_size=args.batch_size,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stale = common.remove_stale_temporaries(args.out)
    if stale:
        logger.info("removed %d unfinished shard file(s) of an interrupted run", stale)
    shards = [rows[i : i + args.shard_size] for i in range(0, len(rows), args.shard_size)]
    index_path = args.out / "index.json"
    recorded = json.loads(index_path.read_text()).get("shard_sha256", {}) if index_path.is_file() else {}
    todo = []
    for index, shard_rows in enumerate(shards):
        if index % args.workers != args.worker:
            continue
        path, settings = shard_path(args.out, index), shard_settings(run_settings, shard_rows)
        if path.exists():
            check_recorded_sha256(path, recorded)
            if read_shard_settings(path) != settings:
                raise common.UserError(
                    f"{path} was made with other settings or prompts; use a new --out directory or delete it"
                )
            logger.info("shard %d already complete, skipped", index)
            continue
        todo.append((index, shard_rows, settings))
    if todo:
        generate = load_backend(args, teacher, revision, device, dtype_name, eos_ids)
        progress = tqdm(total=sum(len(r) for _, r, _ in todo), desc="teacher continuations", unit="prompt")
        for index, shard_rows, settings in todo:
            started = time.perf_counter()
            generations = generate_shard(generate, shard_rows, args.batch_size, progress)
            write_shard(shard_path(args.out, index), shard_rows, generations, settings)
            new_tokens = sum(len(g[0]) for g in generations)
            logger.info(
                "shard %d written: %d prompts, %d tokens, %.1f tokens/s; %s",
                index,
                len(shard_rows),
                new_tokens,
                new_tokens / (time.perf_counter() - started),
                progress,
            )
            write_index(args.out, len(shards), args.prompts)  # after every shard: commit-ready at any time
        progress.close()
    index = write_index(args.out, len(shards), args.prompts)
    logger.info("data: %s", json.dumps(index))
    return index


def load_backend(
    args: argparse.Namespace, teacher: str, revision: str | None, device: str, dtype_name: str, eos_ids: list[int]
):
    """A function prompts -> generations for the chosen backend, with the teacher loaded once."""
    if args.backend == "vllm":
        engine = vllm.LLM(model=teacher, revision=revision, dtype=dtype_name, seed=0)
        return lambda prompts: generate_vllm(engine, prompts, args.max_new_tokens, args.top_k, eos_ids)

    model = (
        AutoModelForCausalLM.from_pretrained(teacher, revision=revision, dtype=getattr(torch, dtype_name))
        .to(device)
        .eval()
    )
    return lambda prompts: generate_transformers(model, prompts, args.max_new_tokens, args.top_k, eos_ids)


def generate_shard(generate, rows: list[dict], batch_size: int, progress: tqdm) -> list[tuple]:
    """Generations in row order; batches group prompts of similar length so little compute goes to padding."""
    order = sorted(range(len(rows)), key=lambda r: (len(rows[r]["token_ids"]), r))
    generations: list[tuple | None] = [None] * len(rows)
    for first in range(0, len(order), batch_size):
        batch = order[first : first + batch_size]
        for row, generation in zip(batch, generate([rows[r]["token_ids"] for r in batch])):
            generations[row] = generation
        progress.update(len(batch))
    return generations


def check_recorded_sha256(path: Path, recorded: dict[str, str]) -> None:
    """A finished shard that index.json lists must have the recorded sha256 (a damaged copy is not resumed)."""
    if path.name in recorded and common.sha256_file(path) != recorded[path.name]:
        raise common.UserError(
            f"{path} has another sha256 than {path.parent / 'index.json'} records; restore it (git checkout) or delete it"
        )


def teacher_identity(teacher: str, revision: str | None) -> str:
    """The teacher as shard settings record it: the hub id at its commit, or the sha256 of a local directory's
    weights (not its path, so shards made on one machine are recognised on another)."""
    if revision is not None:
        return teacher
    digest = hashlib.sha256()
    for path in sorted(Path(teacher).glob("*.safetensors")):
        digest.update(common.sha256_file(path).encode())
    return f"weights-sha256:{digest.hexdigest()}"


def write_index(out_dir: Path, shard_count: int, prompts: Path) -> dict:
    """index.json: counts, and the sha256 of the prompts file and of every finished shard (the manifest
    against which a copy of the shards, e.g. a committed one, is checked)."""
    examples = load_examples(out_dir, "all")
    holdout = [e for e in examples if e["holdout"]]
    finished = sorted(out_dir.glob(SHARD_PATTERN))
    index = {
        "shards": shard_count,
        "finished_shards": len(finished),
        "prompts_sha256": common.sha256_file(prompts),
        "rows": len(examples),
        "holdout_rows": len(holdout),
        "train_rows": len(examples) - len(holdout),
        "continuation_tokens": sum(len(e["tokens"]) for e in examples),
        "holdout_tokens": sum(len(e["tokens"]) for e in holdout),
        "shard_sha256": {path.name: common.sha256_file(path) for path in finished},
    }
    common.atomic_write_json(out_dir / "index.json", index)
    return index


if __name__ == "__main__":
    common.run_cli(main)
