"""vllm_proposer.DraftServerProposer without vLLM (the end-to-end run inside vLLM is tests/test_vllm_engine.py):
called the way vLLM 0.32 calls it, against the real server on loopback, and against a loopback server that
misbehaves in each way the API could (5xx, garbage, drafts too long or outside the vocabulary, no answer)."""

import http.server
import json
import logging
import socket
import threading
import time

import numpy as np
import pytest
from live_server import free_port, prompt, start_server, stop_server

import vllm_proposer
from vllm_proposer import DraftServerProposer, ProposerConfigError, ProposerSettings, plan_draft_lengths

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 256  # the tiny checkpoint's
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def live(repo_root, tiny_checkpoint, tmp_path_factory):
    running = start_server(repo_root, tiny_checkpoint, tmp_path_factory.mktemp("proposer") / "server.log")
    yield running
    stop_server(running)


def proposer_for(url: str, k: int = 8, adaptive: bool = False, timeout_s: float = 30.0, vocab: int = VOCAB):
    settings = ProposerSettings(url=url, timeout_s=timeout_s, adaptive=adaptive)
    return DraftServerProposer.standalone(k, vocab, MAX_MODEL_LEN, settings)


class Batch:
    """vLLM's view of running requests: token_ids_cpu rows (int32, as vLLM keeps them), their committed lengths
    and what each got in the last step."""

    def __init__(self, rows: list[list[int]]):
        self.token_ids = np.zeros((len(rows), MAX_MODEL_LEN), dtype=np.int32)
        self.lengths = np.array([len(row) for row in rows], dtype=np.int32)
        for index, row in enumerate(rows):
            self.token_ids[index, : len(row)] = row
        self.sampled = [[row[-1]] for row in rows]  # each request has just been prefilled and sampled once

    def row(self, index: int) -> list[int]:
        return self.token_ids[index, : self.lengths[index]].tolist()

    def propose(self, proposer: DraftServerProposer) -> list[list[int]]:
        return proposer.propose(self.sampled, self.lengths, self.token_ids)

    def commit(self, index: int, tokens: list[int]) -> None:
        start = self.lengths[index]
        self.token_ids[index, start : start + len(tokens)] = tokens
        self.lengths[index] += len(tokens)
        self.sampled[index] = list(tokens)


def test_drafts_are_the_servers_drafts_in_row_order(live, reference):
    rows = [prompt(30, seed=1), prompt(45, seed=2), prompt(12, seed=3)]
    batch = Batch(rows)
    batch.sampled[1] = []  # a request in a prefill chunk gets no draft
    drafts = batch.propose(proposer_for(live.url))
    assert drafts[0] == list(reference(rows[0], max_tokens=8))
    assert drafts[1] == []
    assert drafts[2] == list(reference(rows[2], max_tokens=8))


def test_a_request_near_max_model_len_gets_only_what_fits(live, reference):
    row = prompt(MAX_MODEL_LEN - 4, seed=5)
    drafts = Batch([row]).propose(proposer_for(live.url))
    assert drafts == [list(reference(row, max_tokens=3))]


def test_a_vocabulary_mismatch_is_refused_at_start_naming_both_sizes(live):
    with pytest.raises(ProposerConfigError, match=r"vocabulary of 256 tokens and the target 300"):
        proposer_for(live.url, vocab=300)


@pytest.mark.parametrize(
    "name,value,problem",
    [
        ("DRAFT_SERVER_TIMEOUT_S", "soon", "must be a number of seconds"),
        ("DRAFT_SERVER_TIMEOUT_S", "0", "must be above 0"),
        ("DRAFT_SERVER_ADAPTIVE", "yes", "must be 0 or 1"),
        ("DRAFT_SERVER_MIN_CONFIDENCE", "1.5", r"must be a number in \[0, 1\]"),
        ("DRAFT_SERVER_API_KEY_FILE", "/nonexistent/key", "cannot be read"),
    ],
)
def test_bad_settings_are_refused_in_one_line(name, value, problem):
    with pytest.raises(ProposerConfigError, match=problem) as refused:
        ProposerSettings.from_environment({name: value})
    assert name in str(refused.value) and "\n" not in str(refused.value)


