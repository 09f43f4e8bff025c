"""The draft server over real HTTP: `python server.py` in a subprocess on a free loopback port, httpx clients.

Every expected draft comes from `draft_model.draft_batch` run in this process on the same weights, one
sequence at a time, so a test fails if batching, queueing or prefix reuse ever changes a draft.
"""

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

import draft_model
import server
from evidence import make_random_package

API_KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY_BYTES = 65536
STARTUP_TIMEOUT_S = 90


@dataclass
class RunningServer:
    process: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(repo_root: Path, model_dir: Path, log_path: Path, *flags: str) -> RunningServer:
    """Start server.py and wait until /health answers; fail with its log if it never does."""
    port = free_port()
    # One thread: the suite shares 2 cores with other test processes, and oversubscribed torch threads crawl.
    command = [sys.executable, str(repo_root / "server.py"), "--model-dir", str(model_dir), "--port", str(port)]
    command += ["--threads", "1", *flags]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=repo_root)
    running = RunningServer(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"server exited with {process.returncode} during startup:\n{running.log()}")
        try:
            if httpx.get(running.url + "/health", timeout=1).status_code == 200:
                return running
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    pytest.fail(f"server did not answer /health within {STARTUP_TIMEOUT_S} s:\n{running.log()}")


def stop_server(running: RunningServer) -> None:
    if running.process.poll() is None:
        running.process.send_signal(signal.SIGTERM)
        try:
            running.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            running.process.kill()
            running.process.wait()


def metric_samples(metrics_text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
    }


def batch_size_counts(client: httpx.Client) -> tuple[float, float]:
    """(batches formed, batches of exactly one request) since the server started."""
    samples = metric_samples(client.get("/metrics").text)
    return samples[("draft_server_batch_size_count", ())], samples[("draft_server_batch_size_bucket", (("le", "1.0"),))]


def prompt(length: int, seed: int, vocab_size: int = 256) -> list[int]:
    return [(seed * 7919 + i * 104729) % vocab_size for i in range(length)]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Leave the cores to the servers under test; restore afterwards for other modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path):
    """The same weights in this process: expected(tokens, max_tokens) is the draft of that sequence alone."""
    drafter = draft_model.load_model(tiny_checkpoint, cache_slots=2)  # the server's defaults

    def expected(tokens: list[int], max_tokens: int = 16, return_logprobs: bool = False) -> draft_model.Draft:
        return draft_model.draft_batch(drafter, [tokens], max_tokens=max_tokens, return_logprobs=return_logprobs)[0]

    return expected


@pytest.fixture(scope="module")
def api_key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secrets") / "api_key"
    path.write_text(API_KEY + "\n")
    return path


@pytest.fixture(scope="module")
def live(repo_root: Path, tiny_checkpoint: Path, api_key_file: Path, tmp_path_factory: pytest.TempPathFactory):
    """The main server: API key on, small body limit, a 10 ms batching window so batches form reliably."""
    log_path = tmp_path_factory.mktemp("live") / "server.log"
    running = start_server(
        repo_root,
        tiny_checkpoint,
        log_path,
        "--api-key-file",
        str(api_key_file),
        "--max-body-bytes",
        str(MAX_BODY_BYTES),
        "--max-wait-ms",
        "10",
    )
    yield running
    stop_server(running)
    assert running.process.returncode == 0, running.log()
    assert "Traceback" not in running.log()


@pytest.fixture
def client(live: RunningServer):
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as http:
        yield http


def assert_serves_correct_drafts(client: httpx.Client, reference) -> None:
    tokens = prompt(37, seed=99)
    response = client.post("/draft", json={"token_ids": tokens, "max_tokens": 12})
    assert response.status_code == 200, response.text
    assert response.json()["draft_token_ids"] == reference(tokens, 12)


# ----------------------------------------------------------------------------- happy path


def test_health_describes_model_and_limits(live: RunningServer):
    health = httpx.get(live.url + "/health", timeout=10).json()  # no API key: /health stays open
    assert health["status"] == "ok"
    assert health["model"]["architecture"] == "qwen3"
    assert health["model"]["vocab_size"] == 256
    assert health["limits"]["max_context"] == 512
    assert health["limits"]["max_body_bytes"] == MAX_BODY_BYTES
    assert health["auth_required"] is True
    assert health["random_weights"] is False


