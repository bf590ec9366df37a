"""The Triton backend with the real ``tritonclient``: request tensors, streamed responses, cancellation.

No Triton server runs here (no GPU). ``ScriptedTriton`` is a small gRPC server speaking Triton's own
protocol (``inference.GRPCInferenceService`` from tritonclient's protos) the way the TensorRT-LLM
backend answers in decoupled mode: one response per new token, then an empty final response. It
stands in for the server's computation only; the client side under test — tritonclient's
``start_stream``/``async_stream_infer``/``stop_stream``, our tensors, final-response and cancel
handling — runs for real over a real socket.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import InferInput, InferResult, model_config_pb2, service_pb2, service_pb2_grpc

from chatmesh.engine.v1 import engine_pb2
from engine.backends.hosted import HostedEngine
from engine.backends.triton import TritonBackend, build_inputs, delta_from_result, stop_words_list
from engine.config import EngineConfig
from engine.model.runner import ModelSpec
from engine.request import SamplingParams
from meshkit.launcher import free_port
from tests.engine.core_helpers import prompt, tokenizer, word_tokens
from tests.engine.service_client import TIMEOUT_S, Stream, start_frame, wait_until
from tests.engine.test_service_inprocess import served

EOS = (2, 0)
MODEL = "tensorrt_llm"


def decoded(inputs: list[InferInput]) -> dict[str, np.ndarray]:
    """What the server receives: each tensor's values in its shape."""
    types = {"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_}
    out = {}
    for item in inputs:
        tensor = item._get_tensor()
        out[item.name()] = np.frombuffer(item._get_content(), dtype=types[tensor.datatype]).reshape(
            tensor.shape
        )
    return out


def test_greedy_request_tensors_follow_the_tensorrt_llm_model_inputs():
    params = SamplingParams(temperature=0.0, seed=9, stop_token_ids=frozenset({7}))
    sent = decoded(build_inputs(grpcclient, [5, 6, 7, 8], params, 12, EOS))
    assert sent["input_ids"].tolist() == [[5, 6, 7, 8]]
    assert sent["input_ids"].dtype == np.int32
    assert (sent["input_lengths"].tolist(), sent["request_output_len"].tolist()) == ([[4]], [[12]])
    assert sent["streaming"].tolist() == [[True]] and sent["return_perf_metrics"].tolist() == [[True]]
    assert (sent["runtime_top_k"].tolist(), sent["random_seed"].tolist()) == ([[1]], [[9]])
    assert (sent["end_id"].tolist(), sent["pad_id"].tolist()) == ([[0]], [[0]])
    # The other EOS (2) and the stop token (7) as single-token stop words.
    assert sent["stop_words_list"].tolist() == [[[2, 7], [1, 2]]]
    assert "temperature" not in sent and "runtime_top_p" not in sent


def test_sampled_request_tensors_carry_temperature_and_top_p_and_may_ignore_eos():
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=20, seed=3, ignore_eos=True)
    sent = decoded(build_inputs(grpcclient, [5], params, 4, EOS))
    assert sent["temperature"].tolist() == [[pytest.approx(0.8)]]
    assert sent["runtime_top_p"].tolist() == [[pytest.approx(0.95)]]
    assert sent["runtime_top_k"].tolist() == [[20]]
    assert "end_id" not in sent and "stop_words_list" not in sent


def test_stop_words_list_offsets():
    assert stop_words_list([4, 9, 11]).tolist() == [[[4, 9, 11], [1, 2, 3]]]


def response(request_id: str, token_ids: list[int], final: bool, reused: int | None = None):
    """A decoupled tensorrt_llm model response as Triton sends it."""
    message = service_pb2.ModelInferResponse(model_name=MODEL, id=request_id)
    if token_ids or not final:
        ids = np.array([[token_ids]], dtype=np.int32)  # [batch 1, beams 1, new tokens]
        message.outputs.add(name="output_ids", datatype="INT32", shape=list(ids.shape))
        message.raw_output_contents.append(ids.tobytes())
    if reused is not None:
        message.outputs.add(name="kv_cache_reused_blocks", datatype="INT32", shape=[1, 1])
        message.raw_output_contents.append(np.array([[reused]], dtype=np.int32).tobytes())
    message.parameters["triton_final_response"].bool_param = final
    return message