def test_an_unreachable_server_gives_no_drafts_one_line_and_probes_with_backoff(caplog):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger=vllm_proposer.log.name):
        proposer = proposer_for(url, timeout_s=0.5)
        batch = Batch([prompt(20, seed=1), prompt(20, seed=2)])
        started = time.monotonic()
        for _ in range(20):
            assert batch.propose(proposer) == [[], []]
        elapsed = time.monotonic() - started
    assert elapsed < 1.0  # within the backoff, a step does not even try
    assert proposer.stats["failed_calls"] == 1
    assert len(caplog.records) == 1 and "no drafts for 0.5 s" in caplog.records[0].getMessage()


def test_drafting_resumes_when_the_server_comes_back(repo_root, tiny_checkpoint, tmp_path, reference):
    port = free_port()
    proposer = proposer_for(f"http://127.0.0.1:{port}", timeout_s=5.0)
    row = prompt(25, seed=9)
    assert Batch([row]).propose(proposer) == [[]]
    running = start_server(repo_root, tiny_checkpoint, tmp_path / "server.log", port=port)
    try:
        time.sleep(vllm_proposer.BACKOFF_FIRST_S * 4)  # past the backoff
        assert Batch([row]).propose(proposer) == [list(reference(row, max_tokens=8))]
    finally:
        stop_server(running)
    assert Batch([row]).propose(proposer) == [[]]  # stopped again: fails closed


class Misbehaving(http.server.BaseHTTPRequestHandler):
    """A loopback server whose /health is right and whose /draft/batch answers with `self.server.answer`."""

    def do_GET(self):
        self.reply(200, json.dumps({"status": "ok", "limits": self.server.limits}).encode())

    def do_POST(self):
        items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
        status, body = self.server.answer(items)
        self.reply(status, body)

    def reply(self, status: int, body: bytes):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def draft_results(items, draft_of) -> bytes:
    return json.dumps(
        {"results": [{"status": 200, "draft": {"draft_token_ids": draft_of(item)}} for item in items]}
    ).encode()


ANSWERS = {
    "status 503": lambda items: (503, b'{"detail": "the draft queue is full"}'),
    "not JSON": lambda items: (200, b"<html>proxy error</html>"),
    "results missing": lambda items: (200, b'{"drafts": []}'),
    "one result for two items": lambda items: (200, draft_results(items[:1], lambda item: [1])),
    "status 400 item": lambda items: (
        200,
        json.dumps({"results": [{"status": 400, "detail": "bad"}] * len(items)}).encode(),
    ),
    "longer than asked": lambda items: (200, draft_results(items, lambda item: [1] * (item["max_tokens"] + 1))),
    "id outside the vocabulary": lambda items: (200, draft_results(items, lambda item: [VOCAB])),
    "negative id": lambda items: (200, draft_results(items, lambda item: [-1])),
    "not integers": lambda items: (200, draft_results(items, lambda item: ["1", 2.5])),
}


@pytest.fixture
def misbehaving():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    server.limits = {"vocab_size": VOCAB, "max_context": MAX_MODEL_LEN, "max_draft_tokens": 64, "max_queue": 256}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("fault", sorted(ANSWERS))
def test_a_bad_answer_gives_no_draft_and_one_log_line(misbehaving, fault, caplog):
    misbehaving.answer = ANSWERS[fault]
    proposer = proposer_for(f"http://127.0.0.1:{misbehaving.server_port}")
    with caplog.at_level(logging.WARNING, logger=vllm_proposer.log.name):
        assert Batch([prompt(10, seed=1), prompt(10, seed=2)]).propose(proposer) == [[], []]
    assert len(caplog.records) == 1, [record.getMessage() for record in caplog.records]


def test_a_server_that_does_not_answer_costs_one_timeout(misbehaving):
    def hang(items):
        time.sleep(2)
        return 200, draft_results(items, lambda item: [1])

    misbehaving.answer = hang
    proposer = proposer_for(f"http://127.0.0.1:{misbehaving.server_port}", timeout_s=0.2)
    batch = Batch([prompt(10, seed=1)])
    started = time.monotonic()
    for _ in range(5):
        assert batch.propose(proposer) == [[]]
    assert time.monotonic() - started < 1.0


