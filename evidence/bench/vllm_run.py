"""Generate greedily with vLLM in one speculation setting and write what happened as JSON: the engine half of
evidence/bench/bench_vllm.py and tests/test_vllm_engine.py. It runs in the engine's virtual environment (.venv-engine,
made by scripts/engine_venv.sh), imports nothing from this project but vllm_proposer.py, which vLLM loads itself.

Reads: --target (a Hugging Face model directory with its tokenizer; vLLM needs a config.json without
quantization_config), --prompts (JSONL rows with "id" and "token_ids", as evidence/prompts/smollm2_models.py writes
mtbench_prompts.jsonl). For --method draft_model, --draft (an HF directory of the drafter, same vocabulary).
For --method server, the draft server at DRAFT_SERVER_URL (see vllm_proposer.py for its other settings).
Writes: --out, JSON with the wall time of the timed generate call, every output's token ids, text and finish
reason, and vLLM's own speculation counters over that call (drafts, draft tokens, accepted tokens, accepted
tokens per position). A short warm-up generate runs first and is not timed.

    .venv-engine/bin/python evidence/bench/vllm_run.py --method none --target SMALL/target \
        --prompts SMALL/mtbench_prompts.jsonl --count 20 --max-tokens 96 --out none.json
    DRAFT_SERVER_URL=http://127.0.0.1:8000 .venv-engine/bin/python evidence/bench/vllm_run.py --method server --k 16 ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
METHODS = ("none", "ngram", "draft_model", "server")
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=METHODS, required=True, help="speculation: none, or who drafts")
    parser.add_argument("--target", type=Path, required=True, help="the target model directory")
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL with id and token_ids per prompt")
    parser.add_argument("--count", type=int, default=20, help="first COUNT prompts of the file")
    parser.add_argument("--max-tokens", type=int, default=96, help="new tokens per prompt (greedy)")
    parser.add_argument("--k", type=int, default=16, help="num_speculative_tokens")
    parser.add_argument("--draft", type=Path, help="the drafter directory for --method draft_model")
    parser.add_argument("--out", type=Path, required=True, help="JSON result")
    args = parser.parse_args(argv)
    if args.method == "draft_model" and args.draft is None:
        parser.error("--method draft_model needs --draft DIR")
    if args.count < 1 or args.max_tokens < 1 or args.k < 1:
        parser.error("--count, --max-tokens and --k must be at least 1")
    return args


def speculative_config(args: argparse.Namespace) -> dict | None:
    if args.method == "none":
        return None
    config = {"num_speculative_tokens": args.k}
    if args.method == "ngram":
        return config | {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    if args.method == "draft_model":
        return config | {"method": "draft_model", "model": str(args.draft)}
    return config | {"method": "custom_class", "model": "vllm_proposer.DraftServerProposer"}


def read_prompts(path: Path, count: int) -> list[dict]:
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: --prompts {path} is not a readable JSONL file: {error}") from None
    if len(rows) <= count:
        raise SystemExit(f"error: --prompts {path} has {len(rows)} rows; --count {count} needs one more (warm-up)")
    return rows[: count + 1]


def spec_counters(llm) -> dict:
    """vLLM's speculation counters so far (zeros without speculation)."""
    counters = {name: 0 for name in SPEC_COUNTERS} | {PER_POSITION: []}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            counters[metric.name] = metric.value
        elif metric.name == PER_POSITION:
            counters[PER_POSITION] = list(metric.values)
    return counters


def difference(after: dict, before: dict) -> dict:
    per_position = [
        a - (before[PER_POSITION][i] if i < len(before[PER_POSITION]) else 0) for i, a in enumerate(after[PER_POSITION])
    ]
    return {name.removeprefix("vllm:spec_decode_"): after[name] - before[name] for name in SPEC_COUNTERS} | {
        "num_accepted_tokens_per_pos": per_position
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    *timed, warm_up = read_prompts(args.prompts, args.count)
    sys.path.insert(0, str(REPO_ROOT))  # vLLM imports vllm_proposer in its worker: PYTHONPATH carries it there
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(
        model=str(args.target),
        dtype="float32",
        max_model_len=2048,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config=speculative_config(args),
        seed=0,
    )
    load_s = time.monotonic() - started
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate([{"prompt_token_ids": warm_up["token_ids"]}], SamplingParams(temperature=0.0, max_tokens=8))
    before = spec_counters(llm)
    started = time.monotonic()
    outputs = llm.generate([{"prompt_token_ids": row["token_ids"]} for row in timed], greedy)
    wall_s = time.monotonic() - started
    result = {
        "method": args.method,
        "k": args.k if args.method != "none" else 0,
        "proposer_settings": {name: value for name, value in os.environ.items() if name.startswith("DRAFT_SERVER_")},
        "prompts": len(timed),
        "max_tokens": args.max_tokens,
        "load_s": load_s,
        "wall_s": wall_s,
        "spec": difference(spec_counters(llm), before),
        "outputs": [
            {
                "id": row["id"],
                "token_ids": list(output.outputs[0].token_ids),
                "text": output.outputs[0].text,
                "finish_reason": output.outputs[0].finish_reason,
            }
            for row, output in zip(timed, outputs, strict=True)
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=args.out.parent, suffix=".tmp", delete=False) as staging:
        json.dump(result, staging)
    os.replace(staging.name, args.out)


if __name__ == "__main__":
    main()
