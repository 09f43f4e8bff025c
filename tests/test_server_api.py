"""The API a router, a harness or an engine uses, over real HTTP on loopback: the replica header, /health while
draining, session_id, POST /draft/batch, truncate, the queue deadline, and an OpenAPI schema that tells the
truth (checked by schemathesis against the live server)."""

import asyncio
import re
import signal
import subprocess
import sys

import httpx
import pytest
from live_server import metric_samples, prompt, start_server, stop_server

import server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT = 512  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(scope="module")
def live(repo_root, tiny_checkpoint, tmp_path_factory):
    running = start_server(repo_root, tiny_checkpoint, tmp_path_factory.mktemp("api") / "server.log")
    yield running
    stop_server(running)
    assert running.process.returncode == 0 and "Traceback" not in running.log(), running.log()


@pytest.fixture
def client(live):
    with httpx.Client(base_url=live.url, timeout=60) as http:
        yield http


def replica_of(url: str) -> str:
    return url.removeprefix("http://")


@pytest.mark.parametrize("method,path", [("GET", "/health"), ("GET", "/metrics"), ("GET", "/nope"), ("POST", "/draft")])
def test_every_response_names_the_replica(client, live, method: str, path: str):
    response = client.request(method, path, json={"token_ids": [1, 2, 3]} if method == "POST" else None)
    assert response.headers["x-draft-replica"] == replica_of(live.url)


def test_health_has_the_process_id(client, live):
    assert client.get("/health").json()["pid"] == live.process.pid


def test_session_id_is_accepted_and_changes_nothing(client, reference):
    tokens = prompt(40, seed=41)
    body = client.post("/draft", json={"token_ids": tokens, "max_tokens": 8, "session_id": "conversation-7"}).json()
    assert body["draft_token_ids"] == reference(tokens, max_tokens=8)


def test_batch_answers_every_item_in_order_with_its_own_status(client, reference):
    first, second, long_one = prompt(30, seed=1), prompt(50, seed=2), prompt(CONTEXT + 188, seed=3)
    items = [
        {"token_ids": first, "max_tokens": 8},
        {"token_ids": [1, 256]},  # outside the vocabulary
        {"token_ids": long_one},  # longer than the context, without truncate
        {"token_ids": long_one, "max_tokens": 16, "truncate": True},
        {"token_ids": second, "max_tokens": 4, "session_id": "s", "return_logprobs": True},
        {"token_ids": []},
    ]
    response = client.post("/draft/batch", json={"items": items})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [result["status"] for result in results] == [200, 400, 400, 200, 200, 400]
    assert results[0]["draft"]["draft_token_ids"] == reference(first, max_tokens=8)
    assert "token id 256 at position 1" in results[1]["detail"] and results[1]["draft"] is None
    assert "context limit of 512" in results[2]["detail"] and '"truncate": true' in results[2]["detail"]
    truncated = results[3]["draft"]["truncated_tokens"]
    assert results[3]["draft"]["draft_token_ids"] == reference(long_one[truncated:], max_tokens=16)
    assert results[4]["draft"]["draft_token_ids"] == reference(second, max_tokens=4)
    assert len(results[4]["draft"]["logprobs"]) == len(results[4]["draft"]["draft_token_ids"])
    assert "empty" in results[5]["detail"]


@pytest.mark.parametrize(
    "body,words",
    [
        ({"items": []}, ["items", "at least 1"]),
        ({"items": [{"token_ids": [1], "max_tokens": 0}]}, ["items.0.max_tokens"]),
        ({"items": [{"token_ids": [1]}] * 257}, ["items", "at most 256"]),
        ({"token_ids": [1]}, ["items", "Field required"]),
    ],
    ids=["no items", "an item off the schema", "more items than the queue holds", "not a batch"],
)
def test_a_batch_off_the_schema_is_refused_whole(client, body: dict, words: list[str]):
    response = client.post("/draft/batch", json=body)
    assert response.status_code == 422
    for word in words:
        assert word in response.json()["detail"]


def test_truncate_keeps_the_most_recent_tokens_and_later_turns_reuse_the_cache(client, reference):
    conversation = prompt(CONTEXT + 188, seed=77)
    first = client.post("/draft", json={"token_ids": conversation, "max_tokens": 16, "truncate": True}).json()
    start = first["truncated_tokens"]
    assert start == server.kept_tokens(conversation, max_context=CONTEXT, max_tokens=16) > 0
    assert len(conversation) - start <= CONTEXT - 16, "the draft must have room"
    assert first["draft_token_ids"] == reference(conversation[start:], max_tokens=16)
    next_turn = conversation + first["draft_token_ids"][:3] + [9]
    second = client.post("/draft", json={"token_ids": next_turn, "max_tokens": 16, "truncate": True}).json()
    assert second["truncated_tokens"] == start, "the window moves in quarter-context steps, not per token"
    # Reuse comes in the engine's chunks: most of the kept conversation, not necessarily all of it.
    assert second["cached_tokens"] >= (len(conversation) - start) // 2
    assert second["draft_token_ids"] == reference(next_turn[start:], max_tokens=16)


