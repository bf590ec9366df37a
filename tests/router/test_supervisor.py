"""How an engine's KV event stream is applied to the index, including the cases a healthy engine never
produces on demand: a sequence gap, a subscriber overflow (ABORTED), a restart under the same address.

The streams here are scripted lists of real ``KvEventsResponse`` messages; the live gRPC path is
covered by test_index_events.py.
"""

import grpc
import pytest
from prometheus_client import CollectorRegistry

from chatmesh.block_hash import block_hashes
from chatmesh.engine.v1 import engine_pb2
from router.config import RouterConfig
from router.engines import EngineState
from router.index import PrefixIndex
from router.metrics import RouterMetrics
from router.supervisor import EngineSupervisor, SessionEnded

A = block_hashes(list(range(64)))  # 4 chained blocks
B = block_hashes(list(range(500, 564)))
INSTANCE = "instance-1"


def snapshot(
    sequence_number: int, hashes: list[int], instance: str = INSTANCE
) -> engine_pb2.KvEventsResponse:
    return engine_pb2.KvEventsResponse(
        engine_instance_id=instance,
        snapshot=engine_pb2.KvSnapshot(sequence_number=sequence_number, block_hashes=hashes),
    )


def batch(sequence_number: int, *events: engine_pb2.KvEvent) -> engine_pb2.KvEventsResponse:
    return engine_pb2.KvEventsResponse(
        engine_instance_id=INSTANCE,
        batch=engine_pb2.KvEventBatch(sequence_number=sequence_number, events=events),
    )


def stored(hashes: list[int]) -> engine_pb2.KvEvent:
    return engine_pb2.KvEvent(stored=engine_pb2.BlocksStored(block_hashes=hashes))


def removed(hashes: list[int]) -> engine_pb2.KvEvent:
    return engine_pb2.KvEvent(removed=engine_pb2.BlocksRemoved(block_hashes=hashes))


CLEARED = engine_pb2.KvEvent(cleared=engine_pb2.AllBlocksCleared())


class ScriptedCall:
    """A server stream that yields its frames, then ends (or raises ``error``)."""

    def __init__(self, frames: list, error: Exception | None = None) -> None:
        self._frames = frames
        self._error = error
        self.cancelled = False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for frame in self._frames:
            yield frame
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedStub:
    def __init__(self, *calls: ScriptedCall) -> None:
        self.calls = list(calls)
        self.subscriptions = 0

    def KvEvents(self, request):
        self.subscriptions += 1
        return self.calls.pop(0)


def aborted() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.ABORTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "more than 1024 batches behind"
    )


def supervisor(stub: ScriptedStub) -> tuple[EngineSupervisor, PrefixIndex, RouterMetrics]:
    index = PrefixIndex()
    index.add_engine("e", 1000)
    metrics = RouterMetrics(CollectorRegistry())
    state = EngineState("e", "127.0.0.1:1", channel=None, stub=stub)
    return EngineSupervisor(state, index, RouterConfig(), metrics), index, metrics


def resyncs(metrics: RouterMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value(
        "chatmesh_router_kv_resyncs_total", {"engine": "e", "reason": reason}
    )


async def test_snapshot_then_batches_store_remove_and_clear():
    stub = ScriptedStub(
        ScriptedCall(
            [
                snapshot(7, A[:2]),
                batch(8, stored(A[2:]), stored(B)),
                batch(9, removed(A[3:])),
            ]
        )
    )
    sup, index, _ = supervisor(stub)
    with pytest.raises(SessionEnded, match="ended"):
        await sup._follow_kv_events(INSTANCE)
    assert index.match(A, ["e"]) == {"e": 3} and index.match(B, ["e"]) == {"e": 4}

    stub = ScriptedStub(ScriptedCall([snapshot(1, A), batch(2, CLEARED, stored(B[:1]))]))
    sup, index, _ = supervisor(stub)
    with pytest.raises(SessionEnded):
        await sup._follow_kv_events(INSTANCE)
    assert index.match(A, ["e"]) == {"e": 0} and index.size("e") == 1


async def test_a_sequence_gap_drops_the_engines_entries_and_resubscribes_from_a_snapshot():
    stub = ScriptedStub(
        ScriptedCall([snapshot(3, A), batch(4, stored(B[:2])), batch(6, stored(B[2:]))]),  # 5 is missing
        ScriptedCall([snapshot(6, B)]),
    )
    sup, index, metrics = supervisor(stub)
    with pytest.raises(SessionEnded):
        await sup._follow_kv_events(INSTANCE)
    assert stub.subscriptions == 2 and resyncs(metrics, "gap") == 1
    assert index.match(A, ["e"]) == {"e": 0}, "the old entries went with the gap"
    assert index.match(B, ["e"]) == {"e": 4}


async def test_an_overflowed_subscription_resubscribes():
    stub = ScriptedStub(ScriptedCall([snapshot(1, A)], error=aborted()), ScriptedCall([snapshot(90, B)]))
    sup, index, metrics = supervisor(stub)
    with pytest.raises(SessionEnded):
        await sup._follow_kv_events(INSTANCE)
    assert resyncs(metrics, "overflow") == 1
    assert index.match(A, ["e"]) == {"e": 0} and index.match(B, ["e"]) == {"e": 4}


async def test_a_new_instance_id_ends_the_session():
    stub = ScriptedStub(ScriptedCall([snapshot(1, A, instance="instance-2")]))
    sup, _, _ = supervisor(stub)
    with pytest.raises(SessionEnded, match="restarted"):
        await sup._follow_kv_events(INSTANCE)
