"""The whole evidence chain from one config file: prompts -> teacher data -> distillation -> GPTQ INT4
-> LoRA -> model package, plus the architecture record of what was made and measured.

Stages (each one an evidence script, called with the flags the config gives; its exact command line is
recorded): prompts (prepare_prompts.py), aya (add_aya.py, when the config has an "aya" section), magpie
(magpie_prompts.py: prompts the teacher writes itself, when the config has a "magpie" section), data
(gen_data.py), distill (train_drafter.py; under torchrun when train.nproc_per_node > 1), gptq
(gptq_drafter.py), lora (lora_after_gptq.py), eval_data (gen_data.py on --eval-prompts, a measurement-only set
such as MT-bench, when given). Then the package and the tokenizer's files are copied to --out, loaded strictly
with draft_model.load_model, its greedy drafts checked against the Hugging Face model the pipeline measured,
and with --eval-prompts the offline tau of every stage's model is measured on that set. A rerun skips every
stage whose command and outputs are unchanged (WORK/pipeline_state.json); gen_data itself skips finished
shards. --from-stage reruns a stage and everything after it. A config with "labels" (a gen_data output
directory committed in the repository, e.g. evidence/data/sharegpt_labels) starts at distillation on those
labels, checked against their index.json's sha256 first: no prompt or data stage.

Models: a config names hub ids with pinned revisions; a revision that is null is refused unless --lock
is given (then it is resolved on the hub and written into the config). --teacher/--base/--tokenizer
point a role at a local directory instead (tests, offline runs).

Writes: WORK/... (every intermediate, logs beside each output), OUT (the model package), and the
architecture record (--architecture, default WORK/architecture.json): only its own top-level key
"evidence_pipeline" is added or replaced, so the record can live inside the repo's architecture.json.

    python -m evidence.run_pipeline --config evidence/configs/qwen3.json --work WORK --out OUT \
        --cache-dir CACHE [--lock]
    python -m evidence.run_pipeline --config evidence/configs/tiny.json --work WORK --out OUT \
        --mirror MIRROR --manifest MANIFEST --teacher TEACHER_DIR --base BASE_DIR --tokenizer TOKENIZER_DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from huggingface_hub import HfApi, snapshot_download
from transformers import AutoModelForCausalLM

import checkpoint
from evidence import common, packages, pipeline_checks
from evidence.measure import tau
from evidence.prompts import add_aya, magpie_prompts, prepare_prompts
from evidence.quantize import gptq_drafter, lora_after_gptq
from evidence.teacher import gen_data
from evidence.teacher.gen_data import load_examples
from evidence.train import train_drafter

STAGES = ("prompts", "aya", "magpie", "data", "distill", "gptq", "lora", "eval_data")
SCRIPTS = {  # the evidence script behind each stage, run in this process (or under a launcher by name)
    module.__name__.rpartition(".")[2]: module
    for module in (prepare_prompts, add_aya, magpie_prompts, gen_data, train_drafter, gptq_drafter, lora_after_gptq)
}
RECORD_KEY = "evidence_pipeline"  # default key of the record; a dotted key nests it ("full_scale.evidence_pipeline")


def flags(settings: dict, skip: tuple[str, ...] = ()) -> list[str]:
    """{"max_new_tokens": 512, "sym": false, "sources": ["a", "b"]} -> --max-new-tokens 512 --no-sym --sources a b"""
    argv = []
    for key, value in settings.items():
        if key in skip or value is None or key.startswith("_"):
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


UNLOCKED = "UNLOCKED"  # stands for a revision in a plan printed before --lock has pinned it


def model_flags(role: str, spec: dict, override: Path | None, option: str, plan: bool = False) -> list[str]:
    """--teacher X [--teacher-revision R]: a local directory override, or the config's pinned hub id
    (an unpinned one is refused, except in a plan, which shows it as UNLOCKED)."""
    if override is not None:
        if not override.is_dir():
            raise common.UserError(f"--{role} {override} is not a directory")
        return [f"--{option}", str(override)]
    if not spec or not spec.get("repo"):
        raise common.UserError(f"the config names no {role} model; give --{role} DIR or set {role}.repo")
    if plan and not common.COMMIT_HASH.match(str(spec.get("revision"))):
        return [f"--{option}", spec["repo"], f"--{option}-revision", UNLOCKED]
    common.resolve_model(spec["repo"], spec.get("revision"))  # refuses an unpinned hub id
    return [f"--{option}", spec["repo"], f"--{option}-revision", spec["revision"]]


def lock_models(config_path: Path, config: dict, logger, architecture: Path | None = None) -> None:
    """Resolve each hub model's revision (a commit hash) and write it into the config file, and into the
    architecture record's section that declares this base (its base_model / target_model / tokenizer)."""
    for role in ("teacher", "base", "tokenizer"):
        spec = config.get(role) or {}
        if spec.get("repo") and not common.COMMIT_HASH.match(str(spec.get("revision"))):
            try:
                spec["revision"] = HfApi().model_info(spec["repo"], revision=spec.get("revision") or "main").sha
            except Exception as error:
                raise common.UserError(f"cannot resolve {spec['repo']} on the hub to lock it: {error}") from None
            logger.info("locked %s %s at %s", role, spec["repo"], spec["revision"])
    common.atomic_write_json(config_path, {k: v for k, v in config.items() if not k.startswith("_")})
    if architecture is None or not architecture.exists():
        return
    record = common.read_json(architecture, "architecture record")
    section = pipeline_checks.declared_section(record, (config.get("base") or {}).get("repo"))
    for role, key in (("base", "base_model"), ("teacher", "target_model"), ("tokenizer", "tokenizer")):
        spec = config.get(role) or {}
        if section is not None and isinstance(section.get(key), dict) and section[key].get("repo") == spec.get("repo"):
            section[key].update(revision=spec["revision"], locked=True)
    common.atomic_write_json(architecture, record)


