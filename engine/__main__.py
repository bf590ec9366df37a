"""``python -m engine``: one inference engine replica (EngineService)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

import grpc

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.model_files import bundled_model_path
from chatmesh.tokenizer import load_tokenizer
from engine.backends.loading import load_hosted_engine
from engine.config import HOSTED_BACKENDS, EngineConfig
from engine.embeddings.loading import load_embedding_service
from engine.llm_engine import LLMEngine
from engine.metrics import EngineMetrics
from engine.model.bert import is_sentence_encoder_dir
from engine.model.loading import create_runner
from engine.service import EngineService, ServedEngine
from meshkit import event_loop, serving, telemetry
from meshkit.config import ServiceArgs

log = logging.getLogger("engine")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, EngineConfig]:
    args = ServiceArgs("engine", "Serves a model with a paged KV cache and continuous batching.")
    args.add_server_flags(port=50061)
    args.add_config(EngineConfig)
    return args.config(EngineConfig, argv)


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
        null_text=config.null_text,
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
    handle = await serving.start_from_flags(add_services, args)
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


async def serve_embeddings(config: EngineConfig, args) -> None:
    """An embedding engine (a sentence-encoder directory as --model): Embed, no generation."""
    try:
        service = load_embedding_service(config, config.model_path or Path(), EngineMetrics())
    except (ValueError, OSError) as exc:
        log.error("cannot start the embedding engine: %s", exc)
        sys.exit(2)

    def add_services(server: grpc.aio.Server) -> list[str]:
        engine_pb2_grpc.add_EngineServiceServicer_to_server(service, server)
        return [engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name]

    service.start()
    try:
        telemetry.start_metrics_server(args.metrics_port, args.host)
        handle = await serving.start_from_flags(add_services, args)
        log.info("embedding engine %s ready (instance %s)", config.engine_id, service.instance_id)
        await serving.serve_until_signalled(handle, "engine", args.drain_grace_s, on_drain=service.drain)
    finally:
        service.stop()


def main(argv: list[str] | None = None) -> None:
    args, config = parse_args(argv)
    telemetry.setup("engine")
    if config.model_path is not None and is_sentence_encoder_dir(config.model_path):
        event_loop.run(serve_embeddings(config, args))
        return
    try:
        engine = build_engine(config)
    except (ValueError, RuntimeError, OSError) as exc:
        log.error("cannot start the engine: %s", exc)
        sys.exit(2)
    try:
        event_loop.run(serve(engine, args))
    finally:
        engine.stop()
        engine.close()
        log.info("step loop stopped")


if __name__ == "__main__":
    main()
