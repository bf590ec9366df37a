"""The TensorRT-LLM backend: NVIDIA's ``tensorrt_llm.LLM`` behind our EngineService (``--backend trtllm``).

NOT RUN: this machine has no GPU and ``tensorrt-llm`` is not installable here (NVIDIA's index only).
Everything below is written against TensorRT-LLM's documented LLM API; the pure translation code
(sampling parameters, streamed outputs, KV cache events) is unit-tested against recorded shapes from
that documentation (tests/engine/test_backend_trtllm.py). docs/gpu.md says what an SRE runs.

How it is driven:
- ``LLM(model=<HF dir>, tensor_parallel_size=N, pipeline_parallel_size=P, skip_tokenizer_init=True, kv_cache_config=
  KvCacheConfig(enable_block_reuse=True, event_buffer_max_size=..., tokens_per_block=<our block
  size>))``. Prompts go in as token ids (our tokenizer is the contract); text and stop strings are
  ours (``HostedEngine``), so TensorRT-LLM's detokenizer is off.
- ``generate_async(ids, SamplingParams(...), streaming=True)``: each ``RequestOutput`` carries the
  cumulative ``outputs[0].token_ids``; we forward the new ones. ``abort()`` when our client cancels
  or our stop rule ends the request first.
- ``get_kv_cache_events(timeout)`` in a loop: ``created``/``stored``/``removed``/``updated`` events
  become our ``KvEventLog`` batches (``KvEventTranslator``).

Block hashes (how the router indexes TensorRT-LLM engines exactly like ours): TensorRT-LLM hashes
blocks its own way, but every ``stored`` event lists each block's token ids and its parent block.
We run ``tokens_per_block`` = our ``--block-size`` and recompute *our* chained hash
(``chatmesh.block_hash.hash_block``) from those tokens, keeping a map TensorRT-LLM hash → our hash to
chain children and translate removals. The router then hashes requests for this engine with the
block size and seed it advertises in GetModelInfo, as for any of our engines. Blocks our hash cannot
describe (partial blocks, LoRA or multimodal extra ids) are not published — the router simply does
not count them as hits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatmesh.block_hash import hash_block
from engine.backends.hosted import KvUsage, TokenDelta
from engine.kv_events import KvEventLog
from engine.request import SamplingParams

log = logging.getLogger(__name__)

EVENT_BUFFER = 16384  # events TensorRT-LLM keeps for us between polls (event_buffer_max_size)
EVENT_POLL_TIMEOUT_S = 0.2  # get_kv_cache_events blocks at most this long when there is nothing new
STATS_TIMEOUT_S = 0.1


def import_tensorrt_llm():
    """``tensorrt_llm``, or an error that says how to get it. Only ``--backend trtllm`` needs it."""
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise RuntimeError(
            "the trtllm backend needs TensorRT-LLM on a CUDA machine: `pip install tensorrt-llm` from "
            "NVIDIA's index (https://pypi.nvidia.com) or use NVIDIA's TensorRT-LLM container; see docs/gpu.md"
        ) from exc
    return tensorrt_llm


# -- requests and outputs ----------------------------------------------------------------------------


def sampling_kwargs(params: SamplingParams, eos_ids: Collection[int], max_new_tokens: int) -> dict:
    """Keyword arguments of ``tensorrt_llm.SamplingParams`` for one request.

    Greedy (temperature 0) is ``top_k=1``: TensorRT-LLM's samplers do not take a temperature of 0.
    ``end_id``/``pad_id`` are always given: with ``skip_tokenizer_init`` nothing else supplies them.
    EOS and stop token ids are passed so TensorRT-LLM stops by itself; our stop rule sees the same
    tokens and ends the request first anyway. Stop strings stay ours (they need our detokenizer).
    """
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    greedy = params.temperature == 0.0
    return {
        "max_tokens": max_new_tokens,
        "temperature": None if greedy else params.temperature,
        "top_k": 1 if greedy else (params.top_k or None),
        "top_p": None if greedy or params.top_p >= 1.0 else params.top_p,
        "seed": params.seed,
        "end_id": min(eos_ids),  # required without a tokenizer; ignore_eos makes it inert
        "pad_id": min(eos_ids),
        "stop_token_ids": sorted(stop_ids) or None,
        "ignore_eos": params.ignore_eos,
        "detokenize": False,
        "return_perf_metrics": True,  # per-request KV reuse: how many context tokens were cached
    }


def delta_from_output(output: Any, sent: int, block_size: int, context_tokens: int) -> TokenDelta:
    """The news in one streamed ``RequestOutput`` after ``sent`` output tokens were forwarded."""
    completion = output.outputs[0]
    finished = bool(output.finished)
    reused = _reused_blocks(completion)
    return TokenDelta(
        token_ids=list(completion.token_ids[sent:]),
        finish_reason=(completion.finish_reason or "stop") if finished else None,
        cached_prompt_tokens=None if reused is None else min(reused * block_size, context_tokens),
    )


def _reused_blocks(completion: object) -> int | None:
    metrics = getattr(completion, "request_perf_metrics", None)
    kv = getattr(metrics, "kv_cache_metrics", None)
    reused = getattr(kv, "num_reused_blocks", None)
    return None if reused is None else int(reused)


def kv_usage_from_stats(stats: Iterable[Mapping]) -> KvUsage | None:
    """The newest ``kvCacheStats`` of ``LLM.get_stats`` iteration records, if any."""
    usage = None
    for record in stats:
        kv = record.get("kvCacheStats")
        if kv and "maxNumBlocks" in kv and "usedNumBlocks" in kv:
            usage = KvUsage(int(kv["usedNumBlocks"]), int(kv["maxNumBlocks"]))
    return usage


# -- KV cache events ---------------------------------------------------------------------------------


@dataclass
class TranslatorStats:
    stored: int = 0
    removed: int = 0
    skipped: int = 0  # stored blocks our hash cannot describe (or whose parent we never saw)
    resyncs: int = 0  # gaps in TensorRT-LLM's event ids, each answered by clearing the index


class KvEventTranslator:
    """TensorRT-LLM KV cache events (the dicts ``LLM.get_kv_cache_events`` returns) → our KV events.

    Shapes (TensorRT-LLM ``KVCacheEventSerializer``)::

        {"event_id": 7, "window_size": 4096, "data": {...}}
        data: {"type": "created", "num_blocks_per_cache_level": [gpu, host]}
              {"type": "stored", "parent_hash": h | None, "blocks": [{"type": "stored_block",
                  "block_hash": h, "tokens": [{"type": "unique_token", "token_id": t,
                  "token_extra_id": 0}, ...], "cache_level": 0, "priority": 35, ...}]}
              {"type": "removed", "block_hashes": [h, ...]}
              {"type": "updated", "block_hash": h, "cache_level": {"type": "event_diff",
                  "new_value": 1, "old_value": 0}, "priority": {...}}

    ``updated`` moves a block between GPU and host memory (or changes its eviction priority): it stays
    reusable, so the router's view does not change and nothing is published.

    Event ids must be consecutive; a gap means TensorRT-LLM's buffer overflowed and events were lost.
    Then every block we published is reported removed and the map starts over: the router never
    believes in a block that is gone, at the cost of missing hits until blocks are stored again.
    """

    def __init__(self, block_size: int, seed: int) -> None:
        self.block_size = block_size
        self.seed = seed
        self.stats = TranslatorStats()
        self._ours: dict[object, int] = {}  # TensorRT-LLM block hash → our chained hash
        self._next_event_id: int | None = None

    def apply(self, events: Iterable[Mapping], log_: KvEventLog) -> None:
        """Records ``events`` into ``log_`` (``stored``/``removed``; the caller flushes)."""
        for event in events:
            self._check_sequence(event.get("event_id"), log_)
            data = event["data"]
            kind = data.get("type")
            if kind == "created":
                log.info(
                    "TensorRT-LLM KV pool: %s blocks per cache level", data["num_blocks_per_cache_level"]
                )
            elif kind == "stored":
                self._stored(data, log_)
            elif kind == "removed":
                ours = [h for h in (self._ours.pop(t, None) for t in data["block_hashes"]) if h is not None]
                self.stats.removed += len(ours)
                log_.removed(ours)
            elif kind != "updated":
                log.warning("unknown TensorRT-LLM KV event type %r ignored", kind)

    def _check_sequence(self, event_id: object, log_: KvEventLog) -> None:
        if not isinstance(event_id, int):
            return
        if self._next_event_id is not None and event_id != self._next_event_id:
            log.warning(
                "TensorRT-LLM KV events %d..%d were lost (event buffer overflow): clearing the published index",
                self._next_event_id,
                event_id - 1,
            )
            self.stats.resyncs += 1
            log_.removed(list(self._ours.values()))
            self._ours.clear()
        self._next_event_id = event_id + 1

    def _stored(self, data: Mapping, log_: KvEventLog) -> None:
        parent_trt = data.get("parent_hash")
        parent = None if parent_trt is None else self._ours.get(parent_trt)
        if parent_trt is not None and parent is None:  # a chain we could not follow
            self.stats.skipped += len(data["blocks"])
            return
        first_parent, hashes = parent, list[int]()
        for block in data["blocks"]:
            tokens = block["tokens"]
            if len(tokens) != self.block_size or any(t.get("token_extra_id", 0) for t in tokens):
                # Ours hashes full blocks of plain token ids only; the rest of the chain is unreachable.
                self.stats.skipped += len(data["blocks"]) - len(hashes)
                break
            parent = hash_block(parent, [t["token_id"] for t in tokens], self.seed)
            self._ours[block["block_hash"]] = parent
            hashes.append(parent)
        self.stats.stored += len(hashes)
        log_.stored(hashes, first_parent)


# -- the backend -------------------------------------------------------------------------------------


class TrtllmBackend:
    """``GenerationBackend`` over an in-process ``tensorrt_llm.LLM`` (which owns the GPUs and, with
    more than one rank, its MPI workers: on one node it spawns them itself; across nodes they are the
    ranks ``mpirun ... trtllm-llmapi-launch`` started, which this process joins as rank 0)."""

    name = "trtllm"

    def __init__(
        self,
        model_dir: Path,
        tensor_parallel_size: int,
        pipeline_parallel_size: int,
        block_size: int,
        block_hash_seed: int,
        eos_ids: Collection[int],
        gpu_memory_fraction: float,
    ) -> None:
        self.model_dir = model_dir
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.block_size = block_size
        self.eos_ids = tuple(eos_ids)
        self.gpu_memory_fraction = gpu_memory_fraction
        self.translator = KvEventTranslator(block_size, block_hash_seed)
        self.context_limit: int | None = None
        # tensorrt_llm.LLM once started (the library is imported only on GPU nodes).
        self._llm: Any = None
        self._events_task: asyncio.Task | None = None

    async def start(self, events: KvEventLog) -> None:
        trtllm = import_tensorrt_llm()
        from tensorrt_llm.llmapi import KvCacheConfig

        kv_cache_config = KvCacheConfig(
            enable_block_reuse=True,
            event_buffer_max_size=EVENT_BUFFER,
            tokens_per_block=self.block_size,
            free_gpu_memory_fraction=self.gpu_memory_fraction,
        )
        log.info(
            "loading %s into TensorRT-LLM (tensor parallel %d, pipeline parallel %d, %d tokens per KV block)",
            self.model_dir,
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.block_size,
        )
        self._llm = await asyncio.to_thread(
            trtllm.LLM,
            model=str(self.model_dir),
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            skip_tokenizer_init=True,
            kv_cache_config=kv_cache_config,
            enable_iter_perf_stats=True,
        )
        self.context_limit = getattr(self._llm.args, "max_seq_len", None)
        self._events_task = asyncio.create_task(self._pump_events(events))

    async def _pump_events(self, events: KvEventLog) -> None:
        while True:
            batch = await asyncio.to_thread(self._llm.get_kv_cache_events, EVENT_POLL_TIMEOUT_S)
            if batch:
                self.translator.apply(batch, events)
                events.flush()

    async def generate(
        self, request_id: str, context: Sequence[int], params: SamplingParams, max_new_tokens: int
    ) -> AsyncGenerator[TokenDelta]:
        from tensorrt_llm import SamplingParams as TrtSamplingParams

        sampling = TrtSamplingParams(**sampling_kwargs(params, self.eos_ids, max_new_tokens))
        result = self._llm.generate_async(list(context), sampling_params=sampling, streaming=True)
        sent = 0
        try:
            async for output in result:
                delta = delta_from_output(output, sent, self.block_size, len(context))
                sent += len(delta.token_ids)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if not result.finished:
                result.abort()

    async def kv_usage(self) -> KvUsage | None:
        return kv_usage_from_stats(await asyncio.to_thread(self._llm.get_stats, STATS_TIMEOUT_S))

    async def close(self) -> None:
        if self._events_task is not None:
            self._events_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._events_task
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)
