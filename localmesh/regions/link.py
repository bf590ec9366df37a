"""Two network namespaces joined by a point-to-point link that delays every packet: two regions on one
machine, a stated round-trip time apart.

The kernel here has no ``netem`` and no qdisc that honours a packet's departure time (``fq``, ``etf``),
so the delay is applied in userspace: each namespace gets a TUN device, and a forwarder thread in this
process reads every IP packet one region sends and writes it into the other region's device half the
round-trip time later. It carries any protocol (Cassandra's gossip and CQL included) at the rates a
local cell needs, not at line rate. Creating namespaces and TUN devices needs root (CAP_NET_ADMIN).

``DelayedLink`` is a context manager: entering removes what a crashed earlier run left under the same
names, then builds the namespaces, devices, addresses and forwarder; leaving stops the forwarder and
deletes the namespaces, whatever happened inside.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import os
import selectors
import struct
import subprocess
import threading
import time
from dataclasses import dataclass

TUN_DEVICE = "/dev/net/tun"
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
# Largest IP packet the devices carry (their MTU is left at the TUN default, 1500).
MAX_PACKET = 65535


class LinkSetupError(RuntimeError):
    """The link cannot be built here; the message says what is missing."""


@dataclass(frozen=True)
class LinkConfig:
    """Two regions ``{prefix}-a`` and ``{prefix}-b``, at ``{subnet}.1`` and ``{subnet}.2``."""

    prefix: str = "chatmesh"
    subnet: str = "10.231.0"
    rtt_ms: float = 50.0

    def namespace(self, side: str) -> str:
        return f"{self.prefix}-{side}"

    def device(self, side: str) -> str:
        return f"{self.prefix}-{side}"[:15]  # IFNAMSIZ

    def address(self, side: str) -> str:
        return f"{self.subnet}.{1 if side == 'a' else 2}"


SIDES = ("a", "b")


def _ip(*args: str, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(("-n", namespace) if namespace else ()), *args]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise LinkSetupError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def _open_tun(name: str) -> int:
    fd = os.open(TUN_DEVICE, os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def check_prerequisites() -> None:
    """Raises LinkSetupError saying what is missing: root, ``ip``, or the TUN device."""
    if os.geteuid() != 0:
        raise LinkSetupError("network namespaces and TUN devices need root (CAP_NET_ADMIN)")
    if subprocess.run(["ip", "-V"], capture_output=True, check=False).returncode != 0:
        raise LinkSetupError("`ip` (iproute2) is not installed")
    if not os.path.exists(TUN_DEVICE):
        raise LinkSetupError(f"{TUN_DEVICE} is missing (load the tun module)")


class DelayedLink:
    """The two namespaces and the delaying forwarder between them, for the ``with`` block."""

    def __init__(self, config: LinkConfig) -> None:
        self.config = config
        self._fds: dict[str, int] = {}
        self._stop = threading.Event()
        self._forwarder = threading.Thread(target=self._forward, name="region-link", daemon=True)

    def __enter__(self) -> DelayedLink:
        check_prerequisites()
        self._delete_namespaces()  # what a crashed earlier run left under the same names
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.destroy()

    def _create(self) -> None:
        config = self.config
        for side in SIDES:
            namespace, device = config.namespace(side), config.device(side)
            _ip("netns", "add", namespace)
            # Opened here (the device appears in this namespace), then moved: the descriptor stays bound.
            self._fds[side] = _open_tun(device)
            _ip("link", "set", device, "netns", namespace)
            peer = config.address("b" if side == "a" else "a")
            _ip("addr", "add", config.address(side), "peer", peer, "dev", device, namespace=namespace)
            _ip("link", "set", device, "up", namespace=namespace)
            _ip("link", "set", "lo", "up", namespace=namespace)
        self._forwarder.start()

    def destroy(self) -> None:
        """Stops the forwarder and deletes both namespaces (and the devices in them); a no-op for what
        is not there."""
        self._stop.set()
        if self._forwarder.is_alive():
            self._forwarder.join()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._delete_namespaces()

    def _delete_namespaces(self) -> None:
        for side in SIDES:
            if self.config.namespace(side) in _ip("netns", "list").stdout.split():
                _ip("netns", "delete", self.config.namespace(side))

    def exec_argv(self, side: str, argv: list[str]) -> list[str]:
        """``argv`` run inside one region's namespace."""
        return ["ip", "netns", "exec", self.config.namespace(side), *argv]

    def _forward(self) -> None:
        """Reads each side's packets and writes them to the other side one-way delay later, in order."""
        one_way_s = self.config.rtt_ms / 2000
        other = {self._fds["a"]: self._fds["b"], self._fds["b"]: self._fds["a"]}
        due: list[tuple[float, int, int, bytes]] = []  # (when, sequence, to fd, packet)
        sequence = 0
        with selectors.DefaultSelector() as selector:
            for fd in other:
                selector.register(fd, selectors.EVENT_READ)
            while not self._stop.is_set():
                timeout = max(0.0, due[0][0] - time.monotonic()) if due else 0.1
                for key, _ in selector.select(min(timeout, 0.1)):
                    with contextlib.suppress(BlockingIOError):
                        while True:
                            packet = os.read(key.fd, MAX_PACKET)
                            sequence += 1
                            heapq.heappush(
                                due, (time.monotonic() + one_way_s, sequence, other[key.fd], packet)
                            )
                now = time.monotonic()
                while due and due[0][0] <= now:
                    _, _, to, packet = heapq.heappop(due)
                    # A full device queue drops the packet, as a congested link would; TCP resends.
                    with contextlib.suppress(BlockingIOError):
                        os.write(to, packet)