@dataclass
class Stage:
    name: str
    module: str  # the evidence script (a key of SCRIPTS)
    argv: list[str]
    inputs: list  # paths, or model names with revisions
    outputs: list[Path]  # the first is where the script writes (its JSON report lies beside it)
    launcher: list[str] | None = None  # e.g. torchrun; default: in this process

    def command(self) -> list[str]:
        return (self.launcher or ["python"]) + ["-m", SCRIPTS[self.module].__name__, *self.argv]  # from the repo root


class Pipeline:
    def __init__(self, args: argparse.Namespace, config: dict, logger):
        self.args, self.config, self.logger = args, config, logger
        self.work = args.work
        self.state_path = self.work / "pipeline_state.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.rerun = args.force
        self.commands: list[str] = []
        self.reports: dict[str, dict] = {}

    def path(self, name: str) -> Path:
        return self.work / name

    def portable(self, argv: list[str], separator: str | None = None) -> str:
        """The command (or, with a separator, the list of paths) with this machine's directories replaced
        by placeholders, for the record and the plan."""
        places = {
            self.work: "WORK",
            self.args.out: "OUT",
            self.args.cache_dir: "CACHE",
            self.args.mirror: "MIRROR",
            self.args.manifest: "MANIFEST",
            self.args.teacher: "TEACHER",
            self.args.base: "BASE",
            self.args.tokenizer: "TOKENIZER",
            self.args.eval_prompts: "EVAL_PROMPTS",
            common.REPO_ROOT: "REPO",
        }
        text = shlex.join(argv) if separator is None else separator.join(argv)
        for place, name in sorted(
            ((str(p), n) for p, n in places.items() if p is not None), key=lambda item: -len(item[0])
        ):
            text = text.replace(place, name)
        return text

    def run_stage(self, stage: Stage) -> dict:
        """Run the stage's script unless the same command already completed with its outputs present."""
        command = stage.command()
        self.commands.append(self.portable(command))
        if self.args.from_stage == stage.name:
            self.rerun = True
        done = self.state.get(stage.name, {})
        if not self.rerun and done.get("argv") == stage.argv and all(p.exists() for p in stage.outputs):
            self.logger.info("stage %s: unchanged, skipped", stage.name)
            self.reports[stage.name] = done["report"]
            return done["report"]
        self.rerun = True  # everything downstream of a rerun stage runs again
        self.logger.info("stage %s: %s", stage.name, shlex.join(command))
        started = time.time()
        if stage.launcher:
            result = subprocess.run(command, cwd=common.REPO_ROOT)
            if result.returncode != 0:
                raise common.UserError(f"stage {stage.name} failed (exit {result.returncode}): {shlex.join(command)}")
            report = json.loads(common.log_path_beside(stage.outputs[0], stage.module).with_suffix(".json").read_text())
        else:
            report = SCRIPTS[stage.module].main(stage.argv)
        self.logger.info("stage %s done in %.1f s", stage.name, time.time() - started)
        self.state[stage.name] = {"argv": stage.argv, "report": report, "seconds": round(time.time() - started, 1)}
        common.atomic_write_json(self.state_path, self.state)
        self.reports[stage.name] = report
        return report

    def model(self, role: str, option: str | None = None) -> list[str]:
        override = getattr(self.args, role)
        return model_flags(role, self.config.get(role), override, option or role, plan=self.args.plan)

    def model_input(self, role: str) -> str:
        """A model as a stage input: the local directory, or repo@revision."""
        override = getattr(self.args, role)
        if override is not None:
            return str(override)
        spec = self.config.get(role) or self.config.get("teacher") or {}
        return f"{spec.get('repo')}@{spec.get('revision') or UNLOCKED}"

    def source_flags(self) -> list[str]:
        argv = ["--manifest", str(self.args.manifest)]
        if self.args.mirror:
            argv += ["--mirror", str(self.args.mirror)]
        if self.args.cache_dir:
            argv += ["--cache-dir", str(self.args.cache_dir)]
        if self.args.lock:
            argv.append("--lock")
        return argv + self.tokenizer_flags()

    def tokenizer_flags(self) -> list[str]:
        tokenizer = self.config.get("tokenizer") or self.config.get("teacher")
        return model_flags("tokenizer", tokenizer, self.args.tokenizer, "tokenizer", plan=self.args.plan)

    def tokenizer_dir(self) -> Path:
        """The local directory of the tokenizer the package ships with (a hub tokenizer's files downloaded)."""
        _, name, *revision = self.tokenizer_flags()  # --tokenizer NAME [--tokenizer-revision REVISION]
        directory = Path(name)
        if revision:
            try:
                directory = Path(
                    snapshot_download(
                        name,
                        revision=revision[1],
                        cache_dir=self.args.cache_dir,
                        allow_patterns=list(packages.TOKENIZER_FILES),
                    )
                )
            except Exception as error:  # offline, a revision the hub lacks, no access: one line, not a traceback
                raise common.UserError(f"tokenizer {name}@{revision[1]}: {type(error).__name__}: {error}") from None
        packages.tokenizer_files(directory)  # refuses a directory without tokenizer.json
        return directory

    def labels(self) -> Path | None:
        """The config's committed teacher labels (a path under the repository root), or None."""
        return common.REPO_ROOT / self.config["labels"] if self.config.get("labels") else None

    def data_dir(self) -> Path:
        return self.labels() or self.path("data")

    def stages(self) -> list[Stage]:
        """Every stage, in order, with its exact command line, inputs and outputs."""
        return ([] if self.labels() else self.data_stages()) + self.model_stages()

    def data_stages(self) -> list[Stage]:
        """prompts, aya, magpie (as configured) and data: the teacher's labels for the distillation."""
        config = self.config
        prompts_cfg, aya_cfg, magpie_cfg = config["prompts"], config.get("aya"), config.get("magpie")
        template = flags({key: prompts_cfg.get(key) for key in ("enable_thinking", "max_prompt_tokens")})
        teacher, teacher_in = self.model("teacher"), self.model_input("teacher")
        steps = ["base"] + ["aya"] * bool(aya_cfg) + ["magpie"] * bool(magpie_cfg)  # each prompt stage extends the last
        written = [self.path(f"prompts_{step}.jsonl") for step in steps[:-1]] + [self.path("prompts.jsonl")]
        manifest = f"{self.args.manifest} ({', '.join(prompts_cfg['sources'])})"
        stages = [
            Stage(
                "prompts",
                "prepare_prompts",
                [*self.source_flags(), *flags(prompts_cfg), "--out", str(written[0])],
                [manifest],
                [written[0]],
            )
        ]
        if aya_cfg:
            aya_argv = ["--prompts", str(written[0]), *self.source_flags(), *template, *flags(aya_cfg)]
            stages.append(Stage("aya", "add_aya", [*aya_argv, "--out", str(written[1])], [written[0]], [written[1]]))
        if magpie_cfg:
            exclude = ["--exclude", str(self.args.eval_prompts)] if self.args.eval_prompts else []
            if magpie_cfg.get("categories"):  # a file named relative to the config that names it
                magpie_cfg = magpie_cfg | {"categories": str(self.args.config.parent / magpie_cfg["categories"])}
            magpie_argv = [
                *["--prompts", str(written[-2]), *exclude, *teacher, *self.tokenizer_flags(), *template],
                *[*flags(magpie_cfg), "--out", str(written[-1])],
            ]
            stages.append(Stage("magpie", "magpie_prompts", magpie_argv, [written[-2], teacher_in], [written[-1]]))
        prompts, data = written[-1], self.path("data")
        data_argv = ["--prompts", str(prompts), *teacher, "--out", str(data), *flags(config["gen_data"])]
        return [*stages, Stage("data", "gen_data", data_argv, [prompts, teacher_in], [data / "index.json"])]

    def model_stages(self) -> list[Stage]:
        """distill, gptq, lora and eval_data, on the data stage's output or the committed labels."""
        config, k = self.config, str(self.config["k"])
        data, teacher, teacher_in = self.data_dir(), self.model("teacher"), self.model_input("teacher")
        student, stages = self.path("student"), []
        train_cfg = dict(config["train"])
        processes = int(train_cfg.pop("nproc_per_node", 1))
        launcher = ["torchrun", f"--nproc_per_node={processes}"] if processes > 1 else None
        train_argv = [*self.model("base"), "--data", str(data), "--out", str(student), "--k", k, *flags(train_cfg)]
        stages.append(
            Stage("distill", "train_drafter", train_argv, [self.model_input("base"), data], [student], launcher)
        )

        package, card = self.path("package"), self.path("model_card_fields.json")
        gptq_argv = [
            *["--student", str(student), "--data", str(data), "--out", str(package), "--k", k],
            *["--name", config["name"], "--card", str(card), *flags(config["gptq"])],
        ]
        stages.append(Stage("gptq", "gptq_drafter", gptq_argv, [student, data], [package]))
        lora_argv = ["--package", str(package), "--data", str(data), "--k", k, *flags(config["lora"])]
        lora_out = package / checkpoint.PACKAGE_LORA_WEIGHTS
        stages.append(Stage("lora", "lora_after_gptq", lora_argv, [package, data], [lora_out]))
        if self.args.eval_prompts:  # last: nothing trained depends on it
            eval_data = self.path("eval_data")
            eval_argv = [
                *["--prompts", str(self.args.eval_prompts), *teacher, "--out", str(eval_data)],
                *flags(config["gen_data"] | {"holdout_fraction": 1.0}),
            ]
            stages.append(
                Stage(
                    "eval_data", "gen_data", eval_argv, [self.args.eval_prompts, teacher_in], [eval_data / "index.json"]
                )
            )
        return stages

    def run(self) -> dict:
        config = self.config
        common.atomic_write_json(
            self.path("model_card_fields.json"),
            {"description": config.get("description", ""), **config.get("model_card", {})},
        )
        self.tokenizer = self.tokenizer_dir()  # the package ships it: a bad one is refused now, not after training
        if self.labels():
            pipeline_checks.check_labels(self.labels())
            if self.args.eval_prompts:  # never train on what is measured
                labelled = {tuple(e["prompt_ids"].tolist()) for e in load_examples(self.labels())}
                pipeline_checks.check_disjoint(labelled, self.args.eval_prompts)
        for stage in self.stages():
            if stage.name == "data" and self.args.eval_prompts:
                pipeline_checks.check_disjoint(
                    pipeline_checks.prompt_token_ids(self.path("prompts.jsonl")), self.args.eval_prompts
                )
            self.run_stage(stage)
        return self.finish(self.path("package"), self.data_dir())

    def plan(self) -> dict:
        """Print every stage (command, inputs, outputs, hardware) and the offline checks; run nothing."""
        hardware = self.config.get("hardware", {})
        stages = self.stages()
        lines = [f"plan: {self.config['name']} ({self.args.config})", ""]
        for number, stage in enumerate(stages, 1):
            lines += [
                f"[{number}/{len(stages) + 1}] {stage.name} ({stage.module}.py)",
                f"  command : {self.portable(stage.command())}",
                f"  inputs  : {self.portable([str(i) for i in stage.inputs], ', ')}",
                f"  outputs : {self.portable([str(o) for o in stage.outputs], ', ')}",
                f"  hardware: {hardware.get(stage.name, 'not stated in the config')}",
            ]
        lines += [
            f"[{len(stages) + 1}/{len(stages) + 1}] package (in run_pipeline)",
            "  command : copy WORK/package and the tokenizer to OUT; draft_model.load_model(OUT) drafts = the measured model's; write the record",
            f"  inputs  : {self.portable([str(self.path('package'))], ', ')}",
            f"  outputs : {self.portable([str(self.args.out), str(self.args.architecture or self.path('architecture.json'))], ', ')}",
            f"  hardware: {hardware.get('package', 'not stated in the config')}",
            "",
        ]
        checks, unlocked = self.plan_checks()
        lines += [f"  {'ok  ' if c.ok else ('FAIL' if c.fatal else 'warn')} {c.name}: {c.detail}" for c in checks]
        lines += [f"  not locked yet (--lock with hub access pins it): {item}" for item in unlocked]
        print("\n".join(lines))
        failed = [c.name for c in checks if c.fatal and not c.ok]
        if failed:
            raise common.UserError(f"the config fails {len(failed)} check(s): {', '.join(failed)}")
        return {"stages": [s.name for s in stages], "checks": [asdict(c) for c in checks], "unlocked": unlocked}

    def plan_checks(self) -> tuple[list, list[str]]:
        record_path = self.args.architecture or common.REPO_ROOT / "architecture.json"
        record = common.read_json(record_path, "architecture record") if record_path.exists() else {}
        shape, source = pipeline_checks.base_shape(self.config, self.args.base, record)
        section = pipeline_checks.declared_section(record, (self.config.get("base") or {}).get("repo"))
        declared = (section or {}).get("package_inventory") if self.args.base is None else None
        checks, unlocked = pipeline_checks.check_config(self.config, shape, self.args.manifest, declared)
        shape_check = pipeline_checks.Check("base shape", True, f"from {self.portable([source], '')}")
        return [shape_check, *checks], unlocked

    def finish(self, package: Path, data: Path) -> dict:
        """Copy package and tokenizer to --out, check it loads strictly and drafts what was measured; record."""
        packages.publish(package, self.tokenizer, self.args.out)
        agreement = tau.package_draft_agreement(self.args.out, data, int(self.config["k"]))
        self.logger.info(
            "package %s: draft_model greedy drafts agree with the measured model on %.4f of tokens",
            self.args.out,
            agreement,
        )
        record = self.record(agreement)
        if self.args.eval_prompts:
            record["eval"] = self.measure_eval_set(package)
        path = self.args.architecture or self.path("architecture.json")
        existing = common.read_json(path, "architecture record") if path.exists() else {}
        common.set_dotted(existing, self.args.record_key, record)
        common.atomic_write_json(path, existing)
        self.logger.info("architecture record: %s", path)
        return record

    def measure_eval_set(self, package: Path) -> dict:
        """Offline tau of every stage's model on the measurement-only set (e.g. MT-bench)."""
        examples = load_examples(self.path("eval_data"), "holdout")
        base = self.config.get("base") or {}
        loaders = {
            "base_model": lambda: AutoModelForCausalLM.from_pretrained(
                self.args.base or base["repo"], revision=None if self.args.base else base["revision"]
            ),
            "distilled": lambda: AutoModelForCausalLM.from_pretrained(self.path("student")),
            "int4": lambda: packages.dequantized_model(package, with_lora=False),
            "int4_lora": lambda: packages.dequantized_model(package, with_lora=True),
        }
        device = common.pick_device(None)
        measured = {}
        for stage, load in loaders.items():
            report = tau.offline_tau(load().to(device).eval(), examples, int(self.config["k"]), progress=False)
            measured[stage] = {"tau": report.tau, "top1_agreement": report.top1_agreement}
            self.logger.info("eval set: %s tau %.4f, top-1 %.4f", stage, report.tau, report.top1_agreement)
        return {
            "prompts": self.portable([str(self.args.eval_prompts)]),
            "sequences": len(examples),
            "tokens": sum(len(e["tokens"]) for e in examples),
            "tau": measured,
        }

    def data_record(self) -> dict:
        """What the student learned from: the prompt and data stages' reports, or the committed labels."""
        reports = self.reports
        if self.labels():
            index = pipeline_checks.check_labels(self.labels())
            return {
                "labels": self.config["labels"],  # as the config names it: a path under the repository root
                **{k: v for k, v in index.items() if k != "shard_sha256"},
            }
        prompt_counts = dict(reports["prompts"]["written"])
        if "aya" in reports:
            prompt_counts["aya"] = reports["aya"]["added"]
        magpie = None
        if "magpie" in reports:
            prompt_counts["magpie"] = reports["magpie"]["added"]
            magpie = reports["magpie"]["settings"] | {
                "teacher": self.portable([reports["magpie"]["settings"]["teacher"]])
            }
        return {
            "prompts_per_source": prompt_counts,
            "enable_thinking": reports["prompts"]["enable_thinking"],
            "teacher_data": reports["data"],
            "magpie": magpie,
            "sources": {**reports["prompts"]["sources"], **reports.get("aya", {}).get("sources", {})},
        }

    def record(self, agreement: float) -> dict:
        reports, config = self.reports, self.config
        distill, gptq, lora = reports["distill"], reports["gptq"], reports["lora"]

        def role(name: str, override: Path | None) -> dict | None:
            """A hub model as configured (repo + revision), or a local directory by name and file checksums."""
            if override is None:
                return config.get(name)
            return {"local_directory": override.name, "files_sha256": common.directory_fingerprint(override)}

        return {
            "name": config["name"],
            "config": config.get("_config_file"),
            "k": config["k"],
            "base_model": role("base", self.args.base),
            "target_model": role("teacher", self.args.teacher),
            "tokenizer": role("tokenizer", self.args.tokenizer) or config.get("teacher"),
            "data": self.data_record(),
            "recipe": {
                "distillation": distill["settings"],
                "quantization": gptq["settings"]
                | {
                    "bits": 4,
                    "store_dtype": gptq["store_dtype"],
                    "calibration_sequences": gptq["calibration_sequences"],
                },
                "lora": lora["lora"] | {"settings": lora["settings"]},
            },
            "holdout_tau": {
                "base_model": distill["history"][0]["holdout_tau"],
                "distilled": distill["selected_holdout_tau"],
                "int4": gptq["int4_holdout"]["tau"],
                "int4_lora": lora["holdout_tau_after"],
            },
            "holdout_top1": {
                "distilled": gptq["student_holdout"]["top1_agreement"],
                "int4": gptq["int4_holdout"]["top1_agreement"],
                "int4_lora": lora["holdout_after"]["top1_agreement"],
            },
            "int4_vs_distilled_top1_agreement": gptq["int4_vs_student_top1_agreement"],
            "package_draft_agreement": agreement,
            "selected_steps": {"distill": distill["selected_step"], "lora": lora["selected_step"]},
            "commands": self.commands,
            "versions": common.package_versions(),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }


