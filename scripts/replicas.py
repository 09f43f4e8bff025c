"""Scale-out supervisor: N draft servers on loopback ports behind vllm-router, which hashes X-Session-ID.

serve.sh runs this when REPLICAS or WORKER_URLS is set (see docs/scaling.md); it can also be run directly:

    .venv/bin/python scripts/replicas.py --replicas 2 --port 8000 -- --model-dir model --cache-slots 64
    .venv/bin/python scripts/replicas.py --worker-urls http://10.0.0.5:8000 http://10.0.0.6:8000 --host 0.0.0.0

--replicas N starts N `server.py` processes on 127.0.0.1:BASE..BASE+N-1 (BASE: --replica-base-port, default
--port + 1), each with the server flags given after `--`, waits until every one answers /health, then starts
vllm-router on --host:--port with the consistent_hash policy: every request carrying the same X-Session-ID
header (or `session_id` body field) reaches the same replica, so its prefix cache keeps paying. Requests
without one are placed by a hash of their body. The router checks each replica's /health every
--health-interval seconds; a replica that fails three checks in a row gets no more requests and its sessions
move to the others.

Resources: on a machine with NVIDIA GPUs (nvidia-smi lists them, or CUDA_VISIBLE_DEVICES names them) replica i
gets CUDA_VISIBLE_DEVICES=<device i mod count>, unless the server flags say --device cpu. On the CPU each
replica gets an equal share of the cores this process may use (at least one) and drafts on all of its share,
unless the server flags set --threads.

Signals: SIGTERM, SIGINT or SIGHUP stop the router first (it finishes the requests it is forwarding), then
every replica (each answers what it has queued), waiting --drain-timeout seconds for each before killing it.
Children also get SIGTERM from the kernel if this process dies without cleaning up (Linux), so none is left
behind. A replica that exits on its own is reported and left to the router's health checks; if none is
left, or the router exits, everything stops and the exit status is 1.

--worker-urls runs only the router, over replicas already running elsewhere (several hosts): this process
becomes vllm-router.

Reads nothing but its arguments; writes the children's output to stdout, each line prefixed with its source.
Exit status: 0 after a clean stop, 1 when a child failed, 2 for a bad argument.
"""

import argparse
import ctypes
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROUTER_POLICY = "consistent_hash"
HEALTH_FAILURES = 3  # consecutive failed checks before the router stops sending to a replica
PR_SET_PDEATHSIG = 1
# Flags this supervisor sets per replica; given after `--` they would clash with it.
RESERVED_SERVER_FLAGS = ("--host", "--port")


class UsageError(Exception):
    """A bad argument: reported as one line, exit status 2."""


def log(message: str) -> None:
    print(f"replicas: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(supervisor arguments, server flags): everything after the first `--` goes to each server.py."""
    if "--" in argv:
        split = argv.index("--")
        own, server_flags = argv[:split], argv[split + 1 :]
    else:
        own, server_flags = argv, []
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s (--replicas N | --worker-urls URL [URL ...]) [options] [-- server.py flags]",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--replicas", type=int, help="start this many draft servers here (>= 1)")
    target.add_argument("--worker-urls", nargs="+", help="run only the router over these running servers")
    parser.add_argument("--host", default="127.0.0.1", help="the router's bind address")
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument("--replica-base-port", type=int, default=None, help="first replica port (default: --port + 1)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="the router's Prometheus port, on --host (default: the port after the last replica's; with "
        "--worker-urls, --port + 1)",
    )
    parser.add_argument("--health-interval", type=int, default=1, help="seconds between the router's health checks")
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds a replica may take to load")
    parser.add_argument("--drain-timeout", type=float, default=60, help="seconds a child may take to stop")
    parser.add_argument(
        "--router-log-level",
        default="error",
        choices=["debug", "info", "warning", "error"],
        help="vllm-router's log level; vllm-router 0.1.17 logs every request at 'warning' too, hence 'error'",
    )
    parser.add_argument("--router-args", default="", help="extra vllm-router flags, one shell-quoted string")
    parser.add_argument(
        "--router", default=None, help="the vllm-router executable (default: the one beside this Python)"
    )
    args = parser.parse_args(own)
    return args, server_flags


def check_port(name: str, port: int) -> None:
    if not 1 <= port <= 65535:
        raise UsageError(f"{name} {port} is not a TCP port (1..65535)")


