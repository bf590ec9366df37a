"""Orchestrator overhead: time to first token and per-token latency through the orchestrator and router,
side by side with the same streams straight to the engine (and straight to the router).

Starts a Cassandra node, null engines paced at ``--tokens-per-s`` per stream (no model compute, so
every millisecond measured is the mesh's own), a router and an orchestrator, all as processes
(``python -m ...``), then drives the same streams, C at a time, along each path:

  engine    straight to an engine (round robin over the engines), on a link to each
            (meshkit.links: one GenerateMany stream per engine, as the router reaches them)
  router    straight to the router, on one link (as the orchestrator reaches it)
  complete  ChatService.Complete: limits, budget reservation and reconciliation in Cassandra, moderation,
            prompt assembly, router (nothing else stored)
  send      ChatService.SendMessage, each in a chat of its own: idempotency claim, history read, user
            message, run, checkpoints and the stored answer in Cassandra

Reported per path and concurrency: TTFT p50/p99 (request sent to first text), TPOT p50/p99 ((last text -
first text) / (tokens - 1)), the largest gap between two pieces of text (p99 over streams), and the
TTFT/TPOT p50 ratios to engine-direct. Prompts are the same token ids on every path (the chat template
of a system prompt and one user message), as is the answer length.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_orchestrator.py \
        [--concurrency 1 100] [--requests 30] [--tokens 32] [--tokens-per-s 50] [--engines 2] [--timeline] \
        [--warm-sends 6000]

``--timeline`` has every service write its spans to a file and prints where a send's time goes: the
median start and end of each span of the SendMessage traces, in ms after the call arrived (one line
per span name and occurrence: what runs alongside what, and what waits for what). Writing every span
synchronously slows each process a little, so read it for the shape, and the table for the times.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_memory_store import warm_node  # noqa: E402
from bench.link_client import engine_link, frames, router_link  # noqa: E402
from bench.machine import machine  # noqa: E402
from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc  # noqa: E402
from chatmesh.engine.v1 import engine_pb2  # noqa: E402
from chatmesh.router.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from chatmesh.tokenizer import ChatMessage, load_tokenizer  # noqa: E402
from localmesh.cassandra.node import CassandraNode, NodeConfig  # noqa: E402
from localmesh.dev_jwt import DevKeys, generate_keys  # noqa: E402
from memory_store.config import StoreConfig  # noqa: E402
from memory_store.store import MemoryStore  # noqa: E402
from meshkit.launcher import GrpcHealthy, Launcher, ServiceSpec, free_port  # noqa: E402
from meshkit.telemetry import TRACE_FILE_ENV, SpanRecord  # noqa: E402
from orchestrator.config import DEFAULT_SYSTEM_PROMPT  # noqa: E402

QUESTION = "Summarize the plot of a novel about a lighthouse keeper in three sentences."
PATHS = ("engine", "router", "complete", "send")
_ids = itertools.count()


@dataclass
class Stream:
    ttft: float
    tpot: float
    max_gap: float


async def timed(texts: AsyncIterator[int], began: float) -> Stream:
    """Times a stream of text pieces (each yields its token count)."""
    first = last = None
    tokens = 0
    max_gap = 0.0
    async for count in texts:
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            max_gap = max(max_gap, now - last)
        last = now
        tokens += count
    assert first is not None and last is not None and tokens > 1, "the stream carried no text"
    return Stream(first - began, (last - first) / (tokens - 1), max_gap)


def sampling(tokens: int) -> engine_pb2.SamplingParams:
    return engine_pb2.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


class Paths:
    """One client per path; ``stream(path)`` runs one request and times it."""

    def __init__(
        self,
        engines: list[str],
        router: str,
        orchestrator: str,
        prompt: list[int],
        tokens: int,
        keys: DevKeys,
    ) -> None:
        self.prompt, self.tokens, self.keys = prompt, tokens, keys
        self._tokens: dict[int, str] = {}
        self.channels = [grpc.aio.insecure_channel(a) for a in (*engines, router, orchestrator)]
        self.engines = [engine_link(c) for c in self.channels[: len(engines)]]
        self.router = router_link(self.channels[-2])
        self.chat = chat_pb2_grpc.ChatServiceStub(self.channels[-1])
        self.fingerprint = load_tokenizer().fingerprint

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    def identity(self, i: int) -> tuple[tuple[str, str], ...]:
        # One user per stream: per-user concurrent-run limits must not shape the benchmark. Tokens are
        # signed once per user, as a client holds its token; the orchestrator verifies one per call.
        if i not in self._tokens:
            self._tokens[i] = self.keys.mint(f"bench-user-{i}", "enterprise")
        return (("authorization", f"Bearer {self._tokens[i]}"),)

    async def stream(self, path: str, i: int, chat_id: str = "") -> Stream:
        began = time.perf_counter()
        return await timed(getattr(self, f"_{path}")(i, chat_id), began)

    async def _engine(self, i: int, chat_id: str) -> AsyncIterator[int]:
        start = engine_pb2.GenerateStart(
            request_id=f"bench-{next(_ids)}", prompt_token_ids=self.prompt, sampling=sampling(self.tokens)
        )
        async for frame in frames(self.engines[i % len(self.engines)], start):
            if frame.WhichOneof("kind") == "tokens" and frame.tokens.text:
                yield len(frame.tokens.token_ids)

    async def _router(self, i: int, chat_id: str) -> AsyncIterator[int]:
        start = router_pb2.GenerateStart(
            request_id=f"bench-{next(_ids)}",
            prompt_token_ids=self.prompt,
            sampling=sampling(self.tokens),
            tier=router_pb2.TIER_ENTERPRISE,
            tokenizer_fingerprint=self.fingerprint,
        )
        async for frame in frames(self.router, start, timeout_ms=600_000):
            if frame.WhichOneof("kind") == "tokens" and frame.tokens.text:
                yield len(frame.tokens.token_ids)

    async def _complete(self, i: int, chat_id: str) -> AsyncIterator[int]:
        request = chat_pb2.CompleteRequest(
            messages=[chat_pb2.PromptMessage(role=chat_pb2.ROLE_USER, content=QUESTION)],
            options=chat_pb2.GenerationOptions(max_tokens=self.tokens, temperature=0.0),
        )
        async for response in self.chat.Complete(request, metadata=self.identity(i), timeout=600):
            if response.event.WhichOneof("kind") == "delta":
                yield response.event.delta.token_count

    async def _send(self, i: int, chat_id: str) -> AsyncIterator[int]:
        request = chat_pb2.SendMessageRequest(
            chat_id=chat_id,
            content=QUESTION,
            options=chat_pb2.GenerationOptions(max_tokens=self.tokens, temperature=0.0),
        )
        async for response in self.chat.SendMessage(request, metadata=self.identity(i), timeout=600):
            if response.event.WhichOneof("kind") == "delta":
                yield response.event.delta.token_count

    async def new_chats(self, count: int) -> list[str]:
        replies = await asyncio.gather(
            *(
                self.chat.CreateChat(chat_pb2.CreateChatRequest(), metadata=self.identity(i), timeout=30)
                for i in range(count)
            )
        )
        return [reply.chat.chat_id for reply in replies]


async def measure(paths: Paths, path: str, concurrency: int, requests: int) -> list[Stream]:
    """``requests`` streams, ``concurrency`` at a time (in waves)."""
    results: list[Stream] = []
    while len(results) < requests:
        wave = min(concurrency, requests - len(results))
        for i in range(wave):  # signed before the clock starts: a client holds its token
            paths.identity(i)
        chats = await paths.new_chats(wave) if path == "send" else [""] * wave
        results += await asyncio.gather(*(paths.stream(path, i, chats[i]) for i in range(wave)))
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def service(module: str, name: str, port: int, *flags: str) -> ServiceSpec:
    """``python -m module`` serving gRPC on ``port``, and its metrics (its event loop's lag) on a port of
    its own (bench/loop_lag.py finds it)."""
    argv = [sys.executable, "-m", module, "--port", str(port), "--metrics-port", str(free_port()), *flags]
    return ServiceSpec(name=name, argv=argv, ports=(port,), ready=GrpcHealthy(port), cwd=ROOT)


def null_engine(
    i: int, port: int, tokens_per_s: float, max_running: int = 512, max_batched_tokens: int = 4096
) -> ServiceSpec:
    """Null engine ``engine-<i>`` paced at ``tokens_per_s`` per stream, decoding ``max_running`` streams
    at once with 2,048 more waiting, and taking ``max_batched_tokens`` (at least one per running stream)
    into a step."""
    batched = max(max_batched_tokens, max_running)
    return service(
        "engine",
        f"engine-{i}",
        port,
        *("--engine-id", f"engine-{i}", "--backend", "null", "--null-tokens-per-s", str(tokens_per_s)),
        *("--max-running-requests", str(max_running), "--max-batched-tokens", str(batched)),
        *("--max-waiting-requests", "2048"),
    )


async def warm_cassandra(cql_port: int, sends: int) -> None:
    """``warm_node`` on the mesh's node (in a keyspace of its own), so the mesh's cost per send is not
    measured on a JVM still compiling."""
    started = time.perf_counter()
    store = await MemoryStore.connect(StoreConfig(port=cql_port, keyspace="chatmesh_warm"))
    try:
        await warm_node(store, sends)
    finally:
        await store.close()
    print(
        f"  cassandra warmed: {sends:,} sends' statements through memory_store (keyspace chatmesh_warm) "
        f"in {time.perf_counter() - started:.0f}s",
        flush=True,
    )


def start_mesh(
    launcher: Launcher,
    args: argparse.Namespace,
    run_dir: Path,
    keys: DevKeys,
    warm_sends: int = 0,
    orchestrators: int = 1,
    orchestrator_flags: Sequence[str] = (),
    cql_port: int | None = None,
) -> tuple[list[str], str, list[str]]:
    """Cassandra (on ``cql_port``, a free port if None), ``args.engines`` null engines, a router and
    ``orchestrators`` orchestrator replicas (``orchestrator``, or ``orchestrator-<i>`` for several, each
    with ``orchestrator_flags`` besides the bench's own); their addresses. The keyspace is
    ``chatmesh_bench``."""
    cql_port = cql_port or free_port()
    CassandraNode(
        NodeConfig(
            data_dir=run_dir / "cassandra", cql_port=cql_port, storage_port=free_port(), jmx_port=free_port()
        ),
        launcher,
    ).start()
    if warm_sends:
        asyncio.run(warm_cassandra(cql_port, warm_sends))
    engines = []
    for i in range(args.engines):
        port = free_port()
        launcher.start(null_engine(i, port, args.tokens_per_s))
        engines.append(f"127.0.0.1:{port}")
    router_port = free_port()
    engine_flags = [flag for i, a in enumerate(engines) for flag in ("--engine", f"engine-{i}={a}")]
    launcher.start(service("router", "router", router_port, *engine_flags))
    addresses = []
    for i in range(orchestrators):
        port = free_port()
        launcher.start(
            service(
                "orchestrator",
                "orchestrator" if orchestrators == 1 else f"orchestrator-{i}",
                port,
                *("--router", f"127.0.0.1:{router_port}", "--cassandra", f"127.0.0.1:{cql_port}"),
                *(
                    "--cassandra-keyspace",
                    "chatmesh_bench",
                    "--concurrent-runs-enterprise",
                    "10000",
                    "--titles",
                    "false",
                ),
                *orchestrator_flags,
                *keys.service_flags(),
            )
        )
        addresses.append(f"127.0.0.1:{port}")
    return engines, f"127.0.0.1:{router_port}", addresses


async def wait_for_engines(router: str, count: int) -> None:
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for _ in range(300):
            engines = (await stub.ListEngines(router_pb2.ListEnginesRequest(), timeout=5)).engines
            if sum(e.healthy for e in engines) >= count:
                return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"the router never saw {count} healthy engines")


def print_timeline(span_file: Path, method: str = "SendMessage") -> None:
    """The median timeline of the ``method`` traces in ``span_file`` (``--timeline``)."""
    traces: dict[str, list[SpanRecord]] = collections.defaultdict(list)
    for line in span_file.read_text().splitlines():
        record = SpanRecord(**json.loads(line))
        if record.start_ns is not None and record.end_ns is not None:
            traces[record.trace_id].append(record)
    spans: dict[tuple[str, str, int], list[tuple[float, float]]] = collections.defaultdict(list)
    calls = 0
    for records in traces.values():
        root = next((r for r in records if r.kind == "SERVER" and r.name.endswith(f"/{method}")), None)
        if root is None or root.start_ns is None:
            continue
        calls += 1
        seen: collections.Counter[tuple[str, str]] = collections.Counter()
        for record in sorted(records, key=lambda r: r.start_ns or 0):
            span_name = (record.service or "?", record.name)
            key = (*span_name, seen[span_name])
            seen[span_name] += 1
            spans[key].append(((record.start_ns or 0) - root.start_ns, (record.end_ns or 0) - root.start_ns))
    print(f"\n{method}: median span timeline over {calls} calls (ms after the call arrived)")
    print(f"{'start':>8} {'end':>8}  span")
    common = {key: times for key, times in spans.items() if len(times) >= calls / 2}
    for (service_name, name, occurrence), times in sorted(
        common.items(), key=lambda item: statistics.median(t[0] for t in item[1])
    ):
        start, end = (
            statistics.median(t[0] for t in times) / 1e6,
            statistics.median(t[1] for t in times) / 1e6,
        )
        repeat = f" #{occurrence + 1}" if occurrence else ""
        print(f"{start:>8.2f} {end:>8.2f}  {service_name}: {name}{repeat}")


def ms(value: float) -> str:
    return f"{value * 1000:,.1f}"


async def bench(args: argparse.Namespace, addresses: tuple[list[str], str, list[str]], keys: DevKeys) -> None:
    engines, router, (orchestrator,) = addresses
    await wait_for_engines(router, len(engines))
    tokenizer = load_tokenizer()
    prompt = tokenizer.encode_chat(
        [ChatMessage("system", DEFAULT_SYSTEM_PROMPT), ChatMessage("user", QUESTION)]
    )
    paths = Paths(engines, router, orchestrator, prompt, args.tokens, keys)
    try:
        print(
            f"workload: prompt {len(prompt)} tokens, {args.tokens} output tokens per stream, null engines x"
            f"{len(engines)} paced at {args.tokens_per_s:g} tokens/s per stream, {args.requests} streams per row"
        )
        for path in PATHS:  # warm-up: connections, prepared statements, first-call costs
            await measure(paths, path, 4, 4)
        header = (
            f"{'path':<9} {'streams':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
            f"{'max gap p99':>11} {'TTFT x':>7} {'TPOT x':>7}"
        )
        print(f"\n{header}  (milliseconds; x = ratio to engine-direct p50)\n{'-' * len(header)}")
        for concurrency in args.concurrency:
            base: tuple[float, float] | None = None
            for path in PATHS:
                results = await measure(paths, path, concurrency, max(args.requests, concurrency))
                ttft = [r.ttft for r in results]
                tpot = [r.tpot for r in results]
                p50 = (statistics.median(ttft), statistics.median(tpot))
                base = base or p50
                print(
                    f"{path:<9} {concurrency:>7} {ms(p50[0]):>9} {ms(percentile(ttft, 0.99)):>9} "
                    f"{ms(p50[1]):>9} {ms(percentile(tpot, 0.99)):>9} "
                    f"{ms(percentile([r.max_gap for r in results], 0.99)):>11} "
                    f"{p50[0] / base[0]:>7.2f} {p50[1] / base[1]:>7.2f}"
                )
    finally:
        await paths.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 100])
    parser.add_argument("--requests", type=int, default=30, help="streams per row (at least the concurrency)")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per stream")
    parser.add_argument("--tokens-per-s", type=float, default=50.0, help="null engines' pace per stream")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument(
        "--warm-sends", type=int, default=6000, help="sends' statements run on Cassandra before measuring"
    )
    parser.add_argument("--timeline", action="store_true", help="print the median span timeline of a send")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with (
        tempfile.TemporaryDirectory(prefix="bench-orchestrator-") as tmp,
        Launcher(Path(tmp), echo=print) as launcher,
    ):
        print("starting Cassandra, engines, router and orchestrator ...", flush=True)
        span_file = Path(tmp) / "spans.jsonl"
        if args.timeline:
            os.environ[TRACE_FILE_ENV] = str(span_file)  # the services inherit it
        keys = generate_keys(Path(tmp) / "keys")
        addresses = start_mesh(launcher, args, Path(tmp), keys, args.warm_sends)
        asyncio.run(bench(args, addresses, keys))
        if args.timeline:
            launcher.stop_all()  # the last spans are written as the services stop
            print_timeline(span_file)


if __name__ == "__main__":
    main()
