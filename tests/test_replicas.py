"""Scale-out over real processes and real HTTP: `REPLICAS=2 ./serve.sh` (two servers behind vllm-router).

The end-to-end test is slow (one to two minutes on 2 cores) and marked so:
`.venv/bin/python -m pytest -m slow tests/test_replicas.py`. serve.sh installs the 'scale' extra (vllm-router)
into .venv the first time, which needs the package index. The refusals of bad settings run in the default suite.
"""

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from evidence.quantize import make_random_package

STARTUP_TIMEOUT_S = 300  # includes serve.sh installing vllm-router on a first run
FAILOVER_LIMIT_S = 15  # three failed 1 s health checks, plus retries and a cold prefill, on a loaded machine
CONVERSATIONS, TURNS, PROMPT_TOKENS = 8, 3, 48


def free_ports(count: int) -> list[int]:
    """`count` consecutive loopback ports that are free now (router, replicas, router metrics)."""
    for _ in range(50):
        base = random.randrange(20_000, 60_000)
        sockets = []
        try:
            for port in range(base, base + count):
                probe = socket.socket()
                sockets.append(probe)
                probe.bind(("127.0.0.1", port))
            return list(range(base, base + count))
        except OSError:
            continue
        finally:
            for probe in sockets:
                probe.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def children(pid: int) -> dict[int, str]:
    """{pid: command line} of the live processes whose parent is `pid` (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found[int(entry.name)] = cmdline
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def draft_count(replica_url: str) -> float:
    """/draft requests this replica has answered with 200 (its /metrics)."""
    for line in httpx.get(replica_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('draft_server_requests_total{endpoint="/draft",status="200"}'):
            return float(line.split()[-1])
    return 0.0


def post_with_retry(client: httpx.Client, body: dict, session: str, limit_s: float) -> tuple[httpx.Response, float]:
    """POST /draft as a harness would: a 502/503 or a refused connection is retried once a second."""
    started = time.monotonic()
    while True:
        try:
            response = client.post("/draft", json=body, headers={"X-Session-ID": session})
            if response.status_code not in (502, 503):
                return response, time.monotonic() - started
        except httpx.TransportError:
            pass
        if time.monotonic() - started > limit_s:
            pytest.fail(f"session {session}: no answer within {limit_s} s")
        time.sleep(1)


@pytest.fixture(scope="module")
def random_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("replicas") / "package"
    make_random_package.main(["--output", str(directory)])
    return directory


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ({"REPLICAS": "two"}, "REPLICAS=two: must be a whole number >= 1"),
        ({"REPLICAS": "2", "WORKER_URLS": "http://127.0.0.1:9"}, "not both"),
        ({"REPLICAS": "2", "API_KEY_FILE": "key"}, "vllm-router neither checks client keys"),
    ],
)
def test_serve_sh_refuses_bad_scale_out_settings_in_one_line(repo_root: Path, environment: dict, message: str):
    """Refused before anything is installed or started: one line, exit status 2."""
    result = subprocess.run(
        [str(repo_root / "serve.sh")], env={**os.environ, **environment}, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_supervisor_refuses_bad_ports_in_one_line(repo_root: Path):
    router_port, replica_port = free_ports(2)
    supervisor = [sys.executable, str(repo_root / "scripts" / "replicas.py")]
    cases = [
        (["--replicas", "0"], "--replicas 0 must be >= 1"),
        (["--replicas", "2", "--port", "70000"], "--port 70000 is not a TCP port"),
        (["--worker-urls", "ftp://host"], "must look like http://HOST:PORT"),
        (["--replicas", "1", "--port", str(router_port), "--", "--port", "1"], "server flag --port"),
    ]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", replica_port))
        cases.append((["--replicas", "1", "--port", str(router_port)], f"replica port {replica_port} is in use"))
        for arguments, message in cases:
            result = subprocess.run([*supervisor, *arguments], capture_output=True, text=True, timeout=30)
            assert result.returncode == 2 and result.stderr.count("\n") == 1, (arguments, result.stderr)
            assert message in result.stderr, (arguments, result.stderr)


@pytest.mark.slow
def test_two_replicas_keep_sessions_fail_over_and_stop_cleanly(repo_root: Path, random_package: Path, tmp_path: Path):
    if Path(sys.prefix).resolve() != (repo_root / ".venv").resolve():
        pytest.skip("serve.sh runs the repository's .venv; run this test with .venv/bin/python -m pytest")
    router_port, *replica_ports, metrics_port = free_ports(4)
    replica_urls = [f"http://127.0.0.1:{port}" for port in replica_ports]
    env = {
        **os.environ,
        "MODEL_DIR": str(random_package),
        "REPLICAS": "2",
        "PORT": str(router_port),
        "REPLICA_BASE_PORT": str(replica_ports[0]),
        "ROUTER_METRICS_PORT": str(metrics_port),
        "MAX_BATCH_SIZE": "4",
        "CACHE_SLOTS": "32",
    }
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log_file:
        serve = subprocess.Popen([str(repo_root / "serve.sh")], env=env, stdout=log_file, stderr=subprocess.STDOUT)
    processes: dict[int, str] = {}
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while b"replicas: serving on" not in log_path.read_bytes():
            if serve.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"REPLICAS=2 ./serve.sh did not start:\n{log_path.read_text()}")
            time.sleep(0.5)
        processes = children(serve.pid)  # serve.sh execs the supervisor: its children are the replicas and router
        replica_pids = {
            url: pid for pid, command in processes.items() for url in replica_urls if url.endswith(command.split()[-1])
        }
        assert len(processes) == 3 and len(replica_pids) == 2, processes

        client = httpx.Client(base_url=f"http://127.0.0.1:{router_port}", timeout=60)
        rng = random.Random(0)
        conversations: dict[str, list[int]] = {}
        owner: dict[str, str] = {}

        def turn(session: str) -> dict:
            """One turn, sent alone: the replica whose draft count rose answered it, and says so in X-Draft-Replica."""
            before = {url: draft_count(url) for url in replica_urls}
            response, _ = post_with_retry(client, {"token_ids": conversations[session], "max_tokens": 4}, session, 30)
            assert response.status_code == 200, response.text
            served = [url for url in replica_urls if draft_count(url) > before[url]]
            assert len(served) == 1, served
            assert served[0] == "http://" + response.headers["x-draft-replica"]  # the replica names itself
            assert owner.setdefault(session, served[0]) == served[0], f"{session} moved between replicas"
            body = response.json()
            conversations[session] += body["draft_token_ids"][:2] + [rng.randrange(1000)]
            return body

        # 8 conversations; should the hash ring put all of them on one replica (about 1 run in 128), more are
        # started until the other replica holds one too.
        index = 0
        while index < CONVERSATIONS or (len(set(owner.values())) < 2 and index < 3 * CONVERSATIONS):
            session = f"conversation-{index}"
            conversations[session] = [rng.randrange(1000) for _ in range(PROMPT_TOKENS)]
            assert turn(session)["cached_tokens"] == 0
            index += 1
        for _ in range(TURNS - 1):
            for session in conversations:
                assert turn(session)["cached_tokens"] > 0, f"{session} missed its replica's cache"
        assert set(owner.values()) == set(replica_urls), "both replicas serve conversations"

        # kill -9 the replica with more conversations: its sessions move to the other within a few seconds.
        victim = max(replica_urls, key=lambda url: list(owner.values()).count(url))
        survivor = next(url for url in replica_urls if url != victim)
        os.kill(replica_pids[victim], signal.SIGKILL)
        waits = []
        for session in conversations:
            body = {"token_ids": conversations[session], "max_tokens": 4}
            response, seconds = post_with_retry(client, body, session, FAILOVER_LIMIT_S)
            assert response.status_code == 200, response.text
            assert seconds < FAILOVER_LIMIT_S
            if owner[session] == victim:
                waits.append(seconds)
            assert survivor == "http://" + response.headers["x-draft-replica"]
        print(f"after kill -9: the dead replica's {len(waits)} conversations answered within {max(waits):.1f} s")
        workers = {w["url"]: w["is_healthy"] for w in client.get("/workers").json()["workers"]}
        assert workers == {victim: False, survivor: True}
        assert serve.poll() is None, "one replica's death must not stop the service"
        assert f"replica {victim.rsplit(':', 1)[1]} exited" in log_path.read_text()
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            status = serve.wait(timeout=120)
        except subprocess.TimeoutExpired:
            serve.kill()
            status = None
    log = log_path.read_text()
    assert status == 0, log
    assert "router and replicas stopped" in log
    left = [f"{pid} {command}" for pid, command in processes.items() if alive(pid)]
    assert not left, f"processes left behind: {left}"