def check_args(args: argparse.Namespace, server_flags: list[str]) -> None:
    check_port("--port", args.port)
    if args.health_interval < 1:
        raise UsageError(f"--health-interval {args.health_interval} must be >= 1 second")
    try:
        args.router_args = shlex.split(args.router_args)
    except ValueError as error:
        raise UsageError(f"--router-args {args.router_args!r}: {error}") from None
    if args.worker_urls is not None:
        if args.metrics_port is None:
            args.metrics_port = args.port + 1
        check_port("--metrics-port", args.metrics_port)
        for url in args.worker_urls:
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
                raise UsageError(f"worker URL {url!r} must look like http://HOST:PORT")
        return
    if args.replicas < 1:
        raise UsageError(f"--replicas {args.replicas} must be >= 1")
    if args.replica_base_port is None:
        args.replica_base_port = args.port + 1
    check_port("--replica-base-port", args.replica_base_port)
    ports = range(args.replica_base_port, args.replica_base_port + args.replicas)
    check_port("last replica port", ports[-1])
    if args.metrics_port is None:
        args.metrics_port = ports[-1] + 1
    check_port("--metrics-port", args.metrics_port)
    if args.metrics_port in ports or args.metrics_port == args.port:
        raise UsageError(f"--metrics-port {args.metrics_port} clashes with the router's or a replica's port")
    if args.port in ports:
        raise UsageError(
            f"the router's port {args.port} is among the replica ports {ports[0]}..{ports[-1]}; change REPLICA_BASE_PORT (--replica-base-port)"
        )
    for flag in server_flags:
        if flag.split("=", 1)[0] in RESERVED_SERVER_FLAGS:
            raise UsageError(
                f"server flag {flag}: with replicas, HOST/PORT are the router's and replicas take loopback ports "
                "from the base port"
            )
    for port in ports:
        if not port_is_free(port):
            raise UsageError(
                f"replica port {port} is in use on 127.0.0.1; choose another first port (REPLICA_BASE_PORT, --replica-base-port)"
            )


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def find_router(given: str | None) -> str:
    candidates = [given] if given else [str(Path(sys.executable).parent / "vllm-router"), "vllm-router"]
    for candidate in candidates:
        found = shutil.which(candidate)
        if found:
            return found
    raise UsageError(
        "vllm-router is not installed: install the 'scale' extra (scripts/ensure_venv.sh scale, which serve.sh "
        "runs when REPLICAS or WORKER_URLS is set)"
    )


# ----------------------------------------------------------------------------- placement


def flag_value(flags: list[str], name: str) -> str | None:
    """The value of `name` in `flags` (`--name value` or `--name=value`), the last one winning."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


def gpu_devices() -> list[str]:
    """The CUDA devices replicas may use: CUDA_VISIBLE_DEVICES's list if set, else what nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [device.strip() for device in visible.split(",") if device.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]


def replica_environments(replicas: int, server_flags: list[str]) -> tuple[list[dict[str, str]], list[str], str]:
    """(extra environment per replica, extra server flags for all, a one-line description of the placement)."""
    devices = [] if flag_value(server_flags, "--device") == "cpu" else gpu_devices()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // replicas)
    threads = flag_value(server_flags, "--threads")
    extra_flags = [] if threads else ["--threads", str(share)]
    threads = threads or str(share)
    environments = [{"OMP_NUM_THREADS": threads} for _ in range(replicas)]
    if devices:
        for i, environment in enumerate(environments):
            environment["CUDA_VISIBLE_DEVICES"] = devices[i % len(devices)]
        shared = " (more replicas than devices: some share one)" if replicas > len(devices) else ""
        placement = f"one CUDA device each from {','.join(devices)}{shared}, {threads} CPU thread(s) each"
    else:
        placement = f"CPU: {cores} cores, {threads} drafting thread(s) per replica"
    return environments, extra_flags, placement


# ----------------------------------------------------------------------------- children


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor dies, however it dies (Linux prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Child:
    """One child process; its output is copied to ours, each line prefixed with the child's name."""

    def __init__(self, name: str, command: list[str], environment: dict[str, str], drop_prefix: bytes | None = None):
        self.name, self.drop_prefix = name, drop_prefix
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, **environment},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's Ctrl-C reaches only the supervisor, which stops children in order
            preexec_fn=die_with_parent,
        )
        self.copier = threading.Thread(target=self._copy_output, daemon=True)
        self.copier.start()

    def _copy_output(self) -> None:
        for line in iter(self.process.stdout.readline, b""):
            if self.drop_prefix and line.startswith(self.drop_prefix):
                continue
            sys.stdout.write(f"[{self.name}] {line.decode(errors='replace')}")
            sys.stdout.flush()

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float) -> None:
        """SIGTERM, wait up to `timeout` seconds for the drain, then SIGKILL."""
        if self.running():
            self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log(f"{self.name} (pid {self.process.pid}) did not stop within {timeout:g} s; killing it")
            self.process.kill()
            self.process.wait()
        self.copier.join(timeout=5)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def router_command(router: str, args: argparse.Namespace, worker_urls: list[str]) -> list[str]:
    return [
        router,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        ROUTER_POLICY,
        "--health-check-endpoint",
        "/health",
        "--health-check-interval-secs",
        str(args.health_interval),
        "--health-failure-threshold",
        str(HEALTH_FAILURES),
        "--worker-startup-check-interval",
        "1",
        "--worker-startup-timeout-secs",
        str(int(args.startup_timeout)),
        "--prometheus-host",
        args.host,
        "--prometheus-port",
        str(args.metrics_port),
        "--log-level",
        args.router_log_level,
        *args.router_args,
    ]