def load_config(path: Path) -> dict:
    config = common.read_json(path, "pipeline config")
    required = ("name", "k", "gen_data", "train", "gptq", "lora") + ("prompts",) * ("labels" not in config)
    missing = [key for key in required if key not in config]
    if missing:
        raise common.UserError(f"pipeline config {path} lacks {missing}")
    if not isinstance(config["k"], int) or config["k"] < 1:
        raise common.UserError(f"pipeline config {path}: k must be a positive integer, got {config['k']!r}")
    return config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, help="pipeline config (evidence/configs/*.json)")
    parser.add_argument(
        "--work", type=Path, default=None, help="directory for every intermediate output (required unless --plan)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="model package directory to write (model/ only when asked; required unless --plan)",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print every stage (command, inputs, outputs, hardware) and check the config offline; run nothing",
    )
    parser.add_argument("--manifest", type=Path, default=common.REPO_ROOT / "data_manifest.json")
    parser.add_argument(
        "--mirror", type=Path, default=None, help="local mirror of the hub datasets: MIRROR/<repo>/<path>"
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="download cache (hub files, PyPI/npm artifacts)")
    parser.add_argument(
        "--lock", action="store_true", help="resolve unpinned datasets and models on the hub and record the pins"
    )
    parser.add_argument(
        "--teacher", type=Path, default=None, help="local teacher directory instead of the config's hub id"
    )
    parser.add_argument(
        "--base", type=Path, default=None, help="local base model directory instead of the config's hub id"
    )
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="local tokenizer directory instead of the config's hub id"
    )
    parser.add_argument(
        "--eval-prompts",
        type=Path,
        default=None,
        help="prompts.jsonl measured only (e.g. MT-bench): tau of every stage on it",
    )
    parser.add_argument(
        "--architecture", type=Path, default=None, help="architecture record to update (default WORK/architecture.json)"
    )
    parser.add_argument(
        "--record-key",
        default=RECORD_KEY,
        help="key of the record in --architecture; dots nest it (e.g. shipped_package.evidence_pipeline)",
    )
    parser.add_argument("--from-stage", choices=STAGES, default=None, help="rerun this stage and every later one")
    parser.add_argument("--force", action="store_true", help="rerun every stage")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.plan:
        return plan(args)
    if args.work is None or args.out is None:
        raise common.UserError("--work and --out are required (only --plan runs without them)")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.out.resolve() == (common.REPO_ROOT / "model").resolve():
        print("note: writing the package over the repo's model/ directory", file=sys.stderr)
    logger = common.setup_logging(args.work / "run_pipeline.log", "run_pipeline")
    logger.info("command: python -m evidence.run_pipeline %s", " ".join(sys.argv[1:] if argv is None else argv))
    config = load_config(args.config)
    if args.lock:
        lock_models(args.config, config, logger, args.architecture)
    config["_config_file"] = args.config.name
    return Pipeline(args, config, logger).run()


def plan(args: argparse.Namespace) -> dict:
    """--plan: placeholders for the directories not given, no log, no state, nothing fetched."""
    args.work, args.out = args.work or Path("WORK"), args.out or Path("OUT")
    config = load_config(args.config)
    config["_config_file"] = args.config.name
    return Pipeline(args, config, logging.getLogger("run_pipeline.plan")).plan()


if __name__ == "__main__":
    common.run_cli(main)
