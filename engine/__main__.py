"""``python -m engine``: one inference engine replica (EngineService)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import grpc

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.model_files import bundled_model_path
from chatmesh.tokenizer import load_tokenizer
from engine.backends.loading import load_hosted_engine
from engine.config import HOSTED_BACKENDS, EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import EngineMetrics
from engine.model.loading import create_runner
from engine.service import EngineService, ServedEngine
from meshkit import serving, telemetry
from meshkit.config import ServiceArgs

log = logging.getLogger("engine")


def parse_args(argv: list[str] | None = None):
    d = EngineConfig()
    args = ServiceArgs("engine", "Serves a model with a paged KV cache and continuous batching.")
    args.add_server_flags(port=50061)
    args.add("engine-id", d.engine_id, "name of this replica in logs and metrics")
    args.add(
        "model",
        "",
        "model path: a GGUF file or a Hugging Face directory; empty: the bundled SmolLM2-135M-Instruct",
    )
    args.add(
        "backend",
        d.backend,
        "cpu (the real model) | null (no compute: mesh load tests) | cuda | trtllm | triton (GPU: docs/gpu.md)",
    )
    args.add("threads", d.num_threads, "compute threads of the cpu backend, per rank (0: its default)")
    args.add(
        "tensor-parallel-size",
        d.tensor_parallel_size,
        "cpu backend: shard the model over this many ranks (processes; at most the model's KV heads)",
    )
    args.add("num-kv-blocks", d.num_kv_blocks, "KV blocks in the pool (0: as many as --kv-memory-gib holds)")
    args.add("kv-memory-gib", d.kv_memory_gib, "memory for KV blocks when --num-kv-blocks is 0")
    args.add("block-size", d.block_size, "tokens per KV block (the unit of prefix caching and block hashes)")
    args.add("enable-prefix-caching", d.enable_prefix_caching, "reuse cached KV blocks of equal prefixes")
    args.add("max-batched-tokens", d.max_batched_tokens, "token budget of one scheduler step")
    args.add("max-running-requests", d.max_running_requests, "requests decoded together at most")
    args.add("max-waiting-requests", d.max_waiting_requests, "queue bound; beyond it RESOURCE_EXHAUSTED")
    args.add("priority-aging-s", d.priority_aging_s, "waiting this long counts as one priority level")
    args.add(
        "null-tokens-per-s", d.null_tokens_per_s, "null backend: tokens per second per stream (0: unpaced)"
    )
    args.add(
        "gpu-memory-fraction", d.gpu_memory_fraction, "trtllm: share of free GPU memory for the KV cache"
    )
    args.add("triton-url", d.triton_url, "triton: the Triton server's gRPC host:port")
    args.add("triton-model", d.triton_model, "triton: name of the decoupled TensorRT-LLM model")
    args.add("triton-timeout-s", d.triton_timeout_s, "triton: longest wait for the next streamed response")
    return args.parse(argv)


def build_engine(config: EngineConfig) -> ServedEngine:
    """Loads the tokenizer and the model runner, and sizes the KV cache (logging each step)."""
    model_path = config.model_path or bundled_model_path()
    started = time.monotonic()
    log.info("loading tokenizer and chat template from %s", model_path)
    tokenizer = load_tokenizer(str(model_path))
    if config.backend in HOSTED_BACKENDS:
        return load_hosted_engine(config, model_path, tokenizer, EngineMetrics())
    log.info("loading the %s model runner", config.backend)
    runner = create_runner(
        config.backend,
        model_path,
        tokenizer,
        config.num_threads or None,
        config.null_tokens_per_s,
        config.tensor_parallel_size,
    )
    engine = LLMEngine(config, runner, tokenizer, metrics=EngineMetrics())
    log.info(
        "model %s loaded in %.1fs (backend %s, context %d tokens)",
        tokenizer.model_name,
        time.monotonic() - started,
        runner.backend,
        engine.context_length,
    )
    return engine


async def serve(engine: ServedEngine, args) -> None:
    service = EngineService(engine)

    def add_services(server: grpc.aio.Server) -> list[str]:
        engine_pb2_grpc.add_EngineServiceServicer_to_server(service, server)
        return [engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name]

    engine.start()
    telemetry.start_metrics_server(args.metrics_port, args.host)
    handle = await serving.start_grpc_server(add_services, args.port, args.host)
    log.info("engine %s ready (instance %s)", engine.config.engine_id, engine.instance_id)

    async def unhealthy_on_failure() -> None:
        await service.failed.wait()
        log.error("engine failed (%s): health is NOT_SERVING", engine.failure)
        await handle.set_serving(False)

    watchdog = asyncio.create_task(unhealthy_on_failure())
    try:
        await serving.serve_until_signalled(handle, "engine", args.drain_grace_s, on_drain=service.drain)
    finally:
        watchdog.cancel()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    telemetry.setup("engine")
    try:
        engine = build_engine(EngineConfig.from_args(args))
    except (ValueError, RuntimeError, OSError) as exc:
        log.error("cannot start the engine: %s", exc)
        sys.exit(2)
    try:
        asyncio.run(serve(engine, args))
    finally:
        engine.stop()
        engine.close()
        log.info("step loop stopped")


if __name__ == "__main__":
    main()
