"""The replicas of a peer service that a client keeps one channel each to, found by name: the
orchestrator's routers, the edge's orchestrators.

A name is ``host:port``, a list ``10.0.0.1:50051,10.0.0.2:50051`` (an ``ipv4:`` prefix allowed), or
``dns:///name:port`` (a Kubernetes headless Service resolves to one address per ready pod); names are
resolved again every ``refresh_s``: replicas that appear are used, those that leave DNS get nothing new
and are closed once nothing of theirs is left.

A key (a chat id) goes to one replica while that replica is up (rendezvous hashing: when one goes or
comes, only its keys move); work with no key goes round-robin. A replica is passed over while it is
down: its channel cannot connect, or its health (``grpc.health.v1``, watched) says NOT_SERVING, which a
draining server says before it refuses new work (``meshkit.serving.DRAIN_NOTICE_S``). When every one is
down they are all tried anyway (the call then says why).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Container
from typing import Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshkit.dns import resolve
from meshkit.serving import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

# How often names are resolved again (replicas come and go).
DNS_REFRESH_S = 10.0
# A restarted replica should be back in seconds, not after gRPC's own backoff (up to 120 s).
REPLICA_CHANNEL_OPTIONS = (
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
# How soon the health of a replica that is not serving is asked again.
_HEALTH_RETRY_S = 1.0
_DOWN = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


def addresses(value: str) -> list[str]:
    """The replicas ``value`` names: ``host:port``, ``ip:port,ip:port,...`` (each replica named, an
    ``ipv4:`` prefix allowed), or ``dns:///name:port`` (one address per replica)."""
    for scheme in ("dns:///", "ipv4:", "ipv6:"):
        value = value.removeprefix(scheme)
    return [part.strip() for part in value.split(",") if part.strip()]


class Replica:
    """One replica: its channel, and whether it serves. Subclasses add their stubs and say when they
    are ``busy`` (work of theirs still on it: a leaving replica is closed once it is not)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=REPLICA_CHANNEL_OPTIONS)
        self.serving = True  # until its health says otherwise
        # Watched from the first time it is asked about (``down``): a replica named before it listens (a
        # service started before its peers) is not connected to, and left in gRPC's reconnect backoff,
        # before anything needs it.
        self._health: asyncio.Task[None] | None = None

    @property
    def down(self) -> bool:
        if self._health is None:
            self._health = asyncio.create_task(self._watch_health())
        return not self.serving or self.channel.get_state(try_to_connect=True) in _DOWN

    def busy(self) -> bool:
        return False

    async def close(self, grace_s: float | None = None) -> None:
        """Closes the channel; with ``grace_s``, calls on it have that long to end."""
        if self._health is not None:
            self._health.cancel()
        await self.channel.close(grace=grace_s)

    async def _watch_health(self) -> None:
        """Follows the replica's health. Not serving, or not reachable, it is asked again every
        ``_HEALTH_RETRY_S``: a draining server keeps every open call until its grace ends, so the watch
        is not held open on one. A peer without the health service serves as long as it is reachable."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        while True:
            call = stub.Watch(health_pb2.HealthCheckRequest())
            try:
                async for reply in call:
                    self.serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    if not self.serving:
                        break
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.serving = True
                    return
                self.serving = False
            finally:
                call.cancel()
            await asyncio.sleep(_HEALTH_RETRY_S)


R = TypeVar("R", bound=Replica)


class Replicas(Generic[R]):
    """The replicas a name gives, each made once by ``make(address)`` (inside the event loop). ``ready``
    starts resolving and returns once the names were resolved once; ``pick`` is synchronous. A replica
    that left is closed once not ``busy``, its calls given ``leaving_grace_s`` to end."""

    def __init__(
        self,
        value: str,
        make: Callable[[str], R],
        refresh_s: float = DNS_REFRESH_S,
        leaving_grace_s: float | None = None,
    ) -> None:
        self.refresh_s = refresh_s
        self.leaving_grace_s = leaving_grace_s
        self._names = addresses(value)
        self._make = make
        self._members: dict[str, R] = {}
        self._leaving: list[R] = []
        self._closing: set[asyncio.Task[None]] = set()
        self._turn = 0
        self._resolving: asyncio.Task[None] | None = None
        self._resolved = asyncio.Event()

    async def ready(self) -> None:
        if self._resolving is None:
            self._resolving = asyncio.create_task(self._resolve_forever())
        await self._resolved.wait()

    @property
    def members(self) -> list[R]:
        """Every known replica (up or not), in address order."""
        return [replica for _, replica in sorted(self._members.items())]

    def candidates(self, tried: Container[str] = ()) -> list[R]:
        """The replicas not in ``tried``: those up, or every one when none is. With one left its health
        can change nothing and is not asked (nor watched: one address may be a proxy, Envoy's internal
        listener, whose health route would hold a watch on one replica behind it until a timeout)."""
        left = [replica for replica in self.members if replica.address not in tried]
        if len(left) < 2:
            return left
        return [replica for replica in left if not replica.down] or left

    def pick(self, key: str, tried: Container[str] = ()) -> R | None:
        """The replica for ``key`` ("": any) among ``candidates(tried)``: by rendezvous hashing, or the
        next round-robin; None when none is left."""
        candidates = self.candidates(tried)
        if not candidates:
            return None
        if key:
            return max(candidates, key=lambda replica: rendezvous(key, replica.address))
        self._turn += 1
        return candidates[self._turn % len(candidates)]

    async def close(self) -> None:
        if self._resolving is not None:
            self._resolving.cancel()
        for replica in [*self._members.values(), *self._leaving]:
            await replica.close()
        for task in list(self._closing):
            task.cancel()

    async def _resolve_forever(self) -> None:
        while True:
            await self._resolve()
            self._resolved.set()
            # Sooner while none is known: the first requests are waiting for one.
            await asyncio.sleep(self.refresh_s if self._members else min(self.refresh_s, 1.0))

    async def _resolve(self) -> None:
        found: set[str] = set()
        for name in self._names:
            try:
                found |= await resolve(name)
            except (OSError, ValueError) as exc:  # keep what we had: a DNS hiccup is not every replica dying
                log.warning("cannot resolve %s: %s", name, exc)
                found |= set(self._members)
        for address in found - self._members.keys():
            self._members[address] = self._make(address)
        for address in set(self._members) - found:
            self._leaving.append(self._members.pop(address))
        still = []
        for replica in self._leaving:
            if replica.busy():
                still.append(replica)
            else:
                task = asyncio.create_task(replica.close(self.leaving_grace_s))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        self._leaving = still


def rendezvous(key: str, address: str) -> int:
    digest = hashlib.blake2b(f"{key}|{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
