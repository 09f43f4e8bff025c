"""The draft server over real HTTP: `python server.py` in a subprocess on a free loopback port, httpx clients.

Every expected draft comes from `draft_model.draft_batch` run in this process on the same weights, one
sequence at a time, so a test fails if batching, queueing or prefix reuse ever changes a draft.
"""

import asyncio
import functools
import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from live_server import RunningServer, metric_samples, prompt, start_server, stop_server

import draft_model
from batcher import Batcher, DraftFailed, DraftRequest, Unavailable, draft_requests, drafting_thread
from metrics import Metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

API_KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY_BYTES = 65536


def batch_size_counts(client: httpx.Client) -> tuple[float, float]:
    """(batches formed, batches of exactly one request) since the server started."""
    samples = metric_samples(client.get("/metrics").text)
    return samples[("draft_server_batch_size_count", ())], samples[("draft_server_batch_size_bucket", (("le", "1.0"),))]


# ----------------------------------------------------------------------------- fixtures


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
    assert response.json()["draft_token_ids"] == reference(tokens, max_tokens=12)


# ----------------------------------------------------------------------------- happy path


def test_health_describes_model_and_limits(live: RunningServer):
    health = httpx.get(live.url + "/health", timeout=10).json()  # no API key: /health stays open
    assert health["status"] == "ok"
    assert health["pid"] == live.process.pid
    assert health["replica"] == live.url.removeprefix("http://")
    assert health["model"]["architecture"] == "qwen3"
    assert health["model"]["vocab_size"] == 256
    assert health["limits"]["max_context"] == 512
    assert health["limits"]["max_body_bytes"] == MAX_BODY_BYTES
    assert health["auth_required"] is True
    assert health["random_weights"] is False
    assert "integrity unverified (no checksums.json)" in live.log(), "a plain checkpoint has no manifest"


def test_docs_and_openapi_are_served(live: RunningServer):
    docs = httpx.get(live.url + "/docs", timeout=10)
    assert docs.status_code == 200 and "cdn." not in docs.text  # offline too: the page's files come from the server
    assets = [path for path in docs.text.split('"') if path.endswith((".js", ".css"))]
    assert assets and all(httpx.get(live.url + path, timeout=10).status_code == 200 for path in assets)
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
    assert body["draft_token_ids"] == reference(tokens, max_tokens=16)


def test_logprobs_match_the_drafter(client: httpx.Client, reference):
    tokens = prompt(50, seed=5)
    body = client.post("/draft", json={"token_ids": tokens, "max_tokens": 8, "return_logprobs": True}).json()
    expected = reference(tokens, max_tokens=8, return_logprobs=True)
    assert body["draft_token_ids"] == expected
    assert body["logprobs"] == pytest.approx(expected.logprobs, abs=1e-4)


def test_min_confidence_shortens_drafts_and_is_validated(client: httpx.Client, reference):
    tokens = prompt(60, seed=950)
    sure_only = client.post("/draft", json={"token_ids": tokens, "max_tokens": 16, "min_confidence": 1.0})
    # No token is certain: the draft stops after one.
    assert sure_only.json()["draft_token_ids"] == reference(tokens, max_tokens=16)[:1]
    unlimited = client.post("/draft", json={"token_ids": tokens, "max_tokens": 16, "min_confidence": 0})
    assert unlimited.json()["draft_token_ids"] == reference(tokens, max_tokens=16)
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
    assert modelled["draft_token_ids"] == reference(repeating, max_tokens=8) and modelled["source"] == "model"
    no_repeat = prompt(40, seed=953)
    fallback = client.post("/draft", json={"token_ids": no_repeat, "max_tokens": 8, "lookup_min_match": 8}).json()
    assert fallback["draft_token_ids"] == reference(no_repeat, max_tokens=8) and fallback["source"] == "model"
    refused = client.post("/draft", json={"token_ids": repeating, "lookup_min_match": 9})
    assert refused.status_code == 422 and "lookup_min_match" in refused.json()["detail"]


