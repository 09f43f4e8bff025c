"""Starting the draft server: settings generated from one dataclass, configuration errors as one line with exit
status 2, the memory check, the integrity manifest, serve.sh, and the shipped package."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import httpx
import pytest
import torch
from live_server import STARTUP_TIMEOUT_S, free_port, start_server, stop_server
from safetensors.torch import load_file

import draft_model
import package_manifest
import server_settings
from evidence.quantize import make_random_package

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_server(repo_root: Path, model_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    """server.py run to its exit (for settings it refuses before it ever listens)."""
    return subprocess.run(
        [sys.executable, "server.py", "--model-dir", str(model_dir), "--port", str(free_port()), "--threads", "1"]
        + list(flags),
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_refusal(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    refusal = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(refusal) == 1, result.stderr
    for word in words:
        assert word in refusal[0], result.stderr


@pytest.fixture
def random_package(tmp_path: Path) -> Path:
    """A small random INT4 package with its sha256 manifest, as make_random_package writes it."""
    make_random_package.main(["--output", str(tmp_path / "package")])
    return tmp_path / "package"


# ----------------------------------------------------------------------------- settings


def test_every_setting_is_a_flag_with_its_default_and_help(tiny_checkpoint: Path):
    settings = server_settings.parse_args(["--model-dir", str(tiny_checkpoint)], description="")
    help_text = server_settings.build_parser("").format_help()
    for spec in fields(server_settings.ServerSettings):
        if spec.name == "api_key":  # read from --api-key-file, never given on the command line
            continue
        flag = server_settings.flag_name(spec.name)
        assert flag in help_text
        if spec.name != "model_dir":
            assert getattr(settings, spec.name) == spec.default, flag


def test_settings_built_in_code_are_checked_like_flags(tiny_checkpoint: Path):
    with pytest.raises(server_settings.ConfigError, match="--max-queue: must be >= 1, got 0"):
        server_settings.ServerSettings(model_dir=tiny_checkpoint, max_queue=0)
    with pytest.raises(server_settings.ConfigError, match="--weights: must be one of"):
        server_settings.ServerSettings(model_dir=tiny_checkpoint, weights="int3")


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--max-batch-size", "8", "--cache-slots", "4"], "--cache-slots 4 is less than 2 x --max-batch-size"),
        (["--max-batch-size", "0"], "must be >= 1"),
        (["--port", "70000"], "must be in 0..65535"),
        (["--max-wait-ms", "soon"], "invalid float value: 'soon'"),
        (["--queue-deadline-s", "0"], "--queue-deadline-s: must be >= 0.001"),
        (["--api-key-file", "/nonexistent/key"], "--api-key-file"),
        pytest.param(
            ["--device", "cuda"],
            "no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA"),
        ),
    ],
)
def test_bad_flags_exit_2_with_a_message(tiny_checkpoint: Path, flags: list[str], message: str, capsys):
    with pytest.raises(SystemExit) as refusal:
        server_settings.parse_args(["--model-dir", str(tiny_checkpoint), *flags], description="")
    assert refusal.value.code == 2
    assert message in capsys.readouterr().err


def test_model_dir_without_config_is_refused(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as refusal:
        server_settings.parse_args(["--model-dir", str(tmp_path)], description="")
    assert refusal.value.code == 2 and "no config.json" in capsys.readouterr().err


def test_unloadable_model_fails_startup_with_the_reason(repo_root: Path, tmp_path: Path):
    shutil.copyfile(repo_root / "model" / "config.json", tmp_path / "config.json")  # no weights
    assert_one_line_refusal(run_server(repo_root, tmp_path), "cannot load the model", "model.safetensors")


def test_a_cache_that_cannot_fit_in_memory_is_refused_in_one_line(repo_root: Path, tiny_checkpoint: Path):
    result = run_server(repo_root, tiny_checkpoint, "--cache-slots", "100000000")
    assert_one_line_refusal(result, "100000000 cache slots x 512 tokens need", "of KV cache", "--cache-slots")


def test_the_sizes_proposed_are_the_largest_that_fit(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(server_settings, "available_memory", lambda device: 64 * 2**20)
    problem = server_settings.memory_problem(
        server_settings.ServerSettings(model_dir=tiny_checkpoint, cache_slots=4096)
    )
    largest_slots = int(problem.split("--cache-slots ")[1].split()[0])
    largest_context = int(problem.split("--max-context ")[1].split()[0])

    def fits(**sizes) -> bool:
        return (
            server_settings.memory_problem(server_settings.ServerSettings(model_dir=tiny_checkpoint, **sizes)) is None
        )

    assert fits(cache_slots=largest_slots) and not fits(cache_slots=largest_slots + 1)
    assert fits(cache_slots=4096, max_context=largest_context)
    assert not fits(cache_slots=4096, max_context=largest_context + 1)


def test_a_port_in_use_is_refused_before_the_model_loads(repo_root: Path, tiny_checkpoint: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_server(repo_root, tiny_checkpoint, "--port", str(port))
    assert_one_line_refusal(result, f"--port {port}: cannot listen on 127.0.0.1:{port}")
    assert "loaded" not in result.stderr


def test_a_signal_during_the_first_kernel_build_exits_and_leaves_no_build_lock(repo_root: Path, tmp_path: Path):
    """SIGTERM while start-up builds the INT4 kernel in a fresh extension directory: the server exits 0 at once,
    and torch's build lock goes with it (a lock left behind would hold up every later start)."""
    extensions = tmp_path / "extensions"
    env = os.environ | {"TORCH_EXTENSIONS_DIR": str(extensions)}
    command = [sys.executable, "server.py", "--model-dir", "model", "--port", str(free_port()), "--threads", "1"]
    process = subprocess.Popen(command, cwd=repo_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not list(extensions.glob("*/lock")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(extensions.glob("*/lock")) or process.poll() is None, process.stdout.read().decode()
    if not list(extensions.glob("*/lock")):
        process.kill()
        pytest.skip("start-up built no kernel within 60 s here (a CPU without AVX512F, or no compiler)")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.stdout.read().decode()
    assert not list(extensions.glob("*/lock"))


def test_serve_sh_maps_environment_to_flags(repo_root: Path, tiny_checkpoint: Path, tmp_path: Path):
    """serve.sh as operators run it, with the repository's .venv (serve.sh would otherwise create one)."""
    if not (repo_root / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv in the repository: serve.sh would create one and install the dependencies")
    (tmp_path / "key").write_text("serve-sh-key\n")
    port = free_port()
    env = {
        **os.environ,
        "MODEL_DIR": str(tiny_checkpoint),
        "PORT": str(port),
        "MAX_BATCH_SIZE": "4",
        "MAX_QUEUE": "7",
        "MAX_DRAFT_TOKENS": "8",
        "MAX_CONTEXT": "300",
        "QUEUE_DEADLINE_S": "9",
        "THREADS": "1",
        "API_KEY_FILE": str(tmp_path / "key"),
    }
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([str(repo_root / "serve.sh")], env=env, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            try:
                health = httpx.get(url + "/health", timeout=1).json()
                break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            pytest.fail(f"serve.sh never served /health:\n{log_path.read_text()}")
        limits = health["limits"]
        names = ("max_batch_size", "max_queue", "max_draft_tokens", "max_context", "queue_deadline_s")
        assert [limits[name] for name in names] == [4, 7, 8, 300, 9]
        assert health["auth_required"] is True
        assert httpx.post(url + "/draft", json={"token_ids": [1]}, timeout=30).status_code == 401
    finally:
        process.send_signal(signal.SIGTERM)  # serve.sh execs the server, so this reaches it directly
        assert process.wait(timeout=30) == 0, log_path.read_text()


# ----------------------------------------------------------------------------- integrity


def test_make_random_package_writes_a_manifest_that_verifies(random_package: Path):
    hashes = json.loads((random_package / package_manifest.MANIFEST).read_text())["sha256"]
    files = sorted(p.name for p in random_package.iterdir() if p.name != package_manifest.MANIFEST)
    assert sorted(hashes) == files
    assert package_manifest.verify_manifest(random_package) is True


def test_a_package_edited_by_hand_loads_again_once_its_manifest_is_rewritten(random_package: Path):
    card = random_package / "model_card.json"
    card.write_text(card.read_text().replace("placeholder", "stand-in"))
    with pytest.raises(draft_model.ModelLoadError, match="model_card.json: sha256"):
        draft_model.load_model(random_package, cache_slots=2)
    package_manifest.main([str(random_package)])
    assert package_manifest.verify_manifest(random_package) is True


def flip_one_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_bit_is_refused_naming_the_file_and_both_hashes(random_package: Path):
    weights = random_package / "model_int4.safetensors"
    expected = package_manifest.sha256_file(weights)
    flip_one_bit(weights, offset=-100)  # inside a tensor: the file still parses
    actual = package_manifest.sha256_file(weights)
    with pytest.raises(draft_model.ModelLoadError) as refusal:
        draft_model.load_model(random_package, cache_slots=2)
    assert str(weights) in str(refusal.value) and expected in str(refusal.value) and actual in str(refusal.value)
    assert draft_model.load_model(random_package, cache_slots=2, verify_integrity=False).vocab_size > 0


@pytest.mark.parametrize(
    "damage,message",
    [
        (
            lambda package: (package / "lora_config.json").unlink(),
            "lora_config.json: listed in checksums.json but missing",
        ),
        (lambda package: (package / "extra.json").write_text("{}"), "extra.json: not listed in checksums.json"),
        (lambda package: (package / "checksums.json").write_text("[]"), "not a JSON object with a 'sha256' map"),
        (
            lambda package: (package / "checksums.json").write_text('{"sha256": {"../config.json": "00"}}'),
            "must map each file name",
        ),
    ],
    ids=["missing file", "unlisted file", "not a map", "path outside"],
)
def test_a_package_that_does_not_match_its_manifest_is_refused(random_package: Path, damage, message: str):
    damage(random_package)
    with pytest.raises(draft_model.ModelLoadError, match=message):
        draft_model.load_model(random_package, cache_slots=2)


def test_server_refuses_a_damaged_package_unless_told_to_skip_the_check(repo_root, random_package, server):
    flip_one_bit(random_package / "model_int4.safetensors", offset=-100)
    refused = run_server(repo_root, random_package)
    assert_one_line_refusal(refused, "cannot load the model", "model_int4.safetensors", "does not match")
    running = server(random_package, "--skip-integrity-check")
    assert "integrity NOT CHECKED (--skip-integrity-check)" in running.log()


# ----------------------------------------------------------------------------- the shipped package


def test_shipped_model_package_serves_its_own_vocabulary(repo_root: Path, tmp_path: Path):
    """model/ is the distilled SmolLM2 drafter: SmolLM2 ids draft as draft_model drafts them in process;
    Qwen3 ids (the product target's tokenizer) get a 400 that names the drafter's vocabulary."""
    model_dir = repo_root / "model"
    running = start_server(repo_root, model_dir, tmp_path / "server.log")
    try:
        health = httpx.get(running.url + "/health", timeout=10).json()
        assert health["random_weights"] is False
        assert health["model"]["quantization"]["embedding_group_size"] == 32 and health["model"]["vocab_size"] == 49152
        smollm2_chat = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411]
        smollm2_chat += [407, 19712, 8182, 2, 198, 1, 4093, 198]
        body = httpx.post(running.url + "/draft", json={"token_ids": smollm2_chat, "max_tokens": 8}, timeout=30).json()
        drafter = draft_model.load_model(model_dir, cache_slots=2)  # the server's defaults: device, dtype, weights auto
        assert body["draft_token_ids"] == draft_model.draft_batch(drafter, [smollm2_chat], max_tokens=8)[0]
        qwen3_chat = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
        refused = httpx.post(running.url + "/draft", json={"token_ids": qwen3_chat}, timeout=30)
        assert refused.status_code == 400
        assert "SmolLM2" in refused.json()["detail"] and "0..49151" in refused.json()["detail"]
    finally:
        stop_server(running)
    assert "RANDOM WEIGHTS" not in running.log() and "integrity verified" in running.log()


def test_shipped_model_is_what_architecture_json_records(repo_root: Path):
    record = json.loads((repo_root / "architecture.json").read_text())["shipped_package"]
    model_dir = repo_root / "model"
    shipped = {path.name: package_manifest.sha256_file(path) for path in package_manifest.package_files(model_dir)}
    assert record["model_files_sha256"] == shipped
    assert json.loads((model_dir / package_manifest.MANIFEST).read_text())["sha256"] == shipped
    assert record["measured_tau"]["runs"] and all(run["check"] == "passed" for run in record["measured_tau"]["runs"])


def test_make_random_package_is_reproducible(tmp_path: Path):
    for name in ("a", "b"):
        make_random_package.main(["--output", str(tmp_path / name), "--embedding-group-size", "32"])
    for name in ("model_int4.safetensors", "lora.safetensors"):
        first, second = load_file(tmp_path / "a" / name), load_file(tmp_path / "b" / name)
        assert first.keys() == second.keys() and all(first[key].equal(second[key]) for key in first), name
    assert draft_model.load_model(tmp_path / "a", cache_slots=2).model.embed_tokens is None


def test_make_random_package_refuses_a_vocabulary_without_the_qwen3_ids(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as refusal:
        make_random_package.main(["--output", str(tmp_path / "package"), "--vocab-size", "49152"])
    assert refusal.value.code == 2 and "use at least 151646" in capsys.readouterr().err
    assert not (tmp_path / "package").exists()