class Supervisor:
    def __init__(self, args: argparse.Namespace, server_flags: list[str], router: str):
        self.args, self.server_flags, self.router_path = args, server_flags, router
        self.replicas: list[Child] = []
        self.router: Child | None = None
        self.stopping = threading.Event()
        self.startup_status = 0  # what a startup that did not finish exits with: 0 when a signal cut it short

    def request_stop(self, signum: int, frame) -> None:
        if not self.stopping.is_set():
            log(f"{signal.Signals(signum).name}: stopping the router, then the replicas once they have drained")
        self.stopping.set()

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self.request_stop)
        try:
            status = self._serve()
        finally:
            self._stop_all()
        return status

    def _serve(self) -> int:
        args = self.args
        environments, extra_flags, placement = replica_environments(args.replicas, self.server_flags)
        ports = [args.replica_base_port + i for i in range(args.replicas)]
        log(f"starting {args.replicas} replica(s) on 127.0.0.1:{ports[0]}..{ports[-1]}; {placement}")
        for port, environment in zip(ports, environments):
            command = [sys.executable, str(REPO / "server.py"), *extra_flags, *self.server_flags]
            command += ["--host", "127.0.0.1", "--port", str(port)]
            self.replicas.append(Child(f"replica {port}", command, environment))
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        if not self._wait_until_healthy(urls):
            return self.startup_status
        # vllm-router prints start-up "DEBUG:" lines whatever its log level; they say nothing an operator needs.
        quiet = None if args.router_log_level == "debug" else b"DEBUG: "
        self.router = Child("router", router_command(self.router_path, args, urls), {}, drop_prefix=quiet)
        router_url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        if not self._wait_until_healthy([router_url], router=True):
            return self.startup_status
        log(
            f"serving on http://{args.host}:{args.port}: vllm-router ({ROUTER_POLICY} on X-Session-ID) over "
            f"{len(urls)} replica(s); SIGTERM stops everything"
        )
        return self._watch()

    def _wait_until_healthy(self, urls: list[str], router: bool = False) -> bool:
        children = [self.router] if router else self.replicas
        waiting = dict(zip(urls, children))
        deadline = time.monotonic() + self.args.startup_timeout
        while waiting:
            for url, child in list(waiting.items()):
                if not child.running():
                    log(f"{child.name} exited with status {child.process.returncode} while starting; stopping")
                    self.startup_status = 2 if child.process.returncode == 2 else 1
                    return False
                if healthy(url):
                    del waiting[url]
            if self.stopping.wait(0.3):
                return False
            if time.monotonic() > deadline:
                names = ", ".join(child.name for child in waiting.values())
                log(f"{names} not healthy after {self.args.startup_timeout:g} s; stopping")
                self.startup_status = 1
                return False
        return True

    def _watch(self) -> int:
        reported: set[int] = set()
        while not self.stopping.wait(0.5):
            if not self.router.running():
                log(f"the router exited with status {self.router.process.returncode}; stopping the replicas")
                return 1
            for child in self.replicas:
                if not child.running() and child.process.pid not in reported:
                    reported.add(child.process.pid)
                    log(
                        f"{child.name} exited with status {child.process.returncode}; the router's health checks "
                        "move its sessions to the other replicas"
                    )
            if len(reported) == len(self.replicas):
                log("no replica is left; stopping the router")
                return 1
        return 0

    def _stop_all(self) -> None:
        # The router first: it stops taking requests and finishes forwarding the ones in flight; then the
        # replicas, which answer what they have queued (each answers 503 on /health while draining).
        if self.router is not None:
            self.router.stop(self.args.drain_timeout)
        for child in self.replicas:
            if child.running():
                child.process.terminate()
        for child in self.replicas:
            child.stop(self.args.drain_timeout)
        if self.replicas or self.router:
            log("router and replicas stopped")


def main(argv: list[str] | None = None) -> int:
    args, server_flags = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_args(args, server_flags)
        router = find_router(args.router)
    except UsageError as error:
        print(f"replicas: {error}", file=sys.stderr)
        return 2
    if args.worker_urls is not None:
        command = router_command(router, args, args.worker_urls)
        log(f"router only, on http://{args.host}:{args.port} over {' '.join(args.worker_urls)}")
        sys.stdout.flush()
        os.execv(command[0], command)
    return Supervisor(args, server_flags, router).run()


if __name__ == "__main__":
    sys.exit(main())