def test_truncate_leaves_a_short_conversation_whole(client, reference):
    tokens = prompt(100, seed=78)
    body = client.post("/draft", json={"token_ids": tokens, "truncate": True}).json()
    assert body["truncated_tokens"] == 0 and body["draft_token_ids"] == reference(tokens, max_tokens=16)


def test_openapi_states_the_loaded_models_limits(client):
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    token_ids = schema["DraftRequest"]["properties"]["token_ids"]
    assert token_ids["items"] == {"type": "integer", "minimum": 0, "maximum": 255} and token_ids["minItems"] == 1
    assert schema["DraftRequest"]["else"]["properties"]["token_ids"]["maxItems"] == CONTEXT
    example = token_ids["examples"][0]
    assert client.post("/draft", json={"token_ids": example}).status_code == 200, "the example must be valid"
    assert schema["DraftRequest"]["properties"]["max_tokens"]["maximum"] == 64


def run_schemathesis(url: str, max_examples: int, tmp_path) -> str:
    """schemathesis with all its checks (positive and negative data included) against the live schema."""
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "all"]
    command += ["--max-examples", str(max_examples), "--seed", "15", "--generation-database", "none", "--no-color"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    return result.stdout


def generated_and_passed(output: str) -> tuple[int, int]:
    summary = re.search(r"(\d+) generated, (\d+) passed", output)
    assert summary, output[-3000:]
    return int(summary.group(1)), int(summary.group(2))


def test_schemathesis_finds_nothing(live, tmp_path):
    generated, passed = generated_and_passed(run_schemathesis(live.url, max_examples=40, tmp_path=tmp_path))
    assert generated == passed >= 100


@pytest.mark.slow
def test_schemathesis_finds_nothing_in_500_cases(live, tmp_path):
    generated, passed = generated_and_passed(run_schemathesis(live.url, max_examples=300, tmp_path=tmp_path))
    assert generated == passed >= 500


# ----------------------------------------------------------------------------- overload and draining


def send_concurrently(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=64)) as http:
            return await asyncio.gather(*(http.post("/draft", json=body) for body in bodies))

    return asyncio.run(send())


def test_requests_queued_past_the_deadline_get_503_and_are_counted(server, tiny_checkpoint, reference):
    running = server(tiny_checkpoint, "--max-batch-size", "1", "--max-wait-ms", "0", "--queue-deadline-s", "0.2")
    bodies = [{"token_ids": prompt(300, seed=4000 + i), "max_tokens": 64} for i in range(12)]
    responses = send_concurrently(running.url, bodies)
    statuses = [response.status_code for response in responses]
    assert set(statuses) == {200, 503}, statuses
    for body, response in zip(bodies, responses, strict=True):
        if response.status_code == 503:
            assert response.headers["retry-after"] == "1" and "--queue-deadline-s" in response.json()["detail"]
        else:
            assert response.json()["draft_token_ids"] == reference(body["token_ids"], max_tokens=64)
    samples = metric_samples(httpx.get(running.url + "/metrics", timeout=10).text)
    assert samples[("draft_server_queue_deadline_expired_total", ())] == statuses.count(503)


def test_sigterm_drains_health_503_new_work_503_queued_work_answered_exit_0(server, tiny_checkpoint, reference):
    running = server(tiny_checkpoint, "--max-batch-size", "1", "--drain-seconds", "2")
    bodies = [{"token_ids": prompt(200 + i, seed=5000 + i), "max_tokens": 32} for i in range(8)]

    async def load_then_sigterm():
        async with httpx.AsyncClient(base_url=running.url, timeout=120) as http:
            tasks = [asyncio.create_task(http.post("/draft", json=body)) for body in bodies]
            while (await http.get("/health")).json()["queue_depth"] + sum(t.done() for t in tasks) < len(tasks) - 1:
                await asyncio.sleep(0.005)
            running.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)  # the signal is handled between two event-loop steps
            health = await http.get("/health")
            refused = await http.post("/draft", json={"token_ids": [1, 2, 3]})
            return await asyncio.gather(*tasks), health, refused

    responses, health, refused = asyncio.run(load_then_sigterm())
    assert health.status_code == 503 and "draining" in health.json()["detail"]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "draining" in refused.json()["detail"]
    assert [response.status_code for response in responses] == [200] * len(bodies)
    for body, response in zip(bodies, responses, strict=True):
        assert response.json()["draft_token_ids"] == reference(body["token_ids"], max_tokens=32)
    assert running.process.wait(timeout=30) == 0, running.log()
    assert "draining" in running.log() and "Traceback" not in running.log()