def test_follow_up_request_reuses_the_cached_prefix(client: httpx.Client, reference):
    first = prompt(120, seed=11)
    first_body = client.post("/draft", json={"token_ids": first, "max_tokens": 8}).json()
    follow_up = first + first_body["draft_token_ids"][:2] + [7]  # accepted drafts + a bonus token
    body = client.post("/draft", json={"token_ids": follow_up, "max_tokens": 8}).json()
    assert body["cached_tokens"] >= len(first)
    assert body["draft_token_ids"] == reference(follow_up, max_tokens=8)


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
    ("id = vocab_size", '{"token_ids": [5, 256]}', {}, 400, ["token id 256 at position 1", "0..255"]),
    ("negative id", '{"token_ids": [-1, 5]}', {}, 400, ["token id -1 at position 0", "0..255"]),
    ("huge id", '{"token_ids": [1, 2, 99999999999999999999]}', {}, 400, ["at position 2", "0..255"]),
    ("longer than context", TOO_LONG, {}, 400, ["513 tokens", "context limit of 512", '"truncate": true']),
    ("truncate not a bool", '{"token_ids": [1], "truncate": 1}', {}, 422, ["truncate"]),
    ("min_confidence a bool", '{"token_ids": [1], "min_confidence": false}', {}, 422, ["min_confidence"]),
    ("session_id a number", '{"token_ids": [1], "session_id": 7}', {}, 422, ["session_id"]),
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
    assert response.headers["x-draft-replica"] == live.url.removeprefix("http://")  # refusals name the replica too
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
    assert_serves_correct_drafts(client, reference)


def test_out_of_vocabulary_ids_name_the_drafters_tokenizer():
    vocabulary = "SmolLM2 token ids (vocab_size 49152)"
    problem = draft_model.token_ids_problem([1, 151644], vocab_size=49152, max_context=4096, vocabulary=vocabulary)
    assert "token id 151644 at position 1" in problem and "0..49151" in problem and vocabulary in problem
    assert (
        draft_model.token_ids_problem([1, 151644], vocab_size=151936, max_context=4096, vocabulary=vocabulary) is None
    )


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
    assert with_key.json()["draft_token_ids"] == reference(tokens, max_tokens=16)
    assert httpx.get(live.url + "/metrics", timeout=10).status_code == 200


def test_disconnecting_clients_do_not_break_their_batch(client: httpx.Client, live: RunningServer, reference):
    requests = [(prompt(200 + i, seed=500 + i), 64) for i in range(8)]

    async def send_and_abandon() -> list:
        async with (
            httpx.AsyncClient(base_url=live.url, headers=AUTH, timeout=120) as patient,
            httpx.AsyncClient(base_url=live.url, headers=AUTH, timeout=httpx.Timeout(10, read=0.02)) as impatient,
        ):
            kept = [patient.post("/draft", json={"token_ids": t, "max_tokens": n}) for t, n in requests[::2]]
            dropped = [impatient.post("/draft", json={"token_ids": t, "max_tokens": n}) for t, n in requests[1::2]]
            return await asyncio.gather(*kept, *dropped, return_exceptions=True)

    results = asyncio.run(send_and_abandon())
    for (tokens, max_tokens), response in zip(requests[::2], results[:4], strict=True):
        assert response.status_code == 200, response
        assert response.json()["draft_token_ids"] == reference(tokens, max_tokens)
    assert_serves_correct_drafts(client, reference)


