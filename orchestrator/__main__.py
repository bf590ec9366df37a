"""``python -m orchestrator``: the ChatService (history, prompt assembly, budgets, runs, resume). ``main``
parses the flags into an ``OrchestratorConfig``; ``serve`` connects the store and the router and wires the
replica's parts with ``orchestrator.composition.build_orchestrator``.

Start-up, each step logged: tokenizer and chat template loaded, Cassandra connected (schema applied),
router reachable, first heartbeat; then it serves. SIGTERM: health NOT_SERVING, new answers refused,
running answers get ``--drain-grace-s`` to finish and are then handed over (their output so far
checkpointed, the heartbeat dated so that another replica adopts them at once); with nothing handed
over, the heartbeat is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from argparse import Namespace
from collections.abc import Sequence

import grpc

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc, completion_link_pb2, completion_link_pb2_grpc
from chatmesh.identity import TokenVerifier
from memory_store.errors import Unavailable
from memory_store.store import MemoryStore
from meshkit import event_loop, serving, telemetry
from orchestrator import config as configuration
from orchestrator.api.completion_link import CompletionLinkService
from orchestrator.api.service import ChatService
from orchestrator.composition import build_orchestrator
from orchestrator.config import OrchestratorConfig
from orchestrator.policy.admission import check_model_budgets
from orchestrator.prompting.models import CHAT, ModelSpec, default_model, model_files
from orchestrator.router_client import RouterClient

log = logging.getLogger("orchestrator")

CASSANDRA_WAIT_S = 120.0


async def connect_store(config: OrchestratorConfig) -> MemoryStore:
    """Connects to Cassandra, waiting for it while it starts (the mesh starts it first, but a node
    restarting or a slow start must not crash the orchestrator)."""
    deadline = time.monotonic() + CASSANDRA_WAIT_S
    while True:
        try:
            return await MemoryStore.connect(config.store)
        except Unavailable as exc:
            if time.monotonic() > deadline:
                raise
            log.info("Cassandra not reachable yet (%s); retrying", exc)
            await asyncio.sleep(2.0)


async def serve(
    args: Namespace,
    config: OrchestratorConfig,
    verifier: TokenVerifier,
    specs: Sequence[ModelSpec],
) -> None:
    for spec in specs:
        log.info(
            "model %s: tokenizer %s, %s, context window %d tokens, licence %s",
            spec.name,
            spec.tokenizer.fingerprint,
            spec.kind if spec.kind == CHAT else "completion only (no chat template)",
            spec.window(config.prompt),
            spec.licence or "not stated",
        )
    store_config = config.store
    log.info(
        "connecting to Cassandra at %s:%d (keyspace %s)",
        ",".join(store_config.contact_points),
        store_config.port,
        store_config.keyspace,
    )
    store = await connect_store(config)
    log.info("Cassandra connected%s", ", schema applied" if store_config.apply_schema else "")
    router = RouterClient(config.router, config.router_timeout_s)
    try:
        engines = await router.list_engines()
        log.info(
            "router reachable at %s: %d engines, %d healthy",
            config.router,
            len(engines),
            sum(e.healthy for e in engines),
        )
    except Exception as exc:
        log.warning("router at %s not reachable yet (%s); answers fail until it is", config.router, exc)

    orchestrator = build_orchestrator(config, store=store, router=router, specs=specs)
    service = ChatService(
        ctx=orchestrator.ctx, budgets=orchestrator.budgets, router=router, verifier=verifier
    )
    completion_link = CompletionLinkService(chat=service, verifier=verifier)
    if orchestrator.mcp is not None:
        # In the background: a server down at start only has no tools until it answers.
        orchestrator.mcp.start()
        log.info("MCP servers: %s", ", ".join(f"{n}={s.url}" for n, s in orchestrator.mcp.servers.items()))
    await orchestrator.membership.join()
    log.info("replica %s joined (heartbeat every %.0fs)", config.replica_id, config.runs.heartbeat_interval_s)

    def add_services(server: grpc.aio.Server) -> list[str]:
        chat_pb2_grpc.add_ChatServiceServicer_to_server(service, server)
        completion_link_pb2_grpc.add_CompletionLinkServiceServicer_to_server(completion_link, server)
        return [
            chat_pb2.DESCRIPTOR.services_by_name["ChatService"].full_name,
            completion_link_pb2.DESCRIPTOR.services_by_name["CompletionLinkService"].full_name,
        ]

    shutdown: list[asyncio.Task[int]] = []

    async def on_drain() -> None:
        # Runs get most of the grace period; what is left lets their last events reach clients.
        shutdown.append(
            asyncio.create_task(orchestrator.ctx.runs.drain.shutdown(max(0.0, args.drain_grace_s - 1.0)))
        )
        completion_link.drain()

    try:
        await serving.serve("orchestrator", args, add_services, on_drain=on_drain)
    finally:
        await asyncio.gather(*shutdown, return_exceptions=True)
        await orchestrator.stop()
        await router.close()
        await store.close()


def main(argv: list[str] | None = None) -> None:
    args, config = configuration.parse(argv)
    try:
        verifier = TokenVerifier.from_config(config.identity)
    except ValueError as exc:
        sys.exit(f"python -m orchestrator: {exc}")
    telemetry.setup("orchestrator")
    files = model_files(config.model_files)
    try:
        specs = [ModelSpec.load(file) for file in files]
        default_model(specs, config.default_model)
        check_model_budgets(config.budgets, [spec.name for spec in specs])
    except (ValueError, OSError) as exc:  # a tokenizer it does not implement, or no such file
        log.error("cannot start the orchestrator: %s", exc)
        sys.exit(2)
    if all(spec.kind != CHAT for spec in specs):
        # Chats, titles and summaries need a chat template: completion models are served beside one.
        log.error(
            "cannot start the orchestrator: %s has no chat template (a base model, completion only) and "
            "no other served model has one; serve a chat model beside it",
            ", ".join(str(file.path) for file in files),
        )
        sys.exit(2)
    try:
        event_loop.run(serve(args, config, verifier, specs))
    except serving.PortInUseError as exc:
        log.error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
