"""Two regions on one machine: namespaces joined by a link that adds its stated round-trip time, built
over whatever a crashed earlier run left, and gone after the block. Needs root (namespaces, TUN
devices): skipped elsewhere, saying so."""

import os
import statistics
import subprocess
import sys

import pytest

from localmesh.regions.link import DelayedLink, LinkConfig

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="network namespaces and TUN devices need root (CAP_NET_ADMIN)"
)

# A TCP echo: "serve" answers each byte; "ping" prints the round trips of N one-byte exchanges, in ms.
ECHO = """
import socket, sys, time
if sys.argv[1] == "serve":
    server = socket.create_server(("0.0.0.0", 7777))
    print("ready", flush=True)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(64):
        conn.sendall(data)
else:
    conn = socket.create_connection((sys.argv[2], 7777), timeout=10)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(int(sys.argv[3])):
        started = time.perf_counter()
        conn.sendall(b"x")
        conn.recv(64)
        print((time.perf_counter() - started) * 1000)
"""


def round_trips_ms(link: DelayedLink, count: int) -> list[float]:
    """``count`` TCP round trips from region a to region b."""
    server = subprocess.Popen(
        link.exec_argv("b", [sys.executable, "-c", ECHO, "serve"]), stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        ping = [sys.executable, "-c", ECHO, "ping", link.config.address("b"), str(count)]
        done = subprocess.run(
            link.exec_argv("a", ping), capture_output=True, text=True, timeout=60, check=True
        )
    finally:
        server.kill()
        server.wait()
    return [float(line) for line in done.stdout.split()]


def namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()


def test_the_link_adds_its_round_trip_time_and_leaves_nothing_behind():
    config = LinkConfig(prefix="cmtest", subnet="10.231.7", rtt_ms=40.0)
    # A namespace left by a crashed run under the same name is replaced, not an error.
    subprocess.run(["ip", "netns", "add", config.namespace("a")], check=True)
    with DelayedLink(config) as link:
        rtts = round_trips_ms(link, 20)
    assert len(rtts) == 20
    # Never faster than the stated time; on a busy 2-core box the median stays within 20 ms of it.
    assert min(rtts) >= 40.0
    assert statistics.median(rtts) < 60.0
    assert not {config.namespace("a"), config.namespace("b")} & set(namespaces())


def test_no_link_no_delay():
    """The same path with a round-trip time of 0: the delay above is the link's, not the forwarder's."""
    with DelayedLink(LinkConfig(prefix="cmtest0", subnet="10.231.8", rtt_ms=0.0)) as link:
        assert statistics.median(round_trips_ms(link, 20)) < 5.0
