"""The Triton backend: a Triton Inference Server running TensorRT-LLM's ``tensorrt_llm`` model, behind our
EngineService (``--backend triton``).

NOT RUN against a server: this machine has no GPU and no Triton server. The request/response mapping
is unit-tested with the real ``tritonclient`` objects (tests/engine/test_backend_triton.py);
docs/gpu.md says how an SRE runs it.

Protocol (TensorRT-LLM backend for Triton, decoupled mode): one gRPC bidirectional stream per request
(``start_stream`` → ``async_stream_infer`` → responses through the callback → ``stop_stream``).

- inputs: ``input_ids`` INT32 [1, n], ``input_lengths`` and ``request_output_len`` INT32 [1, 1],
  ``streaming`` BOOL, ``end_id``/``pad_id`` INT32, ``runtime_top_k`` INT32, ``runtime_top_p`` and
  ``temperature`` FP32, ``random_seed`` UINT64, ``stop_words_list`` INT32 [1, 2, k] (token stops),
  ``return_perf_metrics`` BOOL (for ``kv_cache_reused_blocks``);
- outputs: ``output_ids`` INT32 [1, beams, new tokens] (streaming: only the new tokens),
  ``kv_cache_reused_blocks`` INT32 [1, 1]; the last response carries the ``triton_final_response``
  parameter (we ask for an empty final response, so the end is always marked).
- cancel: ``stop_stream(cancel_requests=True)`` cancels the stream's RPC; Triton turns that into a
  request cancellation, and the TensorRT-LLM backend frees the request's KV blocks.

A stream per request is what makes cancelling one request possible (``stop_stream`` cancels a whole
stream); each costs one gRPC channel setup (a client object per request).

KV events: Triton does not forward TensorRT-LLM's KV cache events, so this engine publishes none and
the router places its requests by load alone. Per-request ``kv_cache_reused_blocks`` times the block size is
counted as prefix-cache hits in our load reports (GetLoad/WatchLoad ``prefix_hit_tokens``) and in
each request's usage (``cached_prompt_tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Collection, Sequence
from typing import Any

import numpy as np

from engine.backends.hosted import KvUsage, TokenDelta
from engine.kv_events import KvEventLog
from engine.request import SamplingParams

log = logging.getLogger(__name__)

REQUESTED_OUTPUTS = ("output_ids", "kv_cache_reused_blocks")
CONNECT_TIMEOUT_S = 10.0


def import_triton_grpc():
    """``tritonclient.grpc``, or an error that says how to get it."""
    try:
        import tritonclient.grpc as grpcclient
    except (ImportError, RuntimeError) as exc:  # tritonclient raises RuntimeError without its grpc deps
        raise RuntimeError(
            "the triton backend needs tritonclient: `pip install -e .[triton]` (see docs/gpu.md)"
        ) from exc
    return grpcclient


def build_inputs(
    grpcclient, context: Sequence[int], params: SamplingParams, max_new_tokens: int, eos_ids: Collection[int]
) -> list:
    """``InferInput``s of one request to the ``tensorrt_llm`` model."""

    def tensor(name: str, value: np.ndarray, datatype: str):
        item = grpcclient.InferInput(name, list(value.shape), datatype)
        item.set_data_from_numpy(value)
        return item

    def scalar(name: str, value: object, dtype: type, datatype: str):
        return tensor(name, np.array([[value]], dtype=dtype), datatype)

    greedy = params.temperature == 0.0
    inputs = [
        tensor("input_ids", np.array([list(context)], dtype=np.int32), "INT32"),
        scalar("input_lengths", len(context), np.int32, "INT32"),
        scalar("request_output_len", max_new_tokens, np.int32, "INT32"),
        scalar("streaming", True, np.bool_, "BOOL"),
        scalar("runtime_top_k", 1 if greedy else params.top_k, np.int32, "INT32"),
        scalar("random_seed", params.seed, np.uint64, "UINT64"),
        scalar("return_perf_metrics", True, np.bool_, "BOOL"),
    ]
    if not greedy:
        inputs.append(scalar("temperature", params.temperature, np.float32, "FP32"))
        if params.top_p < 1.0:
            inputs.append(scalar("runtime_top_p", params.top_p, np.float32, "FP32"))
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        end_id = min(eos_ids)
        inputs += [scalar("end_id", end_id, np.int32, "INT32"), scalar("pad_id", end_id, np.int32, "INT32")]
        stop_ids |= set(eos_ids) - {end_id}
    if stop_ids:
        inputs.append(tensor("stop_words_list", stop_words_list(sorted(stop_ids)), "INT32"))
    return inputs


def stop_words_list(token_ids: Sequence[int]) -> np.ndarray:
    """TensorRT-LLM's stop-words tensor for single-token stops: INT32 [1, 2, k], row 0 the token ids,
    row 1 the end offset of each word (1, 2, ..., k)."""
    return np.array([[list(token_ids), list(range(1, len(token_ids) + 1))]], dtype=np.int32)


def delta_from_result(
    result, sent: int, max_new_tokens: int, block_size: int, context_tokens: int
) -> TokenDelta:
    """One streamed response → new tokens, end, KV reuse. ``sent``: output tokens forwarded before."""
    output_ids = result.as_numpy("output_ids")
    token_ids = [] if output_ids is None else output_ids.reshape(-1, output_ids.shape[-1])[0].tolist()
    final_param = result.get_response().parameters.get("triton_final_response")
    finish_reason = None
    if final_param is not None and final_param.bool_param:
        finish_reason = "length" if sent + len(token_ids) >= max_new_tokens else "stop"
    reused = result.as_numpy("kv_cache_reused_blocks")
    cached = None if reused is None else min(int(reused.reshape(-1)[0]) * block_size, context_tokens)
    return TokenDelta(token_ids, finish_reason, cached)


class TritonBackend:
    """``GenerationBackend`` over a Triton server's decoupled ``tensorrt_llm`` model."""

    name = "triton"
    context_limit: int | None = (
        None  # the server's engine limit is not exposed over gRPC: the model's is used
    )

    def __init__(
        self,
        url: str,
        model_name: str,
        block_size: int,
        eos_ids: Collection[int],
        tensor_parallel_size: int,
        response_timeout_s: float,
    ) -> None:
        self.url = url
        self.model_name = model_name
        self.block_size = block_size
        self.eos_ids = tuple(eos_ids)
        self.tensor_parallel_size = tensor_parallel_size  # the server's engine's; reported, not used
        self.response_timeout_s = response_timeout_s
        # tritonclient.grpc once started (imported only where the backend runs).
        self._grpc: Any = None

    async def start(self, events: KvEventLog) -> None:
        self._grpc = import_triton_grpc()
        client = self._grpc.InferenceServerClient(self.url)
        try:
            ready = await asyncio.to_thread(
                functools.partial(client.is_model_ready, self.model_name, client_timeout=CONNECT_TIMEOUT_S)
            )
            if not ready:
                raise RuntimeError(
                    f"model {self.model_name!r} is not ready on the Triton server at {self.url}"
                )
            config = await asyncio.to_thread(
                functools.partial(client.get_model_config, self.model_name, client_timeout=CONNECT_TIMEOUT_S)
            )
            if not config.config.model_transaction_policy.decoupled:
                raise RuntimeError(
                    f"model {self.model_name!r} is not decoupled: set `model_transaction_policy "
                    "{ decoupled: true }` in its config.pbtxt (token streaming needs it)"
                )
        finally:
            client.close()
        log.info("Triton model %s at %s is ready (decoupled)", self.model_name, self.url)

    async def generate(
        self, request_id: str, context: Sequence[int], params: SamplingParams, max_new_tokens: int
    ) -> AsyncGenerator[TokenDelta]:
        loop = asyncio.get_running_loop()
        responses: asyncio.Queue = asyncio.Queue()  # at most max_new_tokens + 1 responses

        def on_response(result, error) -> None:  # tritonclient's stream thread
            with contextlib.suppress(RuntimeError):  # our loop closed: nobody waits any more
                loop.call_soon_threadsafe(responses.put_nowait, (result, error))

        client = self._grpc.InferenceServerClient(self.url)
        finished = False
        try:
            client.start_stream(callback=on_response)
            client.async_stream_infer(
                self.model_name,
                build_inputs(self._grpc, context, params, max_new_tokens, self.eos_ids),
                request_id=request_id,
                outputs=[self._grpc.InferRequestedOutput(name) for name in REQUESTED_OUTPUTS],
                enable_empty_final_response=True,
            )
            sent = 0
            while not finished:
                try:
                    result, error = await asyncio.wait_for(responses.get(), self.response_timeout_s)
                except TimeoutError:
                    raise RuntimeError(
                        f"no response from Triton within {self.response_timeout_s:.0f}s"
                    ) from None
                if error is not None:
                    raise RuntimeError(f"Triton: {error}")
                delta = delta_from_result(result, sent, max_new_tokens, self.block_size, len(context))
                sent += len(delta.token_ids)
                finished = delta.finish_reason is not None
                yield delta
        finally:
            # Cancelling an unfinished stream cancels the request in the server (frees its KV blocks).
            await asyncio.to_thread(_close_stream, client, not finished)

    async def kv_usage(self) -> KvUsage | None:
        return None  # Triton reports KV use in its Prometheus metrics, not per request

    async def close(self) -> None:
        pass


def _close_stream(client, cancel: bool) -> None:
    try:
        client.stop_stream(cancel_requests=cancel)
    finally:
        client.close()
