"""The engines the router knows: from ``--engine`` addresses, and from ``--engine-dns`` names re-resolved
every ``dns_refresh_s`` (a Kubernetes headless Service resolves to one address per ready pod).

Each engine gets one gRPC channel (shared by its supervisor and the requests placed on it) and one
supervisor task. An address that leaves DNS stops being a candidate at once; its channel stays open
for the streams still running on it, up to ``max_request_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from chatmesh.engine.v1 import engine_pb2_grpc
from meshkit.dns import resolve
from meshkit.serving import CHANNEL_OPTIONS
from router.config import EngineAddress, RouterConfig
from router.engines import EngineState
from router.index import PrefixIndex
from router.loads import LoadTable
from router.metrics import RouterMetrics
from router.supervisor import EngineSupervisor

log = logging.getLogger(__name__)

# gRPC's own reconnect backoff goes up to 120 s; a restarted engine should be back in seconds.
_ENGINE_CHANNEL_OPTIONS = (
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


class EngineRegistry:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.index = PrefixIndex()
        self.loads: LoadTable[EngineState] = LoadTable()
        self._engines: dict[str, EngineState] = {}
        self._supervisors: dict[str, asyncio.Task] = {}
        self._dns_members: dict[str, set[str]] = {}  # DNS name → engine ids it resolved to
        self._background: set[asyncio.Task] = set()
        metrics.watch_engines(lambda: ((e, self.index.size(e.engine_id)) for e in self.engines()))

    def start(self) -> None:
        """Starts supervising the configured engines (call on the serving event loop)."""
        for engine in self.config.engines:
            self.add(engine.engine_id, engine.address)
        if self.config.engine_dns:
            self._spawn(self._resolve_forever())

    async def close(self) -> None:
        tasks = [*self._supervisors.values(), *self._background]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for engine in self._engines.values():
            await engine.channel.close(grace=None)

    def engines(self) -> list[EngineState]:
        return sorted(self._engines.values(), key=lambda e: e.engine_id)

    def add(self, engine_id: str, address: str) -> EngineState:
        channel = grpc.aio.insecure_channel(address, options=_ENGINE_CHANNEL_OPTIONS)
        state = EngineState(engine_id, address, channel, engine_pb2_grpc.EngineServiceStub(channel))
        self._engines[engine_id] = state
        self.index.add_engine(engine_id, self.config.index_max_blocks_per_engine)  # its slot (bound: later)
        state.attach(self.loads, self.index.slot(engine_id))
        supervisor = EngineSupervisor(state, self.index, self.config, self.metrics)
        self._supervisors[engine_id] = asyncio.create_task(supervisor.run(), name=f"supervise {engine_id}")
        log.info("watching engine %s at %s", engine_id, address)
        return state

    def remove(self, engine_id: str) -> None:
        state = self._engines.pop(engine_id)
        self._supervisors.pop(engine_id).cancel()
        state.removed = True
        state.disconnect()
        state.detach()
        self.index.remove_engine(engine_id)
        self._spawn(state.channel.close(grace=self.config.max_request_s))
        log.info("engine %s at %s is gone from DNS", engine_id, state.address)

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- DNS -----------------------------------------------------------------------------------------

    async def _resolve_forever(self) -> None:
        while True:
            for name in self.config.engine_dns:
                await self._resolve(name)
            await asyncio.sleep(self.config.dns_refresh_s)

    async def _resolve(self, name: str) -> None:
        try:
            found = await resolve(EngineAddress.parse(name).address)
        except OSError as exc:  # keep what we had: a DNS hiccup is not every engine dying
            log.warning("cannot resolve engine name %s: %s", name, exc)
            return
        members = self._dns_members.setdefault(name, set())  # only engines this name added
        for address in sorted(found - members):
            if address not in self._engines:
                self.add(address, address)
                members.add(address)
        for address in sorted(members - found):
            self.remove(address)
            members.discard(address)
