"""evidence/measure/measure_tau.py against a tiny random Qwen3 target, with a perturbed copy of it as the drafter:
lossless output, agreement with the offline estimator (evidence/measure/tau.py) and with transformers assisted
generation, the same figures over HTTP as in process, hybrid drafting, the n-gram baseline, chat and
MT-bench prompts, and the plot."""

import json
import sys
from pathlib import Path

import pytest
import torch
from live_server import start_server, stop_server
from pipeline_fixtures import perturbed_copy, write_tokenizer
from tiny_models import make_hf_model, write_hf_checkpoint

from evidence.measure import measure_tau
from evidence.measure.tau import offline_tau
from evidence.prompts.prepare_prompts import encode, load_tokenizer
from evidence.teacher.gen_data import generate_transformers

K = 6
MAX_NEW_TOKENS = 24
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the cores are shared with the servers under test

PROMPTS = [[5 + i, 17 * i % 250 + 3, 40 + 3 * i, 9, 5 + i, 17 * i % 250 + 3] for i in range(4)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The target, a close drafter (perturbed copy) and an unrelated one, as checkpoint directories."""
    root = tmp_path_factory.mktemp("measure-tau")
    target = make_hf_model("qwen3", seed=3)
    close = perturbed_copy(target, noise=0.05, seed=4)
    return {
        "target": target,
        "close": close,
        "target_dir": write_hf_checkpoint(target, root / "target"),
        "close_dir": write_hf_checkpoint(close, root / "close"),
        "unrelated_dir": write_hf_checkpoint(make_hf_model("qwen3", seed=11), root / "unrelated"),
        "prompts": write_prompts(root / "prompts.jsonl"),
    }


def write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": str(i), "token_ids": ids}) + "\n" for i, ids in enumerate(PROMPTS)))
    return path


def run_harness(models: dict, tmp_path: Path, *drafter_flags: str) -> dict:
    argv = ["--target", str(models["target_dir"]), "--prompts", str(models["prompts"]), "--k", str(K)]
    argv += ["--max-new-tokens", str(MAX_NEW_TOKENS), "--check", "--json", str(tmp_path / "tau.json"), *drafter_flags]
    report = measure_tau.main(argv)
    assert json.loads((tmp_path / "tau.json").read_text()) == json.loads(json.dumps(report))
    return report


def test_in_process_is_lossless_and_equals_offline_tau(models, tmp_path):
    report = run_harness(models, tmp_path, "--drafter", str(models["close_dir"]))
    (run,) = report["runs"]
    assert run["check"] == "passed"
    # The offline estimator replays verification from the drafter's teacher-forced argmax on the
    # target's greedy continuation: for greedy drafting it must give exactly the same counts.
    eos = sorted(measure_tau.eos_token_ids(models["target"]))
    generations = generate_transformers(models["target"], PROMPTS, max_new_tokens=MAX_NEW_TOKENS, top_k=5, eos_ids=eos)
    examples = []
    for prompt, committed, (tokens, topk_ids, topk_logprobs) in zip(PROMPTS, run["outputs"], generations):
        assert committed == tokens.tolist()
        examples.append(
            dict(
                id=str(prompt),
                prompt_ids=torch.tensor(prompt),
                tokens=tokens,
                topk_ids=topk_ids,
                topk_logprobs=topk_logprobs,
            )
        )
    offline = offline_tau(models["close"], examples, k=K, batch_size=4, progress=False)
    assert (run["committed_tokens"], run["verify_steps"]) == (offline.committed, offline.steps)
    assert run["tau"] == offline.tau
    assert run["tau"] > 2.0  # the perturbed copy agrees often: the test can tell a broken loop from a working one
    assert len(run["acceptance_by_position"]) == K
    assert run["acceptance_by_position"][0] > 0.5  # the close copy's first draft token is usually right


def test_server_over_http_matches_in_process(models, tmp_path, repo_root):
    in_process = run_harness(models, tmp_path, "--drafter", str(models["close_dir"]))["runs"][0]
    running = start_server(repo_root, models["close_dir"], tmp_path / "server.log")
    try:
        over_http = run_harness(models, tmp_path, "--server", running.url)["runs"][0]
    finally:
        stop_server(running)
    assert over_http["check"] == "passed"
    assert over_http["outputs"] == in_process["outputs"]
    assert (over_http["tau"], over_http["verify_steps"]) == (in_process["tau"], in_process["verify_steps"])
    assert over_http["acceptance_by_position"] == in_process["acceptance_by_position"]


def test_ngram_baseline_runs(models, tmp_path):
    (run,) = run_harness(models, tmp_path, "--baselines", "ngram")["runs"]
    assert run["drafter"].startswith("ngram") and run["check"] == "passed"
    assert run["mean_draft_tokens_per_call"] > 0  # the prompts repeat themselves, so lookups do find matches
    # Replayed offline on the committed (the target's greedy) tokens, prompt lookup gives the same counts.
    committed = steps = 0
    for prompt, output in zip(PROMPTS, run["outputs"]):
        position = 0
        while position < len(output):
            remaining = MAX_NEW_TOKENS - position
            proposal = (
                measure_tau.ngram_drafter(prompt + output[:position], min(K, remaining - 1)) if remaining > 1 else []
            )
            accepted = 0
            while (
                accepted < len(proposal)
                and position + accepted < len(output)
                and proposal[accepted] == output[position + accepted]
            ):
                accepted += 1
            position += min(accepted + 1, len(output) - position)
            steps += 1
        committed += len(output)
    assert (run["committed_tokens"], run["verify_steps"]) == (committed, steps)
    assert run["tau"] > 1.0  # some lookups were accepted: the replay above compared real drafts


def test_category_replay_equals_the_live_harness(models, tmp_path):
    """evidence/measure/category_tau.py replays model, prompt-lookup and hybrid drafting offline from the target's
    greedy continuations; its counts must equal the live loop's for each drafter."""
    from evidence.measure.category_tau import category_table
    from evidence.measure.tau import teacher_forced_argmax

    report = run_harness(
        models, tmp_path, "--drafter", str(models["close_dir"]), "--hybrid", "2", "--baselines", "ngram"
    )
    live = {}
    for run in report["runs"]:
        name = (
            "prompt_lookup"
            if run["drafter"].startswith("ngram")
            else "hybrid"
            if "hybrid" in run["drafter"]
            else "model"
        )
        live[name] = (run["committed_tokens"], run["verify_steps"])
    eos = sorted(measure_tau.eos_token_ids(models["target"]))
    generations = generate_transformers(models["target"], PROMPTS, max_new_tokens=MAX_NEW_TOKENS, top_k=5, eos_ids=eos)
    examples = [
        {"id": str(i), "prompt_ids": torch.tensor(prompt), "tokens": tokens, "topk_ids": ids, "topk_logprobs": logprobs}
        for i, (prompt, (tokens, ids, logprobs)) in enumerate(zip(PROMPTS, generations))
    ]
    predictions = teacher_forced_argmax(models["close"], examples, progress=False)
    categories = {str(i): "even" if i % 2 == 0 else "odd" for i in range(len(PROMPTS))}
    table = category_table(examples, categories, predictions, K, hybrid=2)
    replayed = {name: (row["committed"], row["steps"]) for name, row in table["all"].items()}
    assert {name: replayed[name] for name in live} == live
    best = table["all"]["best_of"]["tau"]  # the oracle's pick of the two per step: no live drafter to equal
    assert best >= max(table["all"]["model"]["tau"], table["all"]["hybrid"]["tau"])
    assert set(table) == {"even", "odd", "all"}
    assert table["even"]["model"]["steps"] + table["odd"]["model"]["steps"] == table["all"]["model"]["steps"]
    assert live["hybrid"] != live["model"]  # lookups were taken: the hybrid rule was exercised


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    assert measure_tau.ngram_drafter([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 3) == [
        5,
        6,
        1,
    ]  # latest earlier "1 2" is followed by 5 6 1
    assert measure_tau.ngram_drafter([7, 8, 9], 4) == []


def test_assisted_generation_agrees_with_ours_and_hybrid_is_lossless(models, tmp_path):
    plot, record = tmp_path / "tau.png", tmp_path / "architecture.json"
    record.write_text(json.dumps({"summary": "kept"}))
    flags = ("--hybrid", "2", "--baselines", "assisted", "--plot", str(plot), "--record", str(record))
    report = run_harness(models, tmp_path, "--drafter", str(models["close_dir"]), *flags)
    ours, hybrid, assisted = report["runs"]
    assert "hybrid>=2" in hybrid["drafter"] and assisted["drafter"].startswith("transformers assisted")
    assert [run["check"] for run in report["runs"]] == ["passed"] * 3
    # Greedy, same weights, same k: transformers' loop must verify exactly the steps ours does.
    assert (assisted["verify_steps"], assisted["committed_tokens"]) == (ours["verify_steps"], ours["committed_tokens"])
    assert assisted["acceptance_by_position"] == [] and assisted["draft_latency_ms"] is None  # not observable there
    assert hybrid["outputs"] == ours["outputs"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stored = json.loads(record.read_text())
    assert stored["summary"] == "kept" and [run["tau"] for run in stored["measured_tau"]["runs"]] == [
        run["tau"] for run in report["runs"]
    ]
    assert "outputs" not in stored["measured_tau"]["runs"][0] and "--hybrid 2" in stored["measured_tau"]["command"]


def test_chat_messages_and_mtbench_questions(models, tmp_path):
    tokenizer_dir = write_tokenizer(tmp_path / "tokenizer")
    tokenizer = load_tokenizer(str(tokenizer_dir), None)
    questions = [["what is the water", "and the sea"], ["tell me a story", "make it long"]]
    mtbench = tmp_path / "question.jsonl"
    mtbench.write_text(
        "".join(
            json.dumps({"question_id": i, "category": "writing", "turns": t}) + "\n" for i, t in enumerate(questions)
        )
    )
    common = [
        "--target",
        str(models["target_dir"]),
        "--tokenizer",
        str(tokenizer_dir),
        "--baselines",
        "ngram",
        "--k",
        str(K),
    ]
    common += ["--max-new-tokens", "8", "--check"]
    both_turns = measure_tau.main([*common, "--mtbench", str(mtbench), "--turns", "2"])
    assert both_turns["prompts"] == 4 and both_turns["runs"][0]["check"] == "passed"

    as_messages = tmp_path / "messages.jsonl"
    as_messages.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": t[0]}]}) + "\n" for t in questions)
    )
    as_ids = tmp_path / "ids.jsonl"
    as_ids.write_text(
        "".join(
            json.dumps({"token_ids": encode(tokenizer, [{"role": "user", "content": t[0]}], False)}) + "\n"
            for t in questions
        )
    )
    first_turns = measure_tau.main([*common, "--mtbench", str(mtbench)])["runs"][0]["outputs"]
    assert measure_tau.main([*common, "--prompts", str(as_messages)])["runs"][0]["outputs"] == first_turns
    assert measure_tau.main([*common, "--prompts", str(as_ids)])["runs"][0]["outputs"] == first_turns
    assert both_turns["runs"][0]["outputs"][:2] == first_turns


def test_unrelated_drafter_is_still_lossless_and_drafters_share_a_run(models, tmp_path):
    close, adaptive, unrelated = run_harness(
        models,
        tmp_path,
        "--drafter",
        str(models["close_dir"]),
        "--drafter",
        str(models["unrelated_dir"]),
        "--min-confidence",
        "0.9",
    )["runs"]
    assert (
        adaptive["check"] == "passed" and adaptive["mean_draft_tokens_per_call"] < close["mean_draft_tokens_per_call"]
    )
    assert unrelated["check"] == "passed" and unrelated["mismatches"] == []
    assert 1.0 <= unrelated["tau"] < 1.5  # it rarely agrees, yet every committed token is the target's
    alone = run_harness(models, tmp_path, "--drafter", str(models["close_dir"]))["runs"][0]
    assert (close["tau"], close["outputs"]) == (alone["tau"], alone["outputs"])


@pytest.mark.parametrize(
    "row,flags,message",
    [
        ({"token_ids": [1, 999]}, ["--baselines", "ngram"], "outside the target's vocabulary"),
        ({"messages": [{"role": "user", "content": "hi"}]}, ["--baselines", "ngram"], "need the target's tokenizer"),
        ({"token_ids": [1, 2]}, ["--baselines", "assisted"], "needs the assistant model"),
        (
            {"token_ids": [1, 2]},
            ["--baselines", "ngram", "--hybrid", "3"],
            "--hybrid and --min-confidence measure a model drafter",
        ),
    ],
)
def test_user_errors_exit_2(models, tmp_path, capsys, monkeypatch, row, flags, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n")
    argv = ["measure_tau.py", "--target", str(models["target_dir"]), "--prompts", str(bad), *flags]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        measure_tau.common.run_cli(measure_tau.main)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
