"""HostedEngine behind the real EngineService over a real gRPC socket, driving a scripted backend.

The scripted backend stands in for TensorRT-LLM / Triton only in what they compute (token ids, KV
events in TensorRT-LLM's documented dict shapes); what is under test is ours: the stop rule, text,
usage, cancellation reaching the backend, failure handling, load reports and the KV event stream the
router indexes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest

from chatmesh.block_hash import block_hashes
from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError
from engine.backends.hosted import HostedEngine, KvUsage, TokenDelta
from engine.backends.trtllm import KvEventTranslator
from engine.config import EngineConfig
from engine.kv_events import KvEventLog
from engine.model.runner import ModelSpec
from engine.request import SamplingParams
from tests.engine.core_helpers import prompt, tokenizer, word_tokens
from tests.engine.service_client import TIMEOUT_S, Stream, start_frame, wait_until
from tests.engine.test_service_inprocess import served


def trtllm_stored_event(event_id: int, tokens: list[int], parent: int | None, first_hash: int) -> dict:
    """A ``stored`` event as TensorRT-LLM's ``get_kv_cache_events`` returns it (its own block hashes)."""
    blocks = [
        {
            "type": "stored_block",
            "block_hash": first_hash + i,
            "tokens": [
                {"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens[s : s + 16]
            ],
            "cache_level": 0,
            "priority": 35,
        }
        for i, s in enumerate(range(0, len(tokens) - 15, 16))
    ]
    return {
        "event_id": event_id,
        "window_size": 8192,
        "data": {"type": "stored", "parent_hash": parent, "blocks": blocks},
    }


class ScriptedBackend:
    """Streams ``words`` (``per_delta`` tokens per response); records aborts; stores the prompt's
    blocks as TensorRT-LLM KV events when a request starts."""

    name = "scripted"
    tensor_parallel_size = 2
    context_limit = 4096

    def __init__(self, per_delta: int = 2, stop_after: int | None = None, cached: int | None = None) -> None:
        self.per_delta = per_delta
        self.stop_after = stop_after  # ends streams itself ("stop", as at its own EOS) after this many tokens
        self.cached = cached
        self.fail_with: str | None = None
        self.aborted: list[str] = []
        self.completed: list[str] = []
        self.contexts: dict[str, list[int]] = {}
        self.pace_s = 0.0
        self._translator = KvEventTranslator(16, EngineConfig().block_hash_seed)
        self._events: KvEventLog | None = None
        self._next_event = 0

    async def start(self, events: KvEventLog) -> None:
        self._events = events

    async def generate(
        self, request_id: str, context: Sequence[int], params: SamplingParams, max_new_tokens: int
    ) -> AsyncIterator[TokenDelta]:
        self.contexts[request_id] = list(context)
        event = trtllm_stored_event(self._next_event, list(context), None, 1000 * (self._next_event + 1))
        self._next_event += 1
        self._translator.apply([event], self._events)
        self._events.flush()
        words, sent, done = word_tokens(), 0, False
        limit = min(max_new_tokens, self.stop_after or max_new_tokens)
        try:
            while sent < limit:
                if self.fail_with:
                    raise RuntimeError(self.fail_with)
                await asyncio.sleep(self.pace_s)
                n = min(self.per_delta, limit - sent)
                ids = [words[(sent + i) % len(words)] for i in range(n)]
                sent += n
                done = sent >= limit  # like TensorRT-LLM's result.finished: nothing left to abort
                reason = "stop" if sent == self.stop_after else "length" if done else None
                yield TokenDelta(ids, reason, self.cached)
        finally:
            (self.completed if done else self.aborted).append(request_id)

    async def kv_usage(self) -> KvUsage | None:
        return KvUsage(used_blocks=7, total_blocks=100)

    async def close(self) -> None:
        pass


def hosted(backend: ScriptedBackend, **config) -> HostedEngine:
    tok = tokenizer()
    spec = ModelSpec("SmolLM2-135M-Instruct", 30, 3, 64, tok.vocab_size, 8192)
    engine = HostedEngine(EngineConfig(backend="trtllm", **config), backend, tok, spec)
    engine.load(timeout_s=10)
    return engine


async def test_hosted_engine_streams_backend_tokens_and_reports_itself():
    backend = ScriptedBackend(per_delta=3)
    async with served(hosted(backend)) as (stub, _, _):
        info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT_S)
        assert (info.backend, info.tensor_parallel_size, info.kv_blocks_total) == ("scripted", 2, 100)
        assert info.context_length == 4096  # the backend's limit, below the model's 8192
        outcome = await Stream.start(stub, start_frame("r1", prompt(20), max_tokens=7)).rest()
    words = word_tokens()
    assert outcome.token_ids == [words[i] for i in range(7)]
    assert outcome.text == tokenizer().decode(outcome.token_ids)
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert (outcome.finished.usage.prompt_tokens, outcome.finished.usage.completion_tokens) == (20, 7)
    assert backend.completed == ["r1"]


