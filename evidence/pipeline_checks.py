"""Offline checks of a pipeline config against the shape of its base model: what `run_pipeline.py --plan`
verifies before anything is downloaded or computed (group sizes, INT4 kernel eligibility, LoRA targets,
declared datasets, the tensor inventory architecture.json declares).

The shape comes from a local base directory's config.json, or, for a hub base, from the section of
architecture.json that declares that base (its "model" fields): nothing is fetched.
Not a script: imported by run_pipeline.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

import int4
from evidence import common
from evidence.inventory import PROJECTIONS, compact, package_inventory
from evidence.quantize.make_random_package import projection_shapes


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fatal: bool = True  # a failed non-fatal check is a warning (e.g. a layer the INT4 kernel cannot take)


def declared_section(architecture: dict, base_repo: str | None) -> dict | None:
    """The section of an architecture record whose base model is `base_repo` (e.g. "full_scale")."""
    for section in architecture.values():
        if isinstance(section, dict) and (section.get("base_model") or {}).get("repo") == base_repo:
            return section
    return None


def base_shape(config: dict, base_dir: Path | None, architecture: dict) -> tuple[dict, str]:
    """The base model's HF config fields and where they came from."""
    if base_dir is not None:
        return common.read_json(base_dir / "config.json", "base model config"), f"{base_dir}/config.json"
    repo = (config.get("base") or {}).get("repo")
    section = declared_section(architecture, repo)
    if section is None or "model" not in section:
        raise common.UserError(
            f"no shape for the base model {repo!r} offline: give --base DIR or declare it in the architecture record"
        )
    return section["model"], f"architecture record (base {repo})"


def quantization_checks(shape: dict, gptq: dict) -> list[Check]:
    group = gptq.get("group_size", 128)
    shapes = projection_shapes(shape)  # (out, in) features
    bad_in = sorted({i for _, i in shapes.values() if i % group})
    bad_out = sorted({o for o, _ in shapes.values() if o % 16})
    reorders = gptq.get("act_order") and not gptq.get("static_groups")
    checks = [
        Check(
            "group size divides every projection's inputs",
            not bad_in,
            f"group {group}; inputs {sorted({i for _, i in shapes.values()})}",
        ),
        Check(
            "outputs pack into int32 qzeros and the kernel's blocks",
            not bad_out,
            f"outputs not a multiple of 16: {bad_out}" if bad_out else "all multiples of 16",
        ),
        Check(
            "layers can use the packed INT4 kernel",
            group in int4.INT4_KERNEL_GROUP_SIZES and not reorders,
            f"group {group} (kernel takes {int4.INT4_KERNEL_GROUP_SIZES}); act-order {'reorders g_idx: dense fallback' if reorders else 'keeps g_idx = k // G'}",
            fatal=False,
        ),
    ]
    embedding = gptq.get("embedding_group_size")
    if embedding:
        tied, hidden, vocab = shape.get("tie_word_embeddings", False), shape["hidden_size"], shape["vocab_size"]
        checks.append(
            Check(
                "INT4 embedding table",
                bool(tied) and hidden % embedding == 0,
                f"group {embedding} of hidden {hidden}, tied {tied}, vocab {vocab} (kernel rows need vocab % 64 == 0: {vocab % 64 == 0})",
            )
        )
    return checks


def lora_checks(shape: dict, lora: dict) -> list[Check]:
    targets = lora.get("target_modules", list(PROJECTIONS))
    unknown = sorted(set(targets) - set(PROJECTIONS))
    rank = lora.get("rank", 16)
    smallest = min(min(pair) for pair in projection_shapes(shape).values())
    return [
        Check(
            "LoRA targets are projections",
            not unknown,
            f"targets {targets}" + (f"; unknown {unknown}" if unknown else ""),
        ),
        Check(
            "LoRA rank below every projection's size",
            1 <= rank < smallest,
            f"rank {rank}, smallest dimension {smallest}",
        ),
    ]