def test_clients_that_hang_up_while_queued_are_not_drafted(server, tiny_checkpoint, reference):
    """Behind four one-at-a-time 64-token drafts, a client that gives up 20 ms after sending is still queued
    (only the wait for the answer is that short: a slow connect on a loaded machine must not count)."""
    running = server(tiny_checkpoint, "--max-batch-size", "1", "--max-wait-ms", "0")
    patient_requests = [(prompt(300, seed=700 + i), 64) for i in range(4)]

    async def send() -> list:
        async with (
            httpx.AsyncClient(base_url=running.url, timeout=120) as patient,
            httpx.AsyncClient(base_url=running.url, timeout=httpx.Timeout(10, read=0.02)) as impatient,
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
        assert after.status_code == 200 and after.json()["draft_token_ids"] == reference(tokens, max_tokens=16)
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


def in_process_batcher(model_dir: Path, draft_fn=draft_requests, **limits) -> Batcher:
    """The server's batcher around an fp32 drafter in this process, loaded as the server loads it: on the
    drafting thread (call inside a running event loop)."""
    drafting = drafting_thread()
    drafter = drafting.submit(draft_model.load_model, model_dir, "cpu", "float32", cache_slots=8).result()
    settings = {"max_wait_ms": 20, "regroup_wait_ms": 0, "max_queue": 16, "queue_deadline_s": 60} | limits
    metrics = Metrics(settings["max_batch_size"])
    return Batcher(functools.partial(draft_fn, drafter), drafting, metrics=metrics, **settings)


def submit(batcher: Batcher, token_ids: list[int], max_tokens: int):
    request = DraftRequest(tuple(token_ids), max_tokens, min_confidence=0.0, lookup_min_match=0, return_logprobs=False)
    return batcher.submit(request)


def test_every_batch_is_drafted_on_the_thread_that_loaded_the_model(tiny_checkpoint: Path, reference, monkeypatch):
    """One thread runs torch in the server (batcher.drafting_thread): a second one would keep a second
    OpenMP pool, and libgomp's threads would then sleep between operators instead of spinning."""
    threads = {"load": [], "draft": []}
    load_model = draft_model.load_model

    def recording_load(*args, **kwargs):
        threads["load"].append(threading.get_ident())
        return load_model(*args, **kwargs)

    def recording_draft(drafter, requests):
        threads["draft"].append(threading.get_ident())
        return draft_requests(drafter, requests)

    async def scenario():
        batcher = in_process_batcher(tiny_checkpoint, recording_draft, max_batch_size=2, max_wait_ms=0)
        batcher.start()
        drafts = [await batcher.wait(submit(batcher, [1, 2, n], max_tokens=3)) for n in range(3, 6)]
        await batcher.stop()
        return drafts

    monkeypatch.setattr(draft_model, "load_model", recording_load)
    drafts = asyncio.run(scenario())
    [loaded_on] = threads["load"]
    assert threads["draft"] == [loaded_on] * 3 and loaded_on != threading.get_ident()
    assert drafts == [reference([1, 2, n], max_tokens=3) for n in range(3, 6)]


def test_a_failing_batch_fails_only_its_requests(tiny_checkpoint: Path, reference):
    """An exception inside draft_batch (here: an id the HTTP layer would have refused) fails that batch only."""

    async def scenario():
        batcher = in_process_batcher(tiny_checkpoint, max_batch_size=4, max_wait_ms=50)
        batcher.start()
        poisoned = [submit(batcher, [1, 2, 999], max_tokens=4), submit(batcher, [1, 2, 3], max_tokens=4)]
        failures = await asyncio.gather(*(batcher.wait(pending) for pending in poisoned), return_exceptions=True)
        healthy = await batcher.wait(submit(batcher, [1, 2, 3], max_tokens=4))
        await batcher.stop()
        return failures, healthy, batcher.metrics

    failures, healthy, metrics = asyncio.run(scenario())
    for failure in failures:
        assert isinstance(failure, DraftFailed)
        assert "999" in str(failure) and "vocabulary" in str(failure)
    assert healthy == reference([1, 2, 3], max_tokens=4)
    assert metrics.registry.get_sample_value("draft_server_failed_batches_total") == 1


def test_a_batch_waits_for_the_clients_of_the_previous_batch_but_not_forever(tiny_checkpoint: Path, reference):
    """Requests 50 ms apart, past max_wait_ms: they still share a batch while it holds fewer than the previous
    batch did (regroup_wait_ms), and once that wait is over the batch goes without them."""

    async def scenario():
        batcher = in_process_batcher(tiny_checkpoint, max_batch_size=4, max_wait_ms=5, regroup_wait_ms=400)
        batcher.start()
        sizes = batcher.metrics.registry.get_sample_value

        async def arrive(seeds: list[int], apart_s: float) -> list:
            queued = []
            for seed in seeds:
                queued.append(submit(batcher, prompt(20, seed=seed), max_tokens=4))
                await asyncio.sleep(apart_s)
            return await asyncio.gather(*(batcher.wait(pending) for pending in queued))

        together = await arrive([1, 2, 3], apart_s=0)  # one batch of 3
        regrouped = await arrive([4, 5, 6], apart_s=0.05)  # 50 ms apart: one batch of 3 again
        counts = [sizes("draft_server_batch_size_count"), sizes("draft_server_batch_size_sum")]
        late = await arrive([7, 8], apart_s=0.6)  # past the 400 ms regroup wait: a batch each
        counts += [sizes("draft_server_batch_size_count"), sizes("draft_server_batch_size_sum")]
        await batcher.stop()
        return together + regrouped + late, counts

    drafts, counts = asyncio.run(scenario())
    assert counts == [2, 6, 4, 8]
    assert drafts == [reference(prompt(20, seed=seed), max_tokens=4) for seed in range(1, 9)]


def test_cancelled_requests_are_skipped_and_stop_drains_the_queue(tiny_checkpoint: Path, reference):
    async def scenario():
        batcher = in_process_batcher(tiny_checkpoint, max_batch_size=2)
        batcher.start()
        queued = [submit(batcher, prompt(30, seed=i), max_tokens=8) for i in range(9)]
        queued[1].future.cancel()  # a client that hung up while its request was queued
        queued[4].future.cancel()
        await batcher.stop()  # must answer everything still queued before returning
        with pytest.raises(Unavailable, match="draining"):
            submit(batcher, [1], max_tokens=1)
        return [pending.future for pending in queued], batcher.metrics

    futures, metrics = asyncio.run(scenario())
    for i, future in enumerate(futures):
        if i in (1, 4):
            assert future.cancelled()
        else:
            assert future.result() == reference(prompt(30, seed=i), max_tokens=8)
    assert metrics.registry.get_sample_value("draft_server_batch_size_sum") == 7, "the cancelled two were drafted"


def test_a_request_queued_past_the_deadline_is_refused_and_counted(tiny_checkpoint: Path, reference):
    """A batch that drafts for longer than the deadline: the request queued behind it gets Unavailable, and
    the one in the batch still gets its draft (the deadline never abandons work already started)."""

    async def scenario():
        batcher = in_process_batcher(tiny_checkpoint, max_batch_size=1, max_wait_ms=0, queue_deadline_s=0.05)
        slow_draft_fn = batcher.draft_fn
        batcher.draft_fn = lambda *args: (time.sleep(0.3), slow_draft_fn(*args))[1]
        batcher.start()
        drafting = submit(batcher, [1, 2, 3], max_tokens=4)
        await asyncio.sleep(0.01)  # the first request is taken into a batch
        queued = submit(batcher, [4, 5, 6], max_tokens=4)
        outcomes = await asyncio.gather(batcher.wait(drafting), batcher.wait(queued), return_exceptions=True)
        await batcher.stop()
        return outcomes, batcher.metrics

    (drafted, refused), metrics = asyncio.run(scenario())
    assert drafted == reference([1, 2, 3], max_tokens=4)
    assert isinstance(refused, Unavailable) and "--queue-deadline-s" in str(refused)
    assert metrics.registry.get_sample_value("draft_server_queue_deadline_expired_total") == 1
    assert metrics.registry.get_sample_value("draft_server_batch_size_count") == 1, "the refused one was drafted"


def test_requests_sharing_a_batch_each_keep_their_own_options(tiny_checkpoint: Path, reference):
    """One batch of three requests with different max_tokens, lookup_min_match and return_logprobs: each
    draft is the one that request gets alone."""
    opening = prompt(40, seed=960)
    repeating = opening + prompt(10, seed=961) + opening[:6]  # ends in a 6-token n-gram seen at the start
    plain = prompt(30, seed=962)
    requests = [
        DraftRequest(tuple(plain), 3, min_confidence=0.0, lookup_min_match=0, return_logprobs=False),
        DraftRequest(tuple(repeating), 8, min_confidence=0.0, lookup_min_match=4, return_logprobs=False),
        DraftRequest(tuple(plain), 6, min_confidence=0.0, lookup_min_match=0, return_logprobs=True),
    ]

    async def scenario():
        batcher = in_process_batcher(tiny_checkpoint, max_batch_size=4, max_wait_ms=200)
        batcher.start()
        queued = [batcher.submit(request) for request in requests]
        drafts = await asyncio.gather(*(batcher.wait(pending) for pending in queued))
        await batcher.stop()
        return drafts, batcher.metrics

    (short, copied, with_logprobs), metrics = asyncio.run(scenario())
    assert metrics.registry.get_sample_value("draft_server_batch_size_count") == 1, "not drafted as one batch"
    assert short == reference(plain, max_tokens=3) and short.source == "model"
    assert copied == opening[6:14] and copied.source == "lookup"
    expected = reference(plain, max_tokens=6, return_logprobs=True)
    assert with_logprobs == expected
    assert with_logprobs.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