def test_docs_and_openapi_are_served(live: RunningServer):
    assert httpx.get(live.url + "/docs", timeout=10).status_code == 200
    schema = httpx.get(live.url + "/openapi.json", timeout=10).json()
    assert "/draft" in schema["paths"]


@pytest.mark.parametrize("length,max_tokens", [(1, 16), (5, 1), (64, 16), (300, 40), (511, 16)])
def test_draft_equals_draft_batch_alone(client: httpx.Client, reference, length: int, max_tokens: int):
    tokens = prompt(length, seed=length)
    response = client.post("/draft", json={"token_ids": tokens, "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["draft_token_ids"] == reference(tokens, max_tokens)
    assert body["logprobs"] is None
    assert 0 <= body["cached_tokens"] < length


def test_default_max_tokens_is_16(client: httpx.Client, reference):
    tokens = prompt(20, seed=3)
    body = client.post("/draft", json={"token_ids": tokens}).json()
    assert body["draft_token_ids"] == reference(tokens, 16)


def test_logprobs_match_the_drafter(client: httpx.Client, reference):
    tokens = prompt(50, seed=5)
    body = client.post("/draft", json={"token_ids": tokens, "max_tokens": 8, "return_logprobs": True}).json()
    expected = reference(tokens, 8, return_logprobs=True)
    assert body["draft_token_ids"] == expected
    assert body["logprobs"] == pytest.approx(expected.logprobs, abs=1e-4)


def test_min_confidence_shortens_drafts_and_is_validated(client: httpx.Client, reference):
    tokens = prompt(60, seed=950)
    sure_only = client.post("/draft", json={"token_ids": tokens, "max_tokens": 16, "min_confidence": 1.0})
    assert sure_only.json()["draft_token_ids"] == reference(tokens, 16)[:1]  # no token is certain: stop after one
    unlimited = client.post("/draft", json={"token_ids": tokens, "max_tokens": 16, "min_confidence": 0})
    assert unlimited.json()["draft_token_ids"] == reference(tokens, 16)
    refused = client.post("/draft", json={"token_ids": tokens, "min_confidence": 1.5})
    assert refused.status_code == 422 and "min_confidence" in refused.json()["detail"]


def test_hybrid_drafting_copies_long_repeats_and_is_validated(client: httpx.Client, reference):
    opening = prompt(40, seed=951)
    repeating = opening + prompt(10, seed=952) + opening[:6]  # ends in a 6-token n-gram seen at the start
    copied = client.post("/draft", json={"token_ids": repeating, "max_tokens": 8, "lookup_min_match": 4}).json()
    assert copied["draft_token_ids"] == opening[6:14] and copied["source"] == "lookup"
    modelled = client.post(
        "/draft", json={"token_ids": repeating, "max_tokens": 8}
    ).json()  # this server's default: off
    assert modelled["draft_token_ids"] == reference(repeating, 8) and modelled["source"] == "model"
    no_repeat = prompt(40, seed=953)
    fallback = client.post("/draft", json={"token_ids": no_repeat, "max_tokens": 8, "lookup_min_match": 8}).json()
    assert fallback["draft_token_ids"] == reference(no_repeat, 8) and fallback["source"] == "model"
    refused = client.post("/draft", json={"token_ids": repeating, "lookup_min_match": 9})
    assert refused.status_code == 422 and "lookup_min_match" in refused.json()["detail"]


def test_follow_up_request_reuses_the_cached_prefix(client: httpx.Client, reference):
    first = prompt(120, seed=11)
    first_body = client.post("/draft", json={"token_ids": first, "max_tokens": 8}).json()
    follow_up = first + first_body["draft_token_ids"][:2] + [7]  # accepted drafts + a bonus token
    body = client.post("/draft", json={"token_ids": follow_up, "max_tokens": 8}).json()
    assert body["cached_tokens"] >= len(first)
    assert body["draft_token_ids"] == reference(follow_up, 8)


def test_64_concurrent_mixed_requests_batch_and_match(client: httpx.Client, live: RunningServer, reference):
    requests = [(prompt(1 + (i * 37) % 400, seed=1000 + i), 1 + i % 32) for i in range(64)]
    batches_before, singles_before = batch_size_counts(client)

    async def send_all() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=live.url, headers=AUTH, timeout=120, limits=limits) as http:
            return await asyncio.gather(
                *(http.post("/draft", json={"token_ids": t, "max_tokens": n}) for t, n in requests)
            )

    responses = asyncio.run(send_all())
    assert [r.status_code for r in responses] == [200] * 64, [r.text for r in responses if r.status_code != 200]
    for (tokens, max_tokens), response in zip(requests, responses, strict=True):
        assert response.json()["draft_token_ids"] == reference(tokens, max_tokens)
    batches_after, singles_after = batch_size_counts(client)
    batches, singles = batches_after - batches_before, singles_after - singles_before
    assert batches < 64 and singles < batches, f"{batches} batches, {singles} of size 1: no batching happened"


# ----------------------------------------------------------------------------- bad input

TOO_LONG = json.dumps({"token_ids": [1] * 513})

BAD_REQUESTS = [
    # (id, raw JSON body, headers beyond auth, status, words the detail must contain)
    ("missing token_ids", '{"max_tokens": 4}', {}, 422, ["token_ids", "Field required"]),
    ("token_ids not a list", '{"token_ids": "1 2 3"}', {}, 422, ["token_ids"]),
    ("string id", '{"token_ids": [1, "2"]}', {}, 422, ["token_ids.1", "integer"]),
    ("float id", '{"token_ids": [1, 2.5]}', {}, 422, ["token_ids.1"]),
    ("bool id", '{"token_ids": [true]}', {}, 422, ["token_ids.0"]),
    ("max_tokens 0", '{"token_ids": [1], "max_tokens": 0}', {}, 422, ["max_tokens", "greater than or equal to 1"]),
    (
        "max_tokens over cap",
        '{"token_ids": [1], "max_tokens": 65}',
        {},
        422,
        ["max_tokens", "less than or equal to 64"],
    ),
    ("unknown field", '{"token_ids": [1], "temperature": 0.7}', {}, 422, ["temperature", "Extra inputs"]),
    ("bad return_logprobs", '{"token_ids": [1], "return_logprobs": "yes"}', {}, 422, ["return_logprobs"]),
    ("invalid JSON", '{"token_ids": [1,', {}, 422, ["not valid JSON"]),
    ("JSON array body", "[1, 2, 3]", {}, 422, ["body"]),
    (
        "not JSON content type",
        '{"token_ids": [1]}',
        {"Content-Type": "text/plain"},
        422,
        ["Content-Type: application/json"],
    ),
    ("empty token_ids", '{"token_ids": []}', {}, 400, ["empty"]),
    ("id = vocab_size", '{"token_ids": [5, 256]}', {}, 400, ["token_ids[1] = 256", "0..255"]),
    ("negative id", '{"token_ids": [-1, 5]}', {}, 400, ["token_ids[0] = -1", "0..255"]),
    ("huge id", '{"token_ids": [1, 2, 99999999999999999999]}', {}, 400, ["token_ids[2]", "0..255"]),
    ("longer than context", TOO_LONG, {}, 400, ["513 tokens", "context limit is 512"]),
    ("body over limit", json.dumps({"token_ids": [1] * 30000}), {}, 413, ["65536"]),
    ("missing API key", '{"token_ids": [1]}', {"Authorization": ""}, 401, ["missing Authorization", "Bearer"]),
    ("wrong API key", '{"token_ids": [1]}', {"Authorization": "Bearer nope"}, 401, ["invalid API key"]),
    ("wrong auth scheme", '{"token_ids": [1]}', {"Authorization": f"Basic {API_KEY}"}, 401, ["invalid API key"]),
]


@pytest.mark.parametrize(
    "body,headers,status,words", [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
def test_bad_request_gets_clear_error_and_changes_nothing(live, client, reference, body, headers, status, words):
    sent_headers = {"Content-Type": "application/json", **AUTH, **headers}
    sent_headers = {name: value for name, value in sent_headers.items() if value}  # "" removes a header
    response = httpx.post(live.url + "/draft", content=body.encode(), headers=sent_headers, timeout=30)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    detail = response.json()["detail"]
    assert isinstance(detail, str)
    for word in words:
        assert word in detail
    assert "Traceback" not in detail
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
    assert_serves_correct_drafts(client, reference)


def test_out_of_vocabulary_ids_name_the_drafters_tokenizer():
    problem = server.token_ids_problem([1, 151644], 49152, 4096, "SmolLM2 token ids (vocab_size 49152)")
    assert "token_ids[1] = 151644" in problem and "0..49151" in problem and "SmolLM2 token ids" in problem
    assert server.token_ids_problem([1, 151644], 151936, 4096, "SmolLM2 token ids") is None


def test_chunked_body_over_limit_is_413(client: httpx.Client, reference):
    """No Content-Length (chunked upload): the limit still holds on the bytes actually received."""
    payload = json.dumps({"token_ids": [1] * 30000}).encode()

    def chunks():
        for start in range(0, len(payload), 8192):
            yield payload[start : start + 8192]

    response = client.post("/draft", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413, response.text
    assert "65536" in response.json()["detail"]
    assert_serves_correct_drafts(client, reference)


@pytest.mark.parametrize("method,path,status", [("GET", "/nope", 404), ("GET", "/draft", 405), ("PUT", "/health", 405)])
def test_unknown_routes_answer_json(client: httpx.Client, method: str, path: str, status: int):
    response = client.request(method, path)
    assert response.status_code == status
    assert response.json()["detail"]


def test_api_key_required_only_for_draft(live: RunningServer, reference):
    tokens = prompt(10, seed=1)
    without = httpx.post(live.url + "/draft", json={"token_ids": tokens}, timeout=30)
    assert without.status_code == 401
    with_key = httpx.post(live.url + "/draft", json={"token_ids": tokens}, headers=AUTH, timeout=30)
    assert with_key.status_code == 200
    assert with_key.json()["draft_token_ids"] == reference(tokens, 16)
    assert httpx.get(live.url + "/metrics", timeout=10).status_code == 200


def test_disconnecting_clients_do_not_break_their_batch(client: httpx.Client, live: RunningServer, reference):
    requests = [(prompt(200 + i, seed=500 + i), 64) for i in range(8)]

    async def send_and_abandon() -> list:
        async with (
            httpx.AsyncClient(base_url=live.url, headers=AUTH, timeout=120) as patient,
            httpx.AsyncClient(base_url=live.url, headers=AUTH, timeout=0.02) as impatient,
        ):
            kept = [patient.post("/draft", json={"token_ids": t, "max_tokens": n}) for t, n in requests[::2]]
            dropped = [impatient.post("/draft", json={"token_ids": t, "max_tokens": n}) for t, n in requests[1::2]]
            return await asyncio.gather(*kept, *dropped, return_exceptions=True)

    results = asyncio.run(send_and_abandon())
    for (tokens, max_tokens), response in zip(requests[::2], results[:4], strict=True):
        assert response.status_code == 200, response
        assert response.json()["draft_token_ids"] == reference(tokens, max_tokens)
    assert_serves_correct_drafts(client, reference)


def test_clients_that_hang_up_while_queued_are_not_drafted(repo_root, tiny_checkpoint, reference, tmp_path):
    """Behind four one-at-a-time 64-token drafts, a client that gives up after 20 ms is still queued."""
    running = start_server(
        repo_root, tiny_checkpoint, tmp_path / "server.log", "--max-batch-size", "1", "--max-wait-ms", "0"
    )
    try:
        patient_requests = [(prompt(300, seed=700 + i), 64) for i in range(4)]

        async def send() -> list:
            async with (
                httpx.AsyncClient(base_url=running.url, timeout=120) as patient,
                httpx.AsyncClient(base_url=running.url, timeout=0.02) as impatient,
            ):
                kept = [
                    asyncio.create_task(patient.post("/draft", json={"token_ids": t, "max_tokens": n}))
                    for t, n in patient_requests
                ]
                await asyncio.sleep(0.005)  # the impatient ones queue behind the patient ones
                dropped = [impatient.post("/draft", json={"token_ids": prompt(50, seed=800 + i)}) for i in range(3)]
                return await asyncio.gather(*kept, *dropped, return_exceptions=True)

        results = asyncio.run(send())
        for (tokens, max_tokens), response in zip(patient_requests, results[:4], strict=True):
            assert response.json()["draft_token_ids"] == reference(tokens, max_tokens)
        assert all(isinstance(r, httpx.TimeoutException) for r in results[4:])
        with httpx.Client(base_url=running.url, timeout=30) as client:
            samples = metric_samples(client.get("/metrics").text)
        assert samples[("draft_server_requests_total", (("endpoint", "/draft"), ("status", "499")))] == 3
        assert samples[("draft_server_batch_size_count", ())] == 4, "only the patient requests were drafted"
    finally:
        stop_server(running)


def test_metrics_count_requests_by_status_and_cached_tokens(client: httpx.Client):
    tokens = prompt(40, seed=900)
    client.post("/draft", json={"token_ids": tokens})
    client.post("/draft", json={"token_ids": tokens + [5, 6, 7]})  # a follow-up: served from the cache
    client.post("/draft", json={"token_ids": []})
    samples = metric_samples(client.get("/metrics").text)
    assert samples[("draft_server_requests_total", (("endpoint", "/draft"), ("status", "200")))] > 0
    assert samples[("draft_server_requests_total", (("endpoint", "/draft"), ("status", "400")))] > 0
    assert samples[("draft_server_cached_tokens_total", ())] > 0
    assert 0 < samples[("draft_server_cached_token_ratio", ())] < 1
    assert samples[("draft_server_queue_depth", ())] == 0
    assert samples[("draft_server_request_latency_seconds_count", (("endpoint", "/draft"),))] > 0


# ----------------------------------------------------------------------------- overload and shutdown


def test_flood_beyond_the_queue_gets_503_not_hangs(repo_root, tiny_checkpoint, reference, tmp_path):
    """One request drafts while one waits; everything else that arrives meanwhile must be refused at once."""
    running = start_server(
        repo_root, tiny_checkpoint, tmp_path / "server.log", "--max-queue", "1", "--max-batch-size", "1"
    )
    requests = [(prompt(300, seed=2000 + i), 64) for i in range(48)]

    async def flood() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=running.url, timeout=60, limits=limits) as http:
            return await asyncio.gather(
                *(http.post("/draft", json={"token_ids": t, "max_tokens": n}) for t, n in requests)
            )

    try:
        responses = asyncio.run(flood())
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(503) > 0 and statuses.count(200) > 0, statuses
        for (tokens, max_tokens), response in zip(requests, responses, strict=True):
            if response.status_code == 503:
                assert response.headers["retry-after"] == "1"
                assert "queue is full" in response.json()["detail"]
            else:
                assert response.json()["draft_token_ids"] == reference(tokens, max_tokens)
        tokens = prompt(40, seed=1)
        after = httpx.post(running.url + "/draft", json={"token_ids": tokens}, timeout=30)
        assert after.status_code == 200 and after.json()["draft_token_ids"] == reference(tokens, 16)
    finally:
        stop_server(running)
    assert running.process.returncode == 0, running.log()


def test_sigterm_under_load_finishes_queued_requests_and_exits_0(repo_root, tiny_checkpoint, reference, tmp_path):
    running = start_server(repo_root, tiny_checkpoint, tmp_path / "server.log", "--max-batch-size", "1")
    requests = [(prompt(200 + i, seed=3000 + i), 64) for i in range(32)]

    async def load_then_sigterm() -> tuple[list[httpx.Response], int]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=running.url, timeout=120, limits=limits) as http:
            tasks = [
                asyncio.create_task(http.post("/draft", json={"token_ids": t, "max_tokens": n})) for t, n in requests
            ]
            # Signal once every request has reached the server (queued, drafting or answered) and some still wait.
            while True:
                depth = (await http.get("/health")).json()["queue_depth"]
                answered = sum(task.done() for task in tasks)
                if depth + answered >= len(tasks) - 1:  # at most one more is being drafted
                    break
                await asyncio.sleep(0.005)
            running.process.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks), depth

    try:
        responses, depth_at_signal = asyncio.run(load_then_sigterm())
        assert depth_at_signal > 0, "the queue had drained before SIGTERM; the test proved nothing"
        assert [r.status_code for r in responses] == [200] * len(requests)
        for (tokens, max_tokens), response in zip(requests, responses, strict=True):
            assert response.json()["draft_token_ids"] == reference(tokens, max_tokens)
        assert running.process.wait(timeout=30) == 0, running.log()
    finally:
        stop_server(running)
    assert "all queued requests answered" in running.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(running.url + "/health", timeout=5)


# ----------------------------------------------------------------------------- batcher in-process


def in_process_drafting(model_dir: Path) -> server.DraftFn:
    """The draft function the server's batcher calls, on an fp32 drafter in this process."""
    drafter = draft_model.load_model(model_dir, "cpu", "float32", cache_slots=8)
    return lambda batch, max_tokens, min_confidence, lookup_min_match, return_logprobs: draft_model.draft_batch(
        drafter, batch, max_tokens, return_logprobs, min_confidence=min_confidence, lookup_min_match=lookup_min_match
    )


def test_a_failing_batch_fails_only_its_requests(tiny_checkpoint: Path, reference):
    """An exception inside draft_batch (here: an id the HTTP layer would have refused) fails that batch only."""
    draft_fn = in_process_drafting(tiny_checkpoint)

    async def scenario():
        batcher = server.Batcher(draft_fn, max_batch_size=4, max_wait_ms=50, max_queue=8, metrics=server.Metrics(4))
        batcher.start()
        poisoned = [batcher.submit([1, 2, 999], 4, 0.0, 0, False), batcher.submit([1, 2, 3], 4, 0.0, 0, False)]
        failures = await asyncio.gather(*poisoned, return_exceptions=True)
        healthy = await batcher.submit([1, 2, 3], 4, 0.0, 0, False)
        await batcher.stop()
        return failures, healthy, batcher.metrics

    failures, healthy, metrics = asyncio.run(scenario())
    for failure in failures:
        assert isinstance(failure, server.DraftFailed)
        assert "999" in str(failure) and "vocabulary" in str(failure)
    assert healthy == reference([1, 2, 3], 4)
    assert metrics.registry.get_sample_value("draft_server_failed_batches_total") == 1


def test_cancelled_requests_are_skipped_and_stop_drains_the_queue(tiny_checkpoint: Path, reference):
    draft_fn = in_process_drafting(tiny_checkpoint)

    async def scenario():
        batcher = server.Batcher(draft_fn, max_batch_size=2, max_wait_ms=20, max_queue=16, metrics=server.Metrics(2))
        batcher.start()
        futures = [batcher.submit(prompt(30, seed=i), 8, 0.0, 0, False) for i in range(9)]
        futures[1].cancel()  # a client that hung up while its request was queued
        futures[4].cancel()
        await batcher.stop()  # must answer everything still queued before returning
        with pytest.raises(server.Unavailable, match="shutting down"):
            batcher.submit([1], 1, 0.0, 0, False)
        return futures

    futures = asyncio.run(scenario())
    for i, future in enumerate(futures):
        if i in (1, 4):
            assert future.cancelled()
        else:
            assert future.result() == reference(prompt(30, seed=i), 8)


# ----------------------------------------------------------------------------- flags and the shipped package


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--max-batch-size", "8", "--cache-slots", "4"], "--cache-slots 4 is less than 2 x --max-batch-size"),
        (["--max-batch-size", "0"], "must be >= 1"),
        (["--port", "70000"], "must be in 0..65535"),
        (["--api-key-file", "/nonexistent/key"], "--api-key-file"),
        pytest.param(
            ["--device", "cuda"],
            "no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA"),
        ),
    ],
)
def test_bad_flags_exit_2_with_a_message(repo_root: Path, tiny_checkpoint: Path, flags: list[str], message: str):
    result = subprocess.run(
        [sys.executable, "server.py", "--model-dir", str(tiny_checkpoint), *flags],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_model_dir_without_config_is_refused(repo_root: Path, tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "server.py", "--model-dir", str(tmp_path)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "no config.json" in result.stderr


def test_serve_sh_maps_environment_to_flags(repo_root: Path, tiny_checkpoint: Path, api_key_file: Path, tmp_path: Path):
    """serve.sh as operators run it; only where .venv is this interpreter's (./run_tests.sh), so it installs nothing."""
    if Path(sys.prefix).resolve() != (repo_root / ".venv").resolve():
        pytest.skip("serve.sh runs the repository's .venv; run the suite with ./run_tests.sh to test it")
    port = free_port()
    env = {
        **os.environ,
        "MODEL_DIR": str(tiny_checkpoint),
        "PORT": str(port),
        "MAX_BATCH_SIZE": "4",
        "MAX_QUEUE": "7",
        "MAX_DRAFT_TOKENS": "8",
        "MAX_CONTEXT": "300",
        "THREADS": "1",
        "API_KEY_FILE": str(api_key_file),
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
        assert [limits[name] for name in ("max_batch_size", "max_queue", "max_draft_tokens", "max_context")] == [
            4,
            7,
            8,
            300,
        ]
        assert health["auth_required"] is True
        assert httpx.post(url + "/draft", json={"token_ids": [1]}, timeout=30).status_code == 401
    finally:
        process.send_signal(signal.SIGTERM)  # serve.sh execs the server, so this reaches it directly
        assert process.wait(timeout=30) == 0, log_path.read_text()


def test_unloadable_model_fails_startup_with_the_reason(repo_root: Path, tmp_path: Path):
    (tmp_path / "config.json").write_text((repo_root / "model" / "config.json").read_text())  # no weights
    port = str(free_port())
    result = subprocess.run(
        [sys.executable, "server.py", "--model-dir", str(tmp_path), "--port", port, "--threads", "1"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "cannot load the model" in result.stderr and "model.safetensors" in result.stderr


def test_shipped_model_package_serves_its_own_vocabulary(repo_root: Path, tmp_path: Path):
    """model/ is the distilled SmolLM2 drafter: SmolLM2 ids draft as draft_model drafts them in process;
    Qwen3 ids (the product target's tokenizer) get a 400 that names the drafter's vocabulary."""
    model_dir = repo_root / "model"
    running = start_server(repo_root, model_dir, tmp_path / "server.log")
    try:
        health = httpx.get(running.url + "/health", timeout=10).json()
        assert health["random_weights"] is False
        assert health["model"]["quantization"]["embedding_group_size"] == 32 and health["model"]["vocab_size"] == 49152
        smollm2_chat = [
            1,
            9690,
            198,
            2683,
            359,
            253,
            5356,
            5646,
            11173,
            3365,
            3511,
            308,
            34519,
            28,
            7018,
            411,
            407,
            19712,
            8182,
            2,
            198,
            1,
            4093,
            198,
        ]
        body = httpx.post(running.url + "/draft", json={"token_ids": smollm2_chat, "max_tokens": 8}, timeout=30).json()
        drafter = draft_model.load_model(model_dir, cache_slots=2)  # the server's defaults: device, dtype, weights auto
        assert body["draft_token_ids"] == draft_model.draft_batch(drafter, [smollm2_chat], max_tokens=8)[0]
        qwen3_chat = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
        refused = httpx.post(running.url + "/draft", json={"token_ids": qwen3_chat}, timeout=30)
        assert (
            refused.status_code == 400
            and "SmolLM2" in refused.json()["detail"]
            and "0..49151" in refused.json()["detail"]
        )
    finally:
        stop_server(running)
    assert "RANDOM WEIGHTS" not in running.log()


def test_shipped_model_is_what_architecture_json_records(repo_root: Path):
    record = json.loads((repo_root / "architecture.json").read_text())
    shipped = {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted((repo_root / "model").iterdir())
    }
    assert record["model_files_sha256"] == shipped
    assert record["measured_tau"]["runs"] and all(run["check"] == "passed" for run in record["measured_tau"]["runs"])


def test_make_random_package_is_reproducible(tmp_path: Path):
    for name in ("a", "b"):
        make_random_package.main(["--output", str(tmp_path / name), "--embedding-group-size", "32"])
    for name in ("model_int4.safetensors", "lora.safetensors"):
        first, second = load_file(tmp_path / "a" / name), load_file(tmp_path / "b" / name)
        assert first.keys() == second.keys() and all(first[key].equal(second[key]) for key in first), name
    assert draft_model.load_model(tmp_path / "a", cache_slots=2).model.embed_tokens is None
