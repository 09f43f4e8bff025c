"""The draft server's settings, each defined once: a field of ServerSettings carries its default, its help
and its check, and the command line (`python server.py --help`) is generated from the fields.

Also what start-up reports and checks before anything is allocated: the one-line summary of what is
served, and whether the weights plus the KV cache fit in the memory available.
"""

import argparse
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import torch

import attention_kernel
import checkpoint
import draft_model
import int4
import package_manifest
import planning

MEMORY_HEADROOM = 0.9  # share of the available memory the weights and the KV cache may take; the rest:
# activations of a prefill chunk, the Python heap, the page cache of the weight files


class ConfigError(ValueError):
    """A setting that cannot work, with the flag to change: the server exits with status 2."""


def at_least(low: float) -> Callable[[float], str | None]:
    return lambda value: None if value >= low else f"must be >= {low}, got {value}"


def within(low: float, high: float) -> Callable[[float], str | None]:
    return lambda value: None if low <= value <= high else f"must be in {low}..{high}, got {value}"


def bucket_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def setting(
    help: str,
    default=MISSING,
    *,
    parse: Callable = str,
    check: Callable | None = None,
    choices: Sequence[str] | None = None,
):
    """A ServerSettings field that is also a command-line flag: `parse` reads the flag's text (bool: a
    switch), `check` returns why a value cannot work or None, `choices` lists the only values allowed."""
    return field(default=default, metadata={"help": help, "parse": parse, "check": check, "choices": choices})


