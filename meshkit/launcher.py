"""A small process supervisor for the local mesh: `make run` and the integration-test fixtures use it.

It starts services in order, each in its own process group with its output in ``<run_dir>/logs``,
waits until each is healthy (gRPC health v1, an HTTP 200, or an open TCP port), refuses to start when a
port is already taken, and stops everything it started (SIGTERM to the group, then SIGKILL) on
``stop_all()``, on leaving its ``with`` block, or when the supervising process exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshkit.serving import PortInUseError

__all__ = [
    "GrpcHealthy",
    "HttpOk",
    "Launcher",
    "PortInUseError",
    "Running",
    "ServiceFailedError",
    "ServiceSpec",
    "TcpOpen",
    "free_consecutive_ports",
    "free_port",
    "free_port_on_every",
    "port_is_free",
]


class ServiceFailedError(RuntimeError):
    """A service exited or never became healthy."""


@dataclass(frozen=True)
class GrpcHealthy:
    """Ready when grpc.health.v1.Health/Check on ``port`` answers SERVING for ``service``."""

    port: int
    service: str = ""

    def __call__(self) -> bool:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=self.service), timeout=1.0
                )
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def describe(self) -> str:
        return f"gRPC health on :{self.port}"


@dataclass(frozen=True)
class HttpOk:
    """Ready when GET ``url`` answers 200."""

    url: str

    def __call__(self) -> bool:
        try:
            with urllib.request.urlopen(self.url, timeout=1.0) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def describe(self) -> str:
        return f"HTTP 200 from {self.url}"


@dataclass(frozen=True)
class TcpOpen:
    """Ready when something accepts TCP connections on ``port``."""

    port: int

    def __call__(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
            return True
        return False

    def describe(self) -> str:
        return f"TCP port {self.port}"


class ReadyCheck(Protocol):
    """How the launcher knows a service is ready: called until it answers True."""

    def __call__(self) -> bool: ...

    def describe(self) -> str: ...


@dataclass
class ServiceSpec:
    """How to start one service and how to know it is up."""

    name: str
    argv: list[str]
    # Ports it listens on at 127.0.0.1, and (address, port) pairs on other loopback addresses
    # (a local Cassandra cluster's members are 127.0.0.2, 127.0.0.3, ...): all must be free to start.
    ports: tuple[int, ...] = ()
    addresses: tuple[tuple[str, int], ...] = ()
    ready: ReadyCheck | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    ready_timeout_s: float = 60.0
    stop_timeout_s: float = 20.0


@dataclass
class Running:
    spec: ServiceSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    started_at: float

    @property
    def pid(self) -> int:
        return self.process.pid


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``port`` now. Like the servers (gRPC, granian, Envoy), the probe
    sets SO_REUSEADDR: connections a stopped server left in TIME_WAIT do not keep it from restarting. It
    does not set SO_REUSEPORT, which granian (the edge) sets: a second edge would share a port in use
    rather than fail, and the probe still sees the port taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral_port_range() -> tuple[int, int]:
    """The ports Linux hands out as the source of outgoing connections (and to a bind to port 0)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


# Chosen ports come from here up to the ephemeral range, at random: a port the kernel could also hand
# out stays free only until the next outgoing connection takes it as its source port, and a mesh that
# starts a Cassandra cluster before Envoy opens many of those between choosing Envoy's port and binding it.
_FIRST_CHOSEN_PORT = 10000
_chooser = random.SystemRandom()
# Every port this process has handed out. A caller often takes several before it binds any (Envoy's
# listener, admin and internal ports go into one config), and a port not yet bound is still "free":
# without this, two of them could be the same port (CI: Envoy refused a config whose internal listener
# had the public one's port).
_handed_out: set[int] = set()
_handing_out = threading.Lock()


def free_consecutive_ports(count: int, stride: int = 1) -> int:
    """The first of ``count`` ports ``stride`` apart, all free on 127.0.0.1, none handed out before by
    this process, and outside the ephemeral range (or anywhere the kernel picks, on a machine whose
    ephemeral range leaves too little below it)."""
    span = stride * (count - 1)
    last = _ephemeral_port_range()[0] - 1 - span
    while True:
        if last - _FIRST_CHOSEN_PORT >= 4096:
            first = _chooser.randint(_FIRST_CHOSEN_PORT, last)
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                first = sock.getsockname()[1]
        run = range(first, first + span + 1, stride)
        if first + span >= 65536:
            continue
        with _handing_out:
            if _handed_out.isdisjoint(run) and all(port_is_free(port) for port in run):
                _handed_out.update(run)
                return first


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (tests give each service its own)."""
    return free_consecutive_ports(1)


def free_port_on_every(addresses: list[str]) -> int:
    """A port free on all of ``addresses`` (the members of a local cluster share their ports)."""
    while True:
        port = free_port()
        if all(port_is_free(port, address) for address in addresses):
            return port


def _die_with_parent() -> None:
    """Runs in the child before exec: ask Linux to SIGTERM it if the launcher dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


# A Python preexec_fn forces a full fork(); in a process whose gRPC threads are busy (a test with an
# in-process gRPC server, or the launcher after its health checks), gRPC's fork handlers then crash the
# child before it execs, a few percent of the time. util-linux's setpriv sets the same parent-death
# signal and execs the service, so Popen can vfork and no fork handler runs.
_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None