async def test_a_stop_string_ends_the_request_and_aborts_it_in_the_backend():
    backend = ScriptedBackend(per_delta=1)
    stop = tokenizer().decode(word_tokens()[3:5]).strip()
    async with served(hosted(backend)) as (stub, _, _):
        frame = start_frame("r1", prompt(20), max_tokens=50)
        frame.sampling.stop.append(stop)
        outcome = await Stream.start(stub, frame).rest()
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_STOP
    assert outcome.finished.matched_stop == stop
    assert stop not in outcome.text
    assert len(outcome.token_ids) < 50
    await wait_until(lambda: _true(backend.aborted == ["r1"]), what="the backend abort")


async def test_a_client_cancel_aborts_the_backend_request():
    backend = ScriptedBackend(per_delta=1)
    backend.pace_s = 0.02
    async with served(hosted(backend)) as (stub, _, _):
        stream = Stream.start(stub, start_frame("r1", prompt(20), max_tokens=1000))
        assert (await stream.read()).WhichOneof("kind") == "accepted"
        assert (await stream.read()).WhichOneof("kind") == "tokens"
        stream.send_cancel()
        outcome = await stream.rest()
        assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_CANCELLED
        await wait_until(lambda: _true(backend.aborted == ["r1"]), what="the backend abort")


async def test_the_backends_own_stop_is_honoured_and_cached_tokens_reach_usage_and_load():
    backend = ScriptedBackend(per_delta=2, stop_after=4, cached=32)
    async with served(hosted(backend)) as (stub, _, _):
        outcome = await Stream.start(stub, start_frame("r1", prompt(40), max_tokens=10)).rest()
        load = (await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S)).load
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_STOP
    assert outcome.finished.usage.cached_prompt_tokens == 32
    assert (load.prefix_hit_tokens, load.prefix_queried_tokens, load.generated_tokens) == (32, 40, 4)
    assert (load.kv_blocks_used, load.kv_blocks_total) == (7, 100)


async def test_resumed_output_is_context_for_the_backend_and_not_sent_again():
    backend = ScriptedBackend(per_delta=2)
    resumed = word_tokens()[:3]
    async with served(hosted(backend)) as (stub, _, _):
        frame = start_frame("r1", prompt(20), max_tokens=5, resumed_output_token_ids=resumed)
        outcome = await Stream.start(stub, frame).rest()
    assert backend.contexts["r1"] == prompt(20) + resumed
    assert outcome.first_index == 3 and len(outcome.token_ids) == 2  # max_tokens counts resumed output


async def test_resumed_output_that_already_reached_max_tokens_finishes_without_the_backend():
    backend = ScriptedBackend(per_delta=2)
    resumed = word_tokens()[:4]
    async with served(hosted(backend)) as (stub, _, _):
        frame = start_frame("r1", prompt(20), max_tokens=4, resumed_output_token_ids=resumed)
        outcome = await Stream.start(stub, frame).rest()
    assert outcome.token_ids == [] and outcome.finished.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert (outcome.finished.usage.prompt_tokens, outcome.finished.usage.completion_tokens) == (24, 0)
    assert "r1" not in backend.contexts


async def test_a_backend_failure_fails_the_engine_and_its_requests():
    backend = ScriptedBackend(per_delta=1)
    backend.fail_with = "CUDA error: an illegal memory access was encountered"
    engine = hosted(backend)
    async with served(engine) as (stub, service, _):
        with pytest.raises(ServiceError) as err:
            await Stream.start(stub, start_frame("r1", prompt(20), max_tokens=5)).rest()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert "illegal memory access" in err.value.message
        assert service.failed.is_set() and not service.serving
        with pytest.raises(ServiceError) as refused:
            await Stream.start(stub, start_frame("r2", prompt(20), max_tokens=5)).rest()
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE


async def test_unreadable_kv_usage_does_not_stop_serving():
    class NoStats(ScriptedBackend):
        async def kv_usage(self) -> KvUsage | None:
            raise RuntimeError("iteration stats are off")

    async with served(hosted(NoStats())) as (stub, service, _):
        outcome = await Stream.start(stub, start_frame("r1", prompt(20), max_tokens=3)).rest()
        load = (await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S)).load
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert load.serving and load.kv_blocks_total == 0 and not service.failed.is_set()


async def test_kv_events_of_a_hosted_engine_carry_our_chained_block_hashes():
    # The router indexes this engine like ours: TensorRT-LLM's own hashes never leave the engine.
    backend = ScriptedBackend()
    async with served(hosted(backend)) as (stub, _, _):
        events = stub.KvEvents(engine_pb2.KvEventsRequest(), timeout=TIMEOUT_S)
        first = await events.read()
        assert list(first.snapshot.block_hashes) == []
        context = prompt(40)
        await Stream.start(stub, start_frame("r1", context, max_tokens=2)).rest()
        batch = (await events.read()).batch
        events.cancel()
    [event] = batch.events
    assert list(event.stored.block_hashes) == block_hashes(context)  # 2 full blocks of 16
    assert not event.stored.HasField("parent_block_hash")


async def _true(value: bool) -> bool:
    return value