@dataclass(frozen=True)
class ServerSettings:
    model_dir: Path = setting("model package or HF checkpoint directory", parse=Path)
    host: str = setting("bind address (loopback: only this machine can connect)", "127.0.0.1")
    port: int = setting("TCP port", 8000, parse=int, check=within(0, 65535))
    max_batch_size: int = setting("most requests per draft_batch call", 16, parse=int, check=at_least(1))
    max_wait_ms: float = setting(
        "how long a started batch waits for more requests", 2.0, parse=float, check=at_least(0)
    )
    regroup_wait_ms: float = setting(
        "how long a started batch may wait for more requests while it holds fewer than the largest of the last "
        "few batches: clients answered together come back milliseconds apart, and the last would otherwise cost "
        "a batch of their own (0: only max_wait_ms)",
        30.0,
        parse=float,
        check=at_least(0),
    )
    max_queue: int = setting(
        "requests that may wait for the batcher; beyond it: 503", 256, parse=int, check=at_least(1)
    )
    queue_deadline_s: float = setting(
        "a request still queued after this many seconds is answered 503 with Retry-After",
        30.0,
        parse=float,
        check=at_least(0.001),
    )
    max_draft_tokens: int = setting("largest max_tokens a request may ask", 64, parse=int, check=at_least(1))
    min_confidence: float = setting(
        "adaptive draft length for requests that do not set min_confidence: stop after a draft token whose "
        "probability is below this (0: always max_tokens)",
        0.0,
        parse=float,
        check=within(0.0, 1.0),
    )
    lookup_min_match: int = setting(
        "hybrid drafting for requests that do not set lookup_min_match: when the request's tokens end in an "
        f"n-gram of at least this many tokens (1..{draft_model.LOOKUP_MAX_MATCH}) seen earlier in them, return "
        "what followed it instead of a model draft (0: off)",
        0,
        parse=int,
        check=within(0, draft_model.LOOKUP_MAX_MATCH),
    )
    cache_slots: int | None = setting(
        f"KV-cache slots for prefix reuse; at least {planning.SLOTS_PER_ROW} x --max-batch-size (None: exactly that)",
        None,
        parse=int,
        check=at_least(1),
    )
    max_context: int | None = setting(
        f"longest token_ids accepted (None: the model's, capped at {planning.DEFAULT_MAX_CONTEXT})",
        None,
        parse=int,
        check=at_least(1),
    )
    device: str = setting("auto: cuda if available", "auto", choices=("auto", "cpu", "cuda"))
    dtype: str = setting(
        "auto: bfloat16 on cuda or with packed INT4 weights, else float32",
        "auto",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    weights: str = setting(
        "GPTQ weights: packed = INT4 kernel (cpu, bfloat16), dequant = dense; auto packs when it can",
        "auto",
        choices=checkpoint.WEIGHT_PATHS,
    )
    int4_kernel: str = setting(
        "how GPTQ INT4 layers are multiplied on the CPU: int4pack (PyTorch's INT4 kernel; 4-bit weights), "
        "int4-bf16dot (this project's INT4 kernel: weights unpacked once per call for all its rows; needs "
        "AVX512-BF16 and a C++ compiler, built at the first start), dense-bf16 (dequantized once to bf16; needs "
        "AVX512-BF16 or AMX), dense-fp32 (dequantized once to fp32); auto: dense-bf16 where the CPU has AMX, else "
        "int4-bf16dot where it has AVX512-BF16 and the kernel builds, else int4pack. A forced kernel sets --weights "
        "and --dtype",
        "auto",
        choices=("auto", *int4.CPU_KERNELS),
    )
    attention_kernel: str = setting(
        "how queries attend over the KV cache: query-kernel (this project's CPU kernels, query_attention.cpp: "
        "read the bf16 cache in place; need AVX512F and a C++ compiler, built at the first start; a prefill's "
        "complete chunks take its chunk kernel where the CPU also has AVX512-BF16), torch (PyTorch operators on a "
        "gathered window, SDPA for complete chunks); auto: query-kernel on a CPU with AVX512F in bf16 where it "
        "builds, else torch. With query-kernel RMSNorm also takes this project's kernel (rms_norm.cpp) where it "
        "builds",
        "auto",
        choices=attention_kernel.ATTENTION_KERNELS,
    )
    compile: str = setting(
        "decode with a step compiled once per batch bucket (torch.compile; replayed as a CUDA graph on cuda), "
        "built at start-up; auto: on for cuda, off for cpu (there the first start spends minutes compiling, for "
        "decode steps about 1.5x faster at batch 1)",
        "auto",
        choices=("auto", "on", "off"),
    )
    batch_buckets: tuple[int, ...] = setting(
        "batch sizes the decode step runs in (increasing powers of two): a batch is padded to the next one "
        "when compiled, and a batch above the largest is split",
        planning.BATCH_BUCKETS,
        parse=bucket_list,
        check=planning.bucket_problem,
    )
    threads: int | None = setting(
        "CPU threads for drafting (default: torch's, one per core; the HTTP event loop works between batches, "
        "and the drafting thread is the only one that runs torch's operators)",
        None,
        parse=int,
        check=at_least(1),
    )
    api_key_file: Path | None = setting(
        "file holding the API key; then /draft needs 'Authorization: Bearer <key>'", None, parse=Path
    )
    max_body_bytes: int = setting("largest request body in bytes", 1 << 20, parse=int, check=at_least(1))
    drain_seconds: float = setting(
        "after SIGTERM, how long the drained server keeps answering (/health 503, new drafts 503) before it "
        "stops listening, so a router's health checks see it leave",
        0.0,
        parse=float,
        check=at_least(0),
    )
    skip_integrity_check: bool = setting(
        "development only: load a package whose files do not match its sha256 manifest", False, parse=bool
    )
    log_level: str = setting(
        "server log level (debug also prints the traceback of a start-up error)",
        "info",
        choices=("debug", "info", "warning", "error"),
    )
    access_log: bool = setting("log every request (off: it costs throughput)", False, parse=bool)
    api_key: str | None = field(default=None, repr=False)  # read from api_key_file; not a flag of its own

    def __post_init__(self):
        for spec in fields(self):
            value, check, choices = getattr(self, spec.name), spec.metadata.get("check"), spec.metadata.get("choices")
            problem = (check(value) if check and value is not None else None) or (
                f"must be one of {', '.join(choices)}, got {value!r}" if choices and value not in choices else None
            )
            if problem:
                raise ConfigError(f"{flag_name(spec.name)}: {problem}")
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ConfigError(f"--model-dir {self.model_dir}: no config.json there; is it a model package?")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: torch sees no CUDA device here (use --device auto or cpu)")
        if self.cache_slots is not None and self.cache_slots < planning.SLOTS_PER_ROW * self.max_batch_size:
            raise ConfigError(
                f"--cache-slots {self.cache_slots} is less than {planning.SLOTS_PER_ROW} x --max-batch-size "
                f"({planning.SLOTS_PER_ROW * self.max_batch_size}): "
                "each batch needs a slot per row plus slots that keep earlier prefixes for reuse; "
                "raise --cache-slots or lower --max-batch-size"
            )

        self._apply_int4_kernel()

    def _apply_int4_kernel(self) -> None:
        """Check --int4-kernel on this CPU and turn a forced kernel into --weights and --dtype (what load_model
        takes): one that contradicts an explicit --weights or --dtype, or that this CPU lacks, is refused. auto
        is left to load_model, which makes the same choice. On cuda the CUDA INT4 kernel runs: auto only."""
        on_cpu = self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available())
        if not on_cpu:
            if self.int4_kernel != "auto":
                raise ConfigError(f"--int4-kernel {self.int4_kernel}: CPU kernels only; on cuda leave it at auto")
            return
        try:
            name = int4.choose_cpu_kernel(self.int4_kernel)
        except ValueError as error:
            raise ConfigError(f"--int4-kernel: {error}") from None
        kernel = int4.CPU_KERNELS[name]
        dtype = str(kernel.dtype).removeprefix("torch.")
        if self.int4_kernel != "auto":
            for flag, value, wanted in (("--weights", self.weights, kernel.weights), ("--dtype", self.dtype, dtype)):
                if value not in ("auto", wanted):
                    raise ConfigError(f"--int4-kernel {name} runs {flag} {wanted}, not {value}; leave {flag} at auto")
        if self.int4_kernel != "auto":  # auto stays auto: checkpoint.resolve_runtime applies the same choice
            object.__setattr__(self, "weights", kernel.weights)
            object.__setattr__(self, "dtype", dtype)

    @property
    def compiled(self) -> bool:
        on_cuda = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
        return self.compile == "on" or (self.compile == "auto" and on_cuda)

    @property
    def slots(self) -> int:
        return self.cache_slots if self.cache_slots is not None else planning.SLOTS_PER_ROW * self.max_batch_size


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the module docstring's layout and show every flag's default."""


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    for spec in fields(ServerSettings):
        if "help" not in spec.metadata:
            continue
        meta = spec.metadata
        if meta["parse"] is bool:
            parser.add_argument(flag_name(spec.name), action="store_true", help=meta["help"])
            continue
        required = spec.default is MISSING
        parser.add_argument(
            flag_name(spec.name),
            type=checked(meta["parse"], meta["check"]),
            choices=meta["choices"],
            help=meta["help"],
            required=required,
            **({} if required else {"default": spec.default}),
        )
    return parser


def checked(parse: Callable, check: Callable | None) -> Callable:
    """parse, then check: argparse reports the check's problem as `argument --flag: <problem>`."""

    def parse_and_check(text: str):
        value = parse(text)
        problem = check(value) if check else None
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse_and_check.__name__ = parse.__name__  # argparse names it in "invalid int value: 'x'"
    return parse_and_check