def test_responses_become_deltas_and_the_final_one_ends_the_stream():
    first = delta_from_result(InferResult(response("r", [11], False, reused=2)), 0, 3, 16, 40)
    assert (list(first.token_ids), first.finish_reason, first.cached_prompt_tokens) == ([11], None, 32)
    at_limit = delta_from_result(InferResult(response("r", [], True)), 3, 3, 16, 40)
    assert (list(at_limit.token_ids), at_limit.finish_reason) == ([], "length")
    early = delta_from_result(InferResult(response("r", [], True)), 1, 3, 16, 40)
    assert early.finish_reason == "stop"  # the server stopped before the limit: its end id or a stop word


class ScriptedTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers like a decoupled tensorrt_llm model: one response per word token, then an empty final one."""

    def __init__(self, decoupled: bool = True, pace_s: float = 0.0) -> None:
        self.decoupled = decoupled
        self.pace_s = pace_s
        self.requests: list[dict[str, np.ndarray]] = []
        self.cancelled: list[str] = []

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=request.name == MODEL)

    async def ModelConfig(self, request, context):
        policy = model_config_pb2.ModelTransactionPolicy(decoupled=self.decoupled)
        return service_pb2.ModelConfigResponse(
            config=model_config_pb2.ModelConfig(name=MODEL, model_transaction_policy=policy)
        )

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            types = {"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_}
            tensors = {
                t.name: np.frombuffer(raw, dtype=types[t.datatype]).reshape(t.shape)
                for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)
            }
            self.requests.append(tensors)
            words = word_tokens()
            try:
                for i in range(int(tensors["request_output_len"][0, 0])):
                    await asyncio.sleep(self.pace_s)
                    yield service_pb2.ModelStreamInferResponse(
                        infer_response=response(request.id, [words[i]], False, reused=1)
                    )
                if request.parameters["triton_enable_empty_final_response"].bool_param:
                    yield service_pb2.ModelStreamInferResponse(infer_response=response(request.id, [], True))
            except asyncio.CancelledError:
                self.cancelled.append(request.id)
                raise


@pytest.fixture
async def triton_server():
    servicer = ScriptedTriton()
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(0)


async def triton_engine(url: str) -> HostedEngine:
    """Loads in a thread: load() blocks until the backend answers, and the scripted server runs on this loop."""
    return await asyncio.to_thread(_load_triton_engine, url)


def _load_triton_engine(url: str) -> HostedEngine:
    tok = tokenizer()
    spec = ModelSpec("SmolLM2-135M-Instruct", 30, 3, 64, tok.vocab_size, 8192)
    backend = TritonBackend(url, MODEL, 16, tok.eos_token_ids, 1, response_timeout_s=10)
    engine = HostedEngine(EngineConfig(backend="triton"), backend, tok, spec)
    engine.load(timeout_s=30)
    return engine


async def test_triton_streams_tokens_and_counts_reused_blocks_as_prefix_hits(triton_server):
    servicer, url = triton_server
    async with served(await triton_engine(url)) as (stub, _, _):
        outcome = await Stream.start(stub, start_frame("t1", prompt(20), max_tokens=4)).rest()
        load = (await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S)).load
    assert outcome.token_ids == word_tokens()[:4]
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert outcome.finished.usage.cached_prompt_tokens == 16
    assert (load.prefix_hit_tokens, load.prefix_queried_tokens) == (16, 20)
    [sent] = servicer.requests
    assert sent["input_ids"].tolist() == [prompt(20)]
    assert servicer.cancelled == []


async def test_cancelling_a_request_cancels_its_triton_stream(triton_server):
    servicer, url = triton_server
    servicer.pace_s = 0.05
    async with served(await triton_engine(url)) as (stub, _, _):
        stream = Stream.start(stub, start_frame("t1", prompt(20), max_tokens=200))
        await stream.read()  # accepted
        await stream.read()  # a token
        stream.send_cancel()
        outcome = await stream.rest()
        assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_CANCELLED
        await wait_until(lambda: _is(servicer.cancelled, ["t1"]), what="the server to see the cancel")


async def test_a_model_that_is_not_decoupled_is_refused_at_start(triton_server):
    servicer, url = triton_server
    servicer.decoupled = False
    with pytest.raises(RuntimeError, match="decoupled"):
        await triton_engine(url)


async def _is(value: object, expected: object) -> bool:
    return value == expected