def dataset_checks(config: dict, manifest_path: Path) -> tuple[list[Check], list[str]]:
    """Every prompt source declared as a train split; the names of entries still to lock."""
    manifest = common.load_manifest(manifest_path)
    checks, unlocked = [], []
    names = list(config["prompts"]["sources"]) + ([config["aya"]["source"]] if config.get("aya") else [])
    for name in names:
        try:
            entry = common.dataset_entry(manifest, name)
            common.check_train_split(name, entry)
        except common.UserError as error:
            checks.append(Check(f"dataset {name}", False, str(error)))
            continue
        checks.append(
            Check(f"dataset {name}", True, f"{entry.get('repo') or entry.get('artifact')} split {entry.get('split')}")
        )
        if entry.get("kind") == "hub_dataset" and not entry.get("locked"):
            unlocked.append(f"dataset {name} ({entry['repo']})")
    return checks, unlocked


def labels_check(labels: str) -> Check:
    """Committed teacher labels (a path under the repository root) as their index.json records them."""
    try:
        index = check_labels(common.REPO_ROOT / labels)
    except common.UserError as error:
        return Check(f"teacher labels {labels}", False, str(error))
    detail = f"{index.get('train_rows')} train / {index.get('holdout_rows')} holdout prompts, {index.get('continuation_tokens')} tokens"
    return Check(f"teacher labels {labels}", True, f"{detail}, every shard's sha256 as recorded")


def inventory_check(shape: dict, config: dict, declared: dict | None) -> Check:
    """The package these settings make at this shape, against the inventory the record declares."""
    gptq, lora = config["gptq"], config["lora"]
    made = compact(
        package_inventory(
            shape,
            gptq.get("group_size", 128),
            getattr(torch, gptq.get("store_dtype", "bfloat16")),
            gptq.get("embedding_group_size"),
            lora.get("rank", 16),
            tuple(lora.get("target_modules", PROJECTIONS)),
            getattr(torch, lora.get("store_dtype", "bfloat16")),
        )
    )
    summary = ", ".join(f"{file}: {spec['tensors']} tensors, {spec['bytes']:,} bytes" for file, spec in made.items())
    if declared is None:
        return Check("package inventory", True, f"{summary} (no declaration to compare)", fatal=False)
    return Check("package inventory equals the declared one", made == declared, summary)


def check_config(
    config: dict, shape: dict, manifest_path: Path, declared_inventory: dict | None
) -> tuple[list[Check], list[str]]:
    """All checks, and what is still unlocked (models and datasets), for the plan."""
    checks = [Check("k", isinstance(config["k"], int) and config["k"] >= 1, f"k = {config['k']}")]
    fraction = config["gen_data"].get("holdout_fraction", 0.01)
    checks.append(Check("holdout fraction", 0 < fraction < 1, f"{fraction}"))
    checks += quantization_checks(shape, config["gptq"])
    checks += lora_checks(shape, config["lora"])
    data_checks, unlocked = (
        ([labels_check(config["labels"])], []) if config.get("labels") else dataset_checks(config, manifest_path)
    )
    checks += data_checks
    checks.append(inventory_check(shape, config, declared_inventory))
    for role in ("teacher", "base", "tokenizer"):
        spec = config.get(role) or {}
        if spec.get("repo") and not common.COMMIT_HASH.match(str(spec.get("revision"))):
            unlocked.append(f"{role} {spec['repo']} (revision {spec.get('revision')})")
    return checks, unlocked


def prompt_token_ids(prompts: Path) -> set[tuple[int, ...]]:
    return {tuple(row["token_ids"]) for row in common.read_jsonl(prompts)}


def check_disjoint(train: set[tuple[int, ...]], eval_prompts: Path) -> None:
    """Never train on what is measured: no measurement prompt may also be a training prompt."""
    shared = [row["id"] for row in common.read_jsonl(eval_prompts) if tuple(row["token_ids"]) in train]
    if shared:
        raise common.UserError(
            f"{len(shared)} measurement prompt(s) are also training prompts (first: {shared[0]}); remove them from one side"
        )


def check_labels(labels: Path) -> dict:
    """Committed teacher labels as their index.json records them: every finished shard present, same sha256."""
    index = common.read_json(labels / "index.json", "teacher labels index")
    for name, digest in index.get("shard_sha256", {}).items():
        if not (labels / name).is_file() or common.sha256_file(labels / name) != digest:
            raise common.UserError(f"{labels / name} is missing or differs from index.json; restore it (git checkout)")
    return index
