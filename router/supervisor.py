"""One task per engine: connect, learn what it serves, and keep its KV events, load and health current.

A session is: ``GetModelInfo`` (model, tokenizer, block size and hash seed, instance id, pool size),
then two streams side by side: ``KvEvents`` feeds the index (snapshot, then batches numbered +1; a gap
or an overflow means drop this engine's entries and resubscribe), and ``WatchLoad`` feeds the load and
the health (``serving`` turns false while the engine drains or after its model runner failed; a report
that does not come in time ends the session). When either stream breaks or ends, or the engine reports
a new instance id, the engine is unhealthy at once, its index entries are dropped, and the session
starts again after a backoff.

(``grpc.health.v1`` ``Watch`` would say the same as ``serving``, but it fails on chatmesh servers: the
OpenTelemetry aio server interceptor cannot wrap its coroutine-style streaming handler.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Coroutine

import grpc

from chatmesh.engine.v1 import engine_pb2
from router.config import RouterConfig
from router.engines import EngineState
from router.index import PrefixIndex
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)

BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 5.0
STABLE_SESSION_S = 10.0  # a session that lasted this long resets the backoff
# A load stream silent for this many report intervals (and at least LOAD_STALE_MIN_S) is dead.
LOAD_STALE_INTERVALS = 50
LOAD_STALE_MIN_S = 5.0


class SessionEnded(Exception):
    """The engine's session is over (a stream ended, or the engine restarted)."""


class _Resync(Exception):
    """The KV event stream lost its place: resubscribe from a fresh snapshot."""


class EngineSupervisor:
    def __init__(
        self, state: EngineState, index: PrefixIndex, config: RouterConfig, metrics: RouterMetrics
    ) -> None:
        self.state = state
        self.index = index
        self.config = config
        self.metrics = metrics

    async def run(self) -> None:
        backoff = BACKOFF_INITIAL_S
        name = self.state.engine_id
        while True:
            started = time.monotonic()
            try:
                await self._session()
                reason = "its streams ended"
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except (SessionEnded, TimeoutError) as exc:
                reason = str(exc) or "no load report in time"
            was_up = self.state.connected
            self.state.disconnect()
            self.index.clear(name)
            if was_up:
                log.warning("engine %s (%s) is unhealthy: %s", name, self.state.address, reason)
            else:
                log.debug("engine %s (%s) not reachable: %s", name, self.state.address, reason)
            if time.monotonic() - started > STABLE_SESSION_S:
                backoff = BACKOFF_INITIAL_S
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(BACKOFF_MAX_S, backoff * 2)

    async def _session(self) -> None:
        state = self.state
        info = await state.stub.GetModelInfo(
            engine_pb2.GetModelInfoRequest(), timeout=self.config.rpc_timeout_s
        )
        if state.info is None or state.info.engine_instance_id != info.engine_instance_id:
            log.info(
                "engine %s (%s): %s on %s, block size %d, %d KV blocks, instance %s",
                state.engine_id,
                state.address,
                info.model,
                info.backend,
                info.block_size,
                info.kv_blocks_total,
                info.engine_instance_id,
            )
        state.info = info
        bound = min(
            info.kv_blocks_total or self.config.index_max_blocks_per_engine,
            self.config.index_max_blocks_per_engine,
        )
        self.index.add_engine(state.engine_id, bound)
        state.connected = True
        await _first_to_end(self._follow_kv_events(info.engine_instance_id), self._watch_load())

    # -- KV events -----------------------------------------------------------------------------------

    async def _follow_kv_events(self, instance_id: str) -> None:
        while True:
            call = self.state.stub.KvEvents(engine_pb2.KvEventsRequest())
            try:
                await self._apply_kv_events(call, instance_id)
                raise SessionEnded("the KV event stream ended")
            except _Resync as exc:
                reason, detail = "gap", str(exc)
            except grpc.aio.AioRpcError as exc:
                if (
                    exc.code() != grpc.StatusCode.ABORTED
                ):  # ABORTED: we fell behind; anything else: the engine
                    raise
                reason, detail = "overflow", exc.details() or "the engine's event buffer overflowed"
            finally:
                call.cancel()
            log.warning("engine %s: resyncing its KV index (%s)", self.state.engine_id, detail)
            self.metrics.kv_resyncs.labels(self.state.engine_id, reason).inc()
            self.index.clear(self.state.engine_id)

    async def _apply_kv_events(self, call: grpc.aio.UnaryStreamCall, instance_id: str) -> None:
        engine_id, index = self.state.engine_id, self.index
        expected: int | None = None
        async for response in call:
            if response.engine_instance_id != instance_id:
                raise SessionEnded(f"the engine restarted (instance {response.engine_instance_id})")
            if response.WhichOneof("kind") == "snapshot":
                index.replace(engine_id, response.snapshot.block_hashes)
                expected = response.snapshot.sequence_number + 1
                continue
            batch = response.batch
            if expected is None or batch.sequence_number != expected:
                raise _Resync(f"expected KV event batch {expected}, got {batch.sequence_number}")
            expected += 1
            for event in batch.events:
                kind = event.WhichOneof("kind")
                if kind == "stored":
                    index.store(engine_id, event.stored.block_hashes)
                elif kind == "removed":
                    index.remove(engine_id, event.removed.block_hashes)
                else:
                    index.clear(engine_id)

    # -- load and health (a report's `serving`) -----------------------------------------------------------------------------

    async def _watch_load(self) -> None:
        interval_ms = self.config.load_interval_ms
        stale_s = max(LOAD_STALE_MIN_S, LOAD_STALE_INTERVALS * interval_ms / 1000)
        call = self.state.stub.WatchLoad(engine_pb2.WatchLoadRequest(interval_ms=interval_ms))
        try:
            while True:
                async with asyncio.timeout(stale_s):
                    response = await call.read()
                if response is grpc.aio.EOF:
                    raise SessionEnded("the load stream ended (the engine is draining)")
                self.state.report(response.load)
        finally:
            call.cancel()


async def _first_to_end(*coroutines: Coroutine[object, object, None]) -> None:
    """Runs the coroutines until one of them ends; cancels the rest and re-raises its exception."""
    tasks = [asyncio.create_task(c) for c in coroutines]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    for task in done:
        task.result()