def parse_args(argv: Sequence[str] | None, description: str) -> ServerSettings:
    """Settings from the command line; a setting that cannot work exits with status 2 and one line."""
    parser = build_parser(description)
    values = vars(parser.parse_args(argv))
    try:
        return ServerSettings(**values, api_key=read_api_key(values["api_key_file"]))
    except ConfigError as error:
        parser.error(str(error))


def read_api_key(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        api_key = path.read_text().strip()
    except OSError as error:
        raise ConfigError(f"--api-key-file: {error}") from None
    if not api_key:
        raise ConfigError(f"--api-key-file {path} is empty")
    return api_key


def startup_summary(identity: dict, settings: ServerSettings, load_seconds: float) -> str:
    """One log line: what is being served, where, and how it was configured."""
    quant = identity["quantization"]
    quant_text = f"{quant['method']} int{quant['bits']} g{quant['group_size']}" if quant else "unquantized"
    random_text = "RANDOM WEIGHTS, " if identity["model_card"].get("random_weights") else ""
    integrity = (
        "NOT CHECKED (--skip-integrity-check)"
        if settings.skip_integrity_check
        else "verified"
        if package_manifest.has_manifest(settings.model_dir)
        else f"unverified (no {package_manifest.MANIFEST})"
    )
    return (
        f"loaded {identity['name']} from {settings.model_dir} in {load_seconds:.2f} s: {identity['architecture']}, "
        f"{identity['num_layers']} layers, vocab {identity['vocab_size']}, {quant_text}, "
        f"lora r={identity['lora_rank']}, {random_text}integrity {integrity}, device {identity['device']}, "
        f"dtype {identity['dtype']}, weights {identity['weights']}, kernel {identity['kernel']['name']}, "
        f"attention {identity['kernel']['attention']}"
        f"{' on a CPU with ' + identity['kernel']['cpu'] if 'cpu' in identity['kernel'] else ''}, "
        f"max_context {identity['max_context']}, "
        f"cache_slots {identity['cache_slots']}, max_batch_size {settings.max_batch_size}, "
        f"threads {torch.get_num_threads()}, auth {'on' if settings.api_key else 'off'}"
    )


def port_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port, found before the model is loaded; None when it can.
    (The port may still be taken in the moment between this check and uvicorn's bind: uvicorn then says so.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as error:
            return f"--port {port}: cannot listen on {host}:{port} ({error.strerror}); choose another --port or --host"
    return None


# ----------------------------------------------------------------------------- memory


def memory_problem(settings: ServerSettings) -> str | None:
    """Why the weights plus the KV cache would not fit in the memory available now (RAM, or the GPU's),
    with the largest --cache-slots and --max-context that would; None when they fit or when the
    available memory cannot be read. The model's files are not read beyond their headers."""
    layout = checkpoint.read_layout(settings.model_dir)
    device, dtype, packed = checkpoint.resolve_runtime(settings.device, settings.dtype, settings.weights, layout.quant)
    available = available_memory(device)
    if available is None:
        return None
    cfg = layout.cfg
    context = settings.max_context or planning.default_context(cfg.max_position_embeddings)
    if context > cfg.max_position_embeddings:
        return None  # load_model refuses it, naming the model's limit
    kv_bytes_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    slots = settings.slots + 1  # the cache keeps one scratch slot beside the requested ones
    weight_bytes = layout.weight_bytes(dtype.itemsize, packed)
    needed = weight_bytes + slots * context * kv_bytes_per_token
    budget = int(available * MEMORY_HEADROOM)
    if needed <= budget:
        return None
    room = max(budget - weight_bytes, 0)
    largest_slots = room // (context * kv_bytes_per_token) - 1
    largest_context = min(room // (slots * kv_bytes_per_token), cfg.max_position_embeddings)
    fits = [
        f"--cache-slots {largest_slots} (CACHE_SLOTS) at this context"
        if largest_slots >= planning.SLOTS_PER_ROW * settings.max_batch_size
        else None,
        f"--max-context {largest_context} (MAX_CONTEXT) with these slots" if largest_context >= 1 else None,
    ]
    fits = [fit for fit in fits if fit] or ["a smaller model, or fewer --max-batch-size and --cache-slots"]
    return (
        f"{settings.slots} cache slots x {context} tokens need {gib(needed - weight_bytes)} of KV cache plus "
        f"{gib(weight_bytes)} of weights, but {gib(available)} of {device.type} memory is available "
        f"({MEMORY_HEADROOM:.0%} of it may be used); the largest that fit: {' or '.join(fits)}"
    )


def available_memory(device: torch.device) -> int | None:
    """Free bytes: the GPU's, or the RAM this process may still take (MemAvailable, within a cgroup limit)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    limits = [meminfo_available()]
    try:
        limit, used = (Path("/sys/fs/cgroup") / name for name in ("memory.max", "memory.current"))
        if limit.read_text().strip() != "max":
            limits.append(int(limit.read_text()) - int(used.read_text()))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit readable: the machine's memory is the limit
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    if hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**27 else f"{size / 2**20:.1f} MiB"
