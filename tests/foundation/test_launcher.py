"""The launcher starts process groups, waits for health, and stops everything it started."""

import os
import re
import resource
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from meshkit.launcher import (
    OPEN_FILES,
    GrpcHealthy,
    HttpOk,
    Launcher,
    PortInUseError,
    ServiceFailedError,
    ServiceSpec,
    TcpOpen,
    free_consecutive_ports,
    free_port,
    port_is_free,
)
from meshkit.supervisor import Supervisor

# A service that forks a grandchild (to prove the whole group is stopped), writes the grandchild's pid
# where the test can read it, and listens on a port.
FAMILY = textwrap.dedent(
    """
    import os, socket, subprocess, sys, time
    port, pidfile = int(sys.argv[1]), sys.argv[2]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(pidfile, "w").write(str(child.pid))
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port)); srv.listen()
    print("listening", flush=True)
    time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def family_spec(tmp_path, name="family"):
    port = free_port()
    pidfile = tmp_path / f"{name}.pid"
    spec = ServiceSpec(
        name=name,
        argv=[sys.executable, "-c", FAMILY, str(port), str(pidfile)],
        ports=(port,),
        ready=TcpOpen(port),
        ready_timeout_s=20,
    )
    return spec, port, pidfile


def test_stop_all_stops_the_whole_process_group(tmp_path):
    spec, _, pidfile = family_spec(tmp_path)
    with Launcher(tmp_path / "run", echo=lambda _: None) as launcher:
        running = launcher.start(spec)
        grandchild = int(pidfile.read_text())
        assert alive(running.pid) and alive(grandchild)
    assert wait_gone(running.pid)
    assert wait_gone(grandchild)
    assert "listening" in (tmp_path / "run" / "logs" / "family.log").read_text()


def test_taken_port_is_refused_with_a_clear_error(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    spec = ServiceSpec(name="router", argv=[sys.executable, "-c", "pass"], ports=(port,))
    with Launcher(tmp_path, echo=lambda _: None) as launcher, pytest.raises(PortInUseError) as err:
        launcher.start(spec)
    holder.close()
    assert f"port {port}" in str(err.value) and "router" in str(err.value)
    assert not (tmp_path / "logs" / "router.log").exists(), "nothing may be started when a port is taken"


def test_a_port_whose_server_stopped_is_free_despite_connections_in_time_wait():
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    assert not port_is_free(port)
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
    server.close()
    client.close()
    assert port_is_free(port)


def test_chosen_ports_are_below_the_range_outgoing_connections_take_their_source_ports_from():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(port < low for port in ports)
    assert len(ports) > 40  # chosen at random: two meshes started side by side seldom collide
    first = free_consecutive_ports(3, stride=100)
    assert first + 200 < low
    assert all(port_is_free(first + 100 * i) for i in range(3))


def test_a_port_is_handed_out_once_even_before_anything_binds_it():
    # Callers take several ports before binding any (an Envoy config's three listeners): at random among
    # ~22,000, 500 picks would repeat one with probability ~99.6 % if unbound ports could come back.
    singles = [free_port() for _ in range(500)]
    runs = [free_consecutive_ports(3, stride=100) for _ in range(20)]
    handed_out = singles + [first + 100 * i for first in runs for i in range(3)]
    assert len(set(handed_out)) == len(handed_out)


def test_service_that_exits_early_reports_its_log(tmp_path):
    spec = ServiceSpec(
        name="broken",
        argv=[sys.executable, "-c", "import sys; print('model file missing: /nope.gguf'); sys.exit(3)"],
        ready=TcpOpen(free_port()),
    )
    with Launcher(tmp_path, echo=lambda _: None) as launcher, pytest.raises(ServiceFailedError) as err:
        launcher.start(spec)
    assert "exited with code 3" in str(err.value)
    assert "model file missing" in str(err.value)


def test_service_never_ready_times_out_and_is_stopped(tmp_path):
    spec = ServiceSpec(
        name="silent",
        argv=[sys.executable, "-c", "import time; time.sleep(600)"],
        ready=HttpOk(f"http://127.0.0.1:{free_port()}/healthz"),
        ready_timeout_s=1.0,
    )
    with Launcher(tmp_path, echo=lambda _: None) as launcher:
        with pytest.raises(ServiceFailedError, match="not ready"):
            launcher.start(spec)
        assert launcher.running == {}


def test_sigkill_simulates_a_crash_and_forget_reaps_it(tmp_path):
    import signal

    spec, _, pidfile = family_spec(tmp_path)
    with Launcher(tmp_path / "run", echo=lambda _: None) as launcher:
        launcher.start(spec)
        launcher.signal("family", signal.SIGKILL)
        record = launcher.forget("family")
        assert record.process.returncode == -signal.SIGKILL
        assert wait_gone(int(pidfile.read_text()))


def test_grpc_health_check_waits_for_serving(tmp_path):
    port = free_port()
    spec = ServiceSpec(
        name="router",
        argv=[sys.executable, "-m", "router", "--port", str(port)],
        ports=(port,),
        ready=GrpcHealthy(port),
        ready_timeout_s=30,
    )
    with Launcher(tmp_path, echo=lambda _: None) as launcher:
        launcher.start(spec)
        assert GrpcHealthy(port)()
        code = launcher.stop("router")
    assert code == 0, "SIGTERM must drain and exit cleanly"
    assert not GrpcHealthy(port)()


def tick_until(supervisor: Supervisor, done, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the supervisor did not get there in time"
        supervisor.tick()
        time.sleep(0.1)


def test_supervisor_restarts_a_killed_service_with_growing_backoff_and_logs_it(tmp_path):
    spec, port, _ = family_spec(tmp_path)
    lines: list[str] = []
    with Launcher(tmp_path / "run", echo=lambda _: None) as launcher:
        first = launcher.start(spec)
        supervisor = Supervisor(launcher, echo=lines.append)
        supervisor.watch_all()
        pids = [first.pid]
        for restart in (1, 2):
            launcher.signal("family", signal.SIGKILL)  # a crash of the whole service
            assert wait_gone(pids[-1])
            tick_until(supervisor, lambda n=restart: sum("ready again" in line for line in lines) == n)
            pids.append(launcher.running["family"].pid)
            assert supervisor.restarts("family") == restart
        assert len(set(pids)) == 3
        with socket.create_connection(("127.0.0.1", port), timeout=2.0):
            pass  # it serves again on its port
    exits = [line for line in lines if "exited with code -9" in line]
    assert [re.search(r"restarting it in (\d+)s", line).group(1) for line in exits] == ["1", "2"]
    assert all("family.log" in line for line in exits)


def test_a_restarted_service_still_stops_in_its_start_order(tmp_path):
    first, _, _ = family_spec(tmp_path, "first")
    second, _, _ = family_spec(tmp_path, "second")
    lines: list[str] = []
    with Launcher(tmp_path / "run", echo=lines.append) as launcher:
        launcher.start(first)
        launcher.start(second)
        supervisor = Supervisor(launcher, echo=lines.append)
        supervisor.watch_all()
        launcher.signal("first", signal.SIGKILL)
        tick_until(supervisor, lambda: any("first ready again" in line for line in lines))
    stopped = [line.split()[1] for line in lines if line.startswith("stopped ")]
    assert stopped == ["second", "first"]  # reverse start order: dependents stop before what they use


def test_backoff_starts_over_once_a_restarted_service_has_been_ready_for_a_minute(tmp_path):
    spec, _, _ = family_spec(tmp_path)
    now = [0.0]
    lines: list[str] = []
    with Launcher(tmp_path / "run", echo=lambda _: None) as launcher:
        launcher.start(spec)
        supervisor = Supervisor(launcher, echo=lines.append, clock=lambda: now[0])
        supervisor.watch_all()

        def crash_and_recover(at: float) -> None:
            now[0] = at
            pid = launcher.running["family"].pid
            launcher.signal("family", signal.SIGKILL)
            assert wait_gone(pid)
            supervisor.tick()  # sees the exit and schedules the restart
            now[0] = at + 30.0  # past any backoff
            ready = sum("ready again" in line for line in lines)
            tick_until(supervisor, lambda: sum("ready again" in line for line in lines) > ready)

        crash_and_recover(at=10.0)  # ready since 0 for only 10 s: first backoff, 1 s
        crash_and_recover(at=50.0)  # back for 10 s: the backoff doubles
        crash_and_recover(at=200.0)  # ready for two minutes: it starts over
    backoffs = [re.search(r"restarting it in (\d+)s", line).group(1) for line in lines if "exited" in line]
    assert backoffs == ["1", "2", "1"]


def test_services_may_open_as_many_files_as_the_machine_allows(tmp_path):
    """Each open SSE stream holds two sockets in Envoy: a service inherits the launcher's open-file
    limit, raised to OPEN_FILES or as far as the hard limit allows."""
    with Launcher(tmp_path) as launcher:
        spec = ServiceSpec(
            name="limits",
            argv=[sys.executable, "-c", "import time; time.sleep(30)"],
        )
        running = launcher.spawn(spec)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        with open(f"/proc/{running.pid}/limits") as limits:
            (line,) = [row for row in limits if row.startswith("Max open files")]
        assert int(line.split()[3]) == soft
        assert soft == (OPEN_FILES if hard == resource.RLIM_INFINITY else min(OPEN_FILES, hard))