def test_only_a_good_item_is_drafted_when_its_neighbour_is_bad(misbehaving):
    misbehaving.answer = lambda items: (
        200,
        draft_results(items, lambda item: [7] if item["token_ids"][0] == 1 else [VOCAB]),
    )
    proposer = proposer_for(f"http://127.0.0.1:{misbehaving.server_port}")
    assert Batch([[1, 2, 3], [2, 3, 4]]).propose(proposer) == [[7], []]


def test_a_vocabulary_mismatch_found_later_never_drafts(misbehaving):
    misbehaving.answer = lambda items: (200, draft_results(items, lambda item: [1]))
    misbehaving.limits = misbehaving.limits | {"vocab_size": VOCAB + 1}
    with socket.socket() as closed:  # the server is down at start, so the check waits for it
        closed.bind(("127.0.0.1", 0))
        proposer = proposer_for(f"http://127.0.0.1:{closed.getsockname()[1]}")
    proposer.client.base_url = f"http://127.0.0.1:{misbehaving.server_port}"
    time.sleep(vllm_proposer.BACKOFF_FIRST_S * 2)
    assert Batch([prompt(10, seed=1)]).propose(proposer) == [[]]
    assert proposer.stats["calls"] == 0


# ----------------------------------------------------------------------------- adaptive draft length


def run_steps(proposer, batch: Batch, steps: int, accept_all: bool, target_s: float) -> list[list[int]]:
    """Play the target: it commits the whole draft (accept_all) or none of it, plus a bonus token."""
    lengths = []
    for step in range(steps):
        drafts = batch.propose(proposer)
        lengths.append([len(draft) for draft in drafts])
        time.sleep(target_s)
        for index, draft in enumerate(drafts):
            accepted = draft if accept_all else []
            bonus = (batch.row(index)[-1] * 31 + step + 1) % VOCAB
            batch.commit(index, accepted + [bonus if not draft or accept_all else (draft[0] + 1) % VOCAB])
    return lengths


def test_adaptive_length_grows_to_k_when_the_target_accepts_everything(live):
    proposer = proposer_for(live.url, k=8, adaptive=True)
    lengths = run_steps(proposer, Batch([prompt(20, seed=1), prompt(30, seed=2)]), 12, True, target_s=0.3)
    assert lengths[0] == [vllm_proposer.FIRST_DRAFT_LENGTH, 0]  # one request measures the cost first
    assert lengths[-1] == [8, 8], lengths


def test_adaptive_length_stops_drafting_a_request_the_target_always_rejects(live):
    proposer = proposer_for(live.url, k=8, adaptive=True)
    lengths = run_steps(proposer, Batch([prompt(20, seed=3)]), 40, False, target_s=0.0)
    late = [row[0] for row in lengths[10:]]
    assert max(late) <= 1, lengths  # only one-token probes
    # A probe-only call costs a server round trip, and the loop's "target steps" take no time: probes are rare.
    assert sum(late) <= 2, lengths


def test_fixed_length_always_asks_for_k(live):
    proposer = proposer_for(live.url, k=4, adaptive=False)
    lengths = run_steps(proposer, Batch([prompt(20, seed=3)]), 6, False, target_s=0.0)
    assert all(row == [4] for row in lengths), lengths


def test_the_plan_drafts_nothing_when_no_token_pays_and_more_for_likelier_requests():
    assert plan_draft_lengths([0.2, 0.2], [16, 16], target_s=0.02, overhead_s=0.01, token_s=0.01) == [0, 0]
    lengths = plan_draft_lengths([0.9, 0.5], [16, 16], target_s=0.1, overhead_s=0.002, token_s=0.002)
    assert lengths[0] > lengths[1] > 0
    assert plan_draft_lengths([0.99], [3], target_s=0.1, overhead_s=0.0, token_s=0.001) == [3]