def _with_parent_death_signal(argv: list[str]) -> tuple[list[str], Callable[[], None] | None]:
    """``argv`` wrapped so the child gets SIGTERM when the launcher dies, and the preexec_fn to use."""
    if _SETPRIV:
        return [_SETPRIV, "--pdeathsig", "TERM", "--", *argv], None
    return argv, _die_with_parent


# Open files each service may hold (children inherit the launcher's limit). Every open stream holds a
# socket in each HTTP/1.1 hop: Envoy holds two per SSE stream (the client's and the edge's), so 10,000
# streams need more than the 20,000 a shell often allows; a Kubernetes container gets 1,048,576.
OPEN_FILES = 1_048_576


def raise_open_files_limit(wanted: int = OPEN_FILES) -> int:
    """Raises this process's open-file limit to ``wanted`` (the hard limit too, where it may), else as
    far as the hard limit allows; its children inherit it. Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
            return wanted
        except (ValueError, OSError):  # not privileged to raise the hard limit
            pass
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return max(soft, target)


class Launcher:
    """Starts services in order and stops them in reverse order."""

    def __init__(self, run_dir: Path, echo: Callable[[str], None] | None = None) -> None:
        raise_open_files_limit()
        self.run_dir = Path(run_dir)
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._echo = echo or (lambda line: print(line, flush=True))
        self._running: dict[str, Running] = {}
        # Start order by name, kept across restarts: a restarted service still stops in its place.
        self._order: dict[str, int] = {}

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    @property
    def running(self) -> dict[str, Running]:
        return dict(self._running)

    def start(self, spec: ServiceSpec) -> Running:
        """Starts ``spec`` and blocks until it is ready; raises with the log's tail if it is not."""
        self.spawn(spec)
        return self.wait_ready(spec.name)

    def spawn(self, spec: ServiceSpec) -> Running:
        """Starts ``spec`` without waiting for it to be ready (``wait_ready`` does): services spawned
        one after another then start side by side. Call it from a thread that outlives the service:
        Linux sends the parent-death signal when the spawning *thread* exits."""
        if spec.name in self._running:
            raise ValueError(f"service {spec.name!r} is already running")
        for host, port in [*(("127.0.0.1", port) for port in spec.ports), *spec.addresses]:
            if not port_is_free(port, host):
                raise PortInUseError(
                    f"port {port} needed by {spec.name} is already in use on {host}. "
                    f"Stop the process holding it (ss -ltnp 'sport = :{port}') or choose another port."
                )
        log_path = self.log_dir / f"{spec.name}.log"
        log_file = open(log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        self._echo(f"starting {spec.name}: {' '.join(spec.argv)}")
        argv, preexec_fn = _with_parent_death_signal(spec.argv)
        try:
            process = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=spec.cwd,
                env=env,
                start_new_session=True,  # own process group: stop the whole tree, immune to the shell's signals
                preexec_fn=preexec_fn,
            )
        finally:
            log_file.close()
        running = Running(spec=spec, process=process, log_path=log_path, started_at=time.monotonic())
        self._running[spec.name] = running
        self._order.setdefault(spec.name, len(self._order))
        return running

    def wait_ready(self, name: str) -> Running:
        """Blocks until the spawned service ``name`` is ready; stops it and raises if it is not."""
        running = self._running[name]
        try:
            self._wait_ready(running)
        except BaseException:
            self.stop(name)
            raise
        return running

    def _wait_ready(self, running: Running) -> None:
        spec = running.spec
        if spec.ready is None:
            return
        deadline = running.started_at + spec.ready_timeout_s
        next_note = time.monotonic() + 10.0
        while True:
            code = running.process.poll()
            if code is not None:
                raise ServiceFailedError(
                    f"{spec.name} exited with code {code} before it was ready.\n"
                    f"Last lines of {running.log_path}:\n{self.log_tail(spec.name)}"
                )
            if spec.ready():
                elapsed = time.monotonic() - running.started_at
                self._echo(
                    f"  {spec.name} ready ({spec.ready.describe()}) in {elapsed:.1f}s, pid {running.pid}"
                )
                return
            now = time.monotonic()
            if now > deadline:
                raise ServiceFailedError(
                    f"{spec.name} was not ready ({spec.ready.describe()}) within {spec.ready_timeout_s:.0f}s.\n"
                    f"Last lines of {running.log_path}:\n{self.log_tail(spec.name)}"
                )
            if now > next_note:
                self._echo(
                    f"  still waiting for {spec.name} ({spec.ready.describe()}), {now - running.started_at:.0f}s"
                )
                next_note = now + 10.0
            time.sleep(0.2)

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def signal(self, name: str, sig: int) -> None:
        """Sends ``sig`` to the service's whole process group (tests use SIGKILL to simulate a crash)."""
        running = self._running[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(running.pid, sig)

    def forget(self, name: str) -> Running:
        """Stops tracking a service that has already exited (after a crash test); returns its record."""
        running = self._running.pop(name)
        running.process.wait(timeout=30)
        return running

    def stop(self, name: str) -> int | None:
        """SIGTERM the service's process group, wait, then SIGKILL; returns the exit code."""
        running = self._running.pop(name, None)
        if running is None:
            return None
        process = running.process
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=running.spec.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._echo(f"  {name} did not stop within {running.spec.stop_timeout_s:.0f}s; killing it")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        # Reap anything the service left behind in its group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        return process.returncode

    def stop_all(self) -> None:
        for name in sorted(self._running, key=self._order.__getitem__, reverse=True):
            code = self.stop(name)
            self._echo(f"stopped {name} (exit code {code})")
