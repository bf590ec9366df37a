"""Front-door overhead: time to first token and per-token latency end to end through Envoy, side by side
with the same streams straight to an engine; then how many streams the front door holds open at once.

Starts the whole mesh as processes on 127.0.0.1 (a Cassandra node, null engines paced at
``--tokens-per-s`` per stream, a router, an orchestrator, the edge and Envoy with the ``make run``
config) and drives the same answers, C at a time, along three paths:

  engine  straight to an engine (round robin), on a link to each as the router reaches it: the floor
  openai  POST /v1/chat/completions (stream) through Envoy (JWT, rate limit) -> edge -> orchestrator
          Complete, on the edge's completion links (limits, budget in Cassandra, prompt) -> router ->
          engine
  chat    POST /v1/chats/{id}/messages (SSE, the chat page's path) through the same hops, with the
          exchange stored in Cassandra (idempotency claim, history, run, checkpoints, the answer)

The null engine computes nothing, so every millisecond above the engine row is the mesh's own
("mesh overhead, null engine"). Reported per path and concurrency: TTFT p50/p99 (request sent to first
text), TPOT p50/p99 ((last text - first text) / (tokens - 1)), and the ratios to engine-direct.

Then the relay cost: for each of ``--cost-path`` (OpenAI streams, the chat page's stored sends, each in
a chat of its own, whose runs are cancelled after the window, or both in turn) and each of
``--cost-streams`` (10, 50, 100, 200), that many long streams along it are opened at once; once every
one has its first token, each process's CPU time (/proc) is read over ``--cost-window-s`` and divided by the tokens the client
received meanwhile: microseconds of CPU per relayed token, by hop (the engines, router, orchestrator,
edge, and Envoy for both its passes), and the door's tokens per second per core (Envoy, edge,
orchestrator and router together). Plotted to ``--cost-plot``, a panel a path.

Then the cost per request: ``--cost-requests`` short answers (``--cost-request-tokens`` tokens) along
each of the openai and chat paths, ``--cost-concurrency`` at a time, each from a user of its own; each
process's CPU time over the whole batch, per request: milliseconds of CPU a request costs in each
process, Cassandra included (what a send costs the mesh, beside what each token costs it). Cassandra's
JIT compiler threads are read apart (``its JIT``; ``bench/process_usage.py``): a node started minutes
ago still compiles, one that has served for days does not.

Then the hold ramp: the engines restart paced at ``--hold-tokens-per-s`` (slow streams cost little CPU,
so what is measured is holding streams, not relaying tokens) with room to decode every stream of the
largest level at once, and N streams of ``--hold-tokens`` tokens are opened through Envoy, all at once
or ``--hold-open-rate`` a second, for N = ``--hold-start``, doubling, up to ``--hold-cap``: OpenAI SSE
streams (``--hold-via sse``, browsers' door: Envoy -> edge -> orchestrator),
ChatService.Complete calls over one gRPC connection (``--hold-via grpc``, internal services' door:
Envoy -> orchestrator), or the chat page's stored sends (``--hold-via chat``, each in a chat of its own
made before the level: what a stored run costs while it is open, checkpoints and the owner's watch for
a remote end included; the orchestrators' Cassandra requests a second, by statement, are printed). A level is held when every stream got its first token while all N were open,
and every one then finished with all its tokens and no error. The ramp stops at the first level that is
not held. Each level reports the memory each process added per open stream (its peak resident size
during the level less its size before it) and the cores each kept busy over the level. The streams'
client is a lean one (bench/sse_client.py), on both paths: httpx's pool costs O(open streams) per new
request, and its line reader cost a stored chat's stream ~2.5x the OpenAI stream's client CPU a token.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_front_door.py \
        [--concurrency 1 50 500] [--requests 20] [--tokens 32] [--tokens-per-s 50] \
        [--cost-streams 10 50 100 200] [--cost-window-s 10] [--cost-path openai chat] \
        [--cost-requests 200] [--cost-concurrency 10] \
        [--cost-request-tokens 8] [--hold-start 250] [--hold-cap 2000] [--hold-tokens 60] \
        [--hold-via sse|grpc|chat] [--hold-open-rate 0] \
        [--plot docs/front_door_latency.png] [--cost-plot docs/front_door_cost.png] [--warm-sends 6000]

The plots need matplotlib (the ``bench`` extra: ``.venv/bin/pip install matplotlib==3.11.2``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import loop_lag  # noqa: E402
from bench.bench_orchestrator import (  # noqa: E402
    QUESTION,
    Paths,
    Stream,
    ms,
    null_engine,
    percentile,
    start_mesh,
    timed,
    wait_for_engines,
)
from bench.machine import machine  # noqa: E402
from bench.plotting import pyplot  # noqa: E402
from bench.process_usage import Usage  # noqa: E402
from bench.sse_client import SseFailedError, post_events  # noqa: E402
from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc  # noqa: E402
from chatmesh.tokenizer import ChatMessage, load_tokenizer  # noqa: E402
from engine.model.loading import NULL_TEXT  # noqa: E402
from localmesh.dev_jwt import DevKeys, generate_keys  # noqa: E402
from localmesh.front_door import FrontDoorPorts, front_door_specs  # noqa: E402
from meshkit.launcher import Launcher, free_port  # noqa: E402
from orchestrator.config import DEFAULT_SYSTEM_PROMPT  # noqa: E402

PATHS = ("engine", "openai", "chat")
# Tries of each run's cancel after a relay-cost level (a second apart).
CANCEL_TRIES = 10
# Prompt tokens per stream the hold ramp's engines make room for (QUESTION's prompt is ~50).
# How often the relay-cost window asks each orchestrator's health, as a readiness probe does (its
# answer time: how long a probe of a replica that busy waits, against the probe's timeout).
HEALTH_PROBE_INTERVAL_S = 0.5
PROMPT_ROOM = 128


class StreamFailedError(RuntimeError):
    """A stream through the door ended with an error (HTTP status, error event, or a short answer)."""


class NullText:
    """How many tokens a null engine's answer holds, from the length of its text so far. The null engine
    answers the token at position p with the (p mod L)-th of the L tokens of ``NULL_TEXT``, so an
    answer to a prompt of n tokens is that cycle's text from token n mod L on, and each token's piece of
    text has a known length."""

    def __init__(self, tok, prompt_tokens: int) -> None:
        cycle = tok.encode(NULL_TEXT)
        start = prompt_tokens % len(cycle)
        self._ends = list(accumulate(len(tok.decode([token])) for token in cycle[start:] + cycle[:start]))

    def tokens_in(self, chars: int) -> int:
        cycles, rest = divmod(chars, self._ends[-1])
        return cycles * len(self._ends) + bisect_right(self._ends, rest)


class Door:
    """HTTP clients of the front door: one enterprise user per stream index (per-user limits must not
    shape the benchmark), each with a JWT of its own."""

    def __init__(self, url: str, keys: DevKeys, tokens: int) -> None:
        self.tokens = tokens
        self.keys = keys
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.http = httpx.AsyncClient(
            base_url=url,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            timeout=httpx.Timeout(600.0, connect=120.0, pool=None),
        )
        self._auth: dict[int, dict[str, str]] = {}
        self._runs: dict[int, str] = {}  # the run of each stream index's latest chat send
        self._text: NullText | None = None
        self._calibrating = asyncio.Lock()
        # gRPC through the same public port, as internal services call chatmesh (one HTTP/2 connection).
        self.grpc = grpc.aio.insecure_channel(f"{self.host}:{self.port}")
        self.chat = chat_pb2_grpc.ChatServiceStub(self.grpc)

    async def close(self) -> None:
        await self.http.aclose()
        await self.grpc.close()

    def auth(self, i: int) -> dict[str, str]:
        if i not in self._auth:
            self._auth[i] = {"Authorization": f"Bearer {self.keys.mint(f'bench-user-{i}', 'enterprise')}"}
        return self._auth[i]

    async def stream(self, path: str, i: int, chat_id: str = "") -> Stream:
        began = time.perf_counter()
        return await timed(getattr(self, f"_{path}")(i, chat_id), began)

    async def openai_chunks(self, i: int, tokens: int) -> AsyncIterator[int]:
        """For each content chunk of a streamed completion, the tokens it carries (a chunk carries
        several when the door merged them for a reader that fell behind; counted from the null
        engine's text, ``NullText``), then any the usage chunk counts beyond those."""
        counted = completion_tokens = 0
        text = await self._null_text()
        chars = 0
        try:
            async for chunk in self._completion(i, tokens):
                if chunk["choices"] and (content := chunk["choices"][0]["delta"].get("content")):
                    chars += len(content)
                    now = text.tokens_in(chars)
                    yield now - counted
                    counted = now
                elif chunk.get("usage"):
                    completion_tokens = chunk["usage"]["completion_tokens"]
                    if completion_tokens > counted:
                        yield completion_tokens - counted
        except SseFailedError as exc:
            raise StreamFailedError(str(exc)) from None
        if completion_tokens != tokens:
            raise StreamFailedError(f"the answer ended after {completion_tokens} of {tokens} tokens")

    async def grpc_chunks(self, i: int, tokens: int) -> AsyncIterator[int]:
        """``openai_chunks`` for ChatService.Complete over gRPC through Envoy: each delta's token count."""
        request = chat_pb2.CompleteRequest(
            messages=[
                chat_pb2.PromptMessage(role=chat_pb2.ROLE_SYSTEM, content=DEFAULT_SYSTEM_PROMPT),
                chat_pb2.PromptMessage(role=chat_pb2.ROLE_USER, content=QUESTION),
            ],
            options=chat_pb2.GenerationOptions(max_tokens=tokens, temperature=0.0),
        )
        metadata = (("authorization", self.auth(i)["Authorization"]),)
        counted = 0
        try:
            async for response in self.chat.Complete(request, metadata=metadata, timeout=3600):
                event = response.event
                if event.WhichOneof("kind") == "delta":
                    counted += event.delta.token_count
                    yield event.delta.token_count
                elif event.WhichOneof("kind") == "error":
                    raise StreamFailedError(f"{event.error.code}: {event.error.message}")
        except grpc.aio.AioRpcError as exc:
            raise StreamFailedError(f"{exc.code().name}: {exc.details()}") from None
        if counted != tokens:
            raise StreamFailedError(f"the answer ended after {counted} of {tokens} tokens")

    async def _completion(self, i: int, tokens: int) -> AsyncIterator[dict]:
        """The chunks of a streamed completion of QUESTION (an error chunk raises)."""
        body = {
            "messages": [
                {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                {"role": "user", "content": QUESTION},
            ],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async for _, data in post_events(self.host, self.port, "/v1/chat/completions", body, self.auth(i)):
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise StreamFailedError(chunk["error"]["message"])
            yield chunk

    async def _null_text(self) -> NullText:
        """The null engines' text for QUESTION's prompt, from one short completion's prompt length."""
        async with self._calibrating:  # once, whoever asks first
            if self._text is None:
                prompt_tokens = 0
                async for chunk in self._completion(0, 1):
                    prompt_tokens = (chunk.get("usage") or {}).get("prompt_tokens", prompt_tokens)
                self._text = NullText(load_tokenizer(), prompt_tokens)
        return self._text

    async def _openai(self, i: int, chat_id: str) -> AsyncIterator[int]:
        async for count in self.openai_chunks(i, self.tokens):
            yield count

    async def _chat(self, i: int, chat_id: str) -> AsyncIterator[int]:
        async for count in self.chat_chunks(i, chat_id, self.tokens):
            yield count

    async def chat_chunks(self, i: int, chat_id: str, tokens: int) -> AsyncIterator[int]:
        """For each `delta` event of a send's answer in ``chat_id`` (the chat page's stream), its token
        count. Its run outlives a dropped stream: ``cancel_runs`` stops it."""
        body = {"content": QUESTION, "options": {"max_tokens": tokens, "temperature": 0}}
        try:
            async for event, data in post_events(
                self.host, self.port, f"/v1/chats/{chat_id}/messages", body, self.auth(i)
            ):
                if event == "started":
                    self._runs[i] = json.loads(data)["run_id"]
                elif event == "delta":
                    yield json.loads(data)["token_count"]
                elif event == "error":
                    raise StreamFailedError(data)
        except SseFailedError as exc:
            raise StreamFailedError(str(exc)) from None

    async def cancel_runs(self) -> tuple[Counter[str], list[float]]:
        """Cancels the runs of the chat sends made so far (a run that ended meanwhile stays as it is), all
        at once. Returns how the cancels were answered: the run's status (``cancelling``: stopped, its end
        not yet stored when the answer was due), and each refusal (5xx), which is tried again a second
        later, as cancelling twice is harmless; and the seconds until each run's cancel was answered
        with its status (its tries included)."""
        runs, self._runs = self._runs, {}
        answers: Counter[str] = Counter()
        answered_s: list[float] = []
        asked = time.perf_counter()

        async def cancel(i: int, run: str) -> None:
            for attempt in range(1, CANCEL_TRIES + 1):
                reply = await self.http.post(f"/v1/runs/{run}/cancel", headers=self.auth(i))
                if reply.status_code < 500 or attempt == CANCEL_TRIES:
                    reply.raise_for_status()
                    answers[reply.json()["status"]] += 1
                    answered_s.append(time.perf_counter() - asked)
                    return
                answers[f"HTTP {reply.status_code} (tried again)"] += 1
                await asyncio.sleep(1.0)

        await asyncio.gather(*(cancel(i, run) for i, run in runs.items()))
        return answers, answered_s

    async def new_chats(self, count: int) -> list[str]:
        # httpx's pool costs O(requests in flight) per request: thousands at once take the client minutes.
        at_once = asyncio.Semaphore(64)

        async def create(i: int) -> str:
            async with at_once:
                reply = await self.http.post("/v1/chats", json={}, headers=self.auth(i))
            reply.raise_for_status()
            return reply.json()["chat_id"]

        return list(await asyncio.gather(*(create(i) for i in range(count))))


async def measure(engine: Paths, door: Door, path: str, concurrency: int, requests: int) -> list[Stream]:
    """``requests`` streams along ``path``, ``concurrency`` at a time (in waves)."""
    results: list[Stream] = []
    for i in range(concurrency):
        door.auth(i)  # sign the JWTs before the clock starts: that is the client's work, not the door's
    while len(results) < requests:
        wave = min(concurrency, requests - len(results))
        if path == "engine":
            results += await asyncio.gather(*(engine.stream("engine", i) for i in range(wave)))
            continue
        chats = await door.new_chats(wave) if path == "chat" else [""] * wave
        results += await asyncio.gather(*(door.stream(path, i, chats[i]) for i in range(wave)))
    return results


@dataclass
class Row:
    path: str
    concurrency: int
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float


async def latency(
    args: argparse.Namespace, engines: list[str], router: str, orchestrator: str, url: str, keys: DevKeys
) -> list[Row]:
    prompt = load_tokenizer().encode_chat(
        [ChatMessage("system", DEFAULT_SYSTEM_PROMPT), ChatMessage("user", QUESTION)]
    )
    engine = Paths(engines, router, orchestrator, prompt, args.tokens, keys)
    door = Door(url, keys, args.tokens)
    rows: list[Row] = []
    try:
        print(
            f"workload: prompt {len(prompt)} tokens, {args.tokens} output tokens per stream, null engines x"
            f"{len(engines)} paced at {args.tokens_per_s:g} tokens/s per stream (mesh overhead, null engine), "
            f"{args.requests} streams per row (at least the concurrency)"
        )
        for path in PATHS:  # warm-up: connections, prepared statements, first-call costs
            await measure(engine, door, path, 4, 4)
        header = (
            f"{'path':<7} {'streams':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
            f"{'TTFT x':>7} {'TPOT x':>7}"
        )
        print(f"\n{header}  (milliseconds; x = ratio to engine-direct p50)\n{'-' * len(header)}", flush=True)
        for concurrency in args.concurrency:
            base: Row | None = None
            for path in PATHS:
                results = await measure(engine, door, path, concurrency, max(args.requests, concurrency))
                ttft, tpot = [r.ttft for r in results], [r.tpot for r in results]
                row = Row(
                    path,
                    concurrency,
                    statistics.median(ttft),
                    percentile(ttft, 0.99),
                    statistics.median(tpot),
                    percentile(tpot, 0.99),
                )
                base = base or row
                rows.append(row)
                print(
                    f"{path:<7} {concurrency:>7} {ms(row.ttft_p50):>9} {ms(row.ttft_p99):>9} "
                    f"{ms(row.tpot_p50):>9} {ms(row.tpot_p99):>9} "
                    f"{row.ttft_p50 / base.ttft_p50:>7.2f} {row.tpot_p50 / base.tpot_p50:>7.2f}",
                    flush=True,
                )
    finally:
        await engine.close()
        await door.close()
    return rows


@dataclass
class Held:
    streams: int
    failed: int
    errors: list[str]
    peak_open: int
    open_s: float
    first_p50: float
    first_p99: float
    # Resident memory added per stream held, by hop (bytes): the level's peak less the idle door's.
    bytes_per_stream: dict[str, float]
    # Cores each hop kept busy on average over the level (CPU seconds / the level's seconds).
    cores: dict[str, float]
    # Each hop's event loop lag over the level (its most lagging replica), and every LAG_EVERY_S.
    lag: dict[str, loop_lag.LagHistogram]
    timeline: list[LagPoint]

    @property
    def held(self) -> bool:
        return not self.errors and self.peak_open == self.streams


# How often the hold ramp reads the services' event loop lag during a level.
LAG_EVERY_S = 10.0


@dataclass(frozen=True)
class LagPoint:
    """The streams at one moment of a level, and each hop's loop lag since the point before."""

    at_s: float
    opened: int  # calls made so far
    waiting: int  # made, no first chunk yet
    open: int  # first chunk, not ended
    lag: dict[str, loop_lag.LagHistogram]


def most_lagging_by_hop(histograms: Mapping[str, loop_lag.LagHistogram]) -> dict[str, loop_lag.LagHistogram]:
    """Per hop, the replica whose loop lagged most (``<tier>-<i>`` are one hop's replicas)."""
    hops: dict[str, loop_lag.LagHistogram] = {}
    for name, histogram in histograms.items():
        tier, _, index = name.rpartition("-")
        hop = tier if tier and index.isdigit() else name
        if hop not in hops or histogram.mean_s > hops[hop].mean_s:
            hops[hop] = histogram
    return hops


def lag_since(
    now: Mapping[str, loop_lag.LagHistogram], before: Mapping[str, loop_lag.LagHistogram]
) -> dict[str, loop_lag.LagHistogram]:
    return most_lagging_by_hop({name: h.since(before[name]) for name, h in now.items() if name in before})


async def hold_level(
    door: Door,
    streams: int,
    tokens: int,
    pids: dict[str, int],
    via: str = "sse",
    open_rate: float = 0.0,
    lag_ports: Mapping[str, int] | None = None,
    chats: Sequence[str] = (),
) -> Held:
    """Opens ``streams`` answers along ``via`` (``sse``: the OpenAI route; ``grpc``: ChatService.Complete;
    ``chat``: a send in each of ``chats``), all at once or ``open_rate`` a second; each is timed from its first chunk to its end. The processes'
    resident memory is read every half second; its peak less the idle reading is the cost of the open
    streams. First chunks are timed from each stream's own opening. The services on ``lag_ports`` have
    their event loop lag read every LAG_EVERY_S."""
    idle = peak_usage = Usage.of(pids)
    lag_ports = lag_ports or {}
    lag_at_start = await loop_lag.scrape(lag_ports)
    began = time.perf_counter()
    spans: list[tuple[float, float]] = []
    waits: list[float] = []
    opened = answered = ended = 0
    timeline: list[LagPoint] = []
    chunks = {
        "sse": door.openai_chunks,
        "grpc": door.grpc_chunks,
        "chat": lambda i, tokens: door.chat_chunks(i, chats[i], tokens),
    }[via]

    async def watch_memory() -> None:
        nonlocal peak_usage
        while True:
            await asyncio.sleep(0.5)
            peak_usage = peak_usage.peak(Usage.of(pids))

    async def watch_lag() -> None:
        before = lag_at_start
        while True:
            await asyncio.sleep(LAG_EVERY_S)
            now = await loop_lag.scrape(lag_ports)
            point = LagPoint(
                time.perf_counter() - began,
                opened,
                opened - answered,
                answered - ended,
                lag_since(now, before),
            )
            timeline.append(point)
            before = {**before, **now}

    async def one(i: int) -> None:
        nonlocal opened, answered, ended
        if open_rate:
            await asyncio.sleep(began + i / open_rate - time.perf_counter())
        started, first = time.perf_counter(), None
        opened += 1
        try:
            async for _ in chunks(i, tokens):
                if first is None:
                    first = time.perf_counter()
                    answered += 1
        finally:
            ended += first is not None
        assert first is not None
        spans.append((first, time.perf_counter()))
        waits.append(first - started)

    watchers = [asyncio.create_task(watch_memory())]
    if lag_ports:
        watchers.append(asyncio.create_task(watch_lag()))
    outcomes = await asyncio.gather(*(one(i) for i in range(streams)), return_exceptions=True)
    for watcher in watchers:
        watcher.cancel()
    level_s = time.perf_counter() - began
    lag = lag_since(await loop_lag.scrape(lag_ports), lag_at_start)
    cpu = by_hop(Usage.of(pids).cpu_since(idle))
    failures = [e for e in outcomes if isinstance(e, BaseException)]
    errors = sorted({f"{type(e).__name__}: {e}"[:200] for e in failures})
    # The most streams open at one moment: +1 at each first chunk, -1 at each end.
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    open_now = peak = 0
    for _, step in edges:
        open_now += step
        peak = max(peak, open_now)
    waits = waits or [0.0]
    return Held(
        streams,
        len(failures),
        errors,
        peak,
        max((start - began for start, _ in spans), default=0.0),
        statistics.median(waits),
        percentile(waits, 0.99),
        {hop: grown / streams for hop, grown in by_hop(peak_usage.rss_since(idle)).items()},
        {hop: seconds / level_s for hop, seconds in cpu.items()},
        lag,
        timeline,
    )


async def hold_ramp(
    args: argparse.Namespace, url: str, keys: DevKeys, pids: dict[str, int], lag_ports: Mapping[str, int]
) -> list[Held]:
    door = Door(url, keys, args.hold_tokens)
    levels, level = [], args.hold_start
    while level < args.hold_cap:
        levels.append(level)
        level *= 2
    levels.append(args.hold_cap)
    path = {
        "sse": "OpenAI SSE streams",
        "grpc": "ChatService.Complete over gRPC",
        "chat": "the chat page's stored sends (SSE)",
    }[args.hold_via]
    orchestrator_ports = {name: port for name, port in lag_ports.items() if name.startswith("orchestrator")}
    opening = f"{args.hold_open_rate:g} a second" if args.hold_open_rate else "all at once"
    print(
        f"\nhold ramp: {path} of {args.hold_tokens} tokens through Envoy, opened {opening}, null engines "
        f"paced at {args.hold_tokens_per_s:g} tokens/s per stream, cap {args.hold_cap}\n"
        f"{'streams':>7} {'held':>5} {'peak open':>9} {'all answered by':>15} {'first chunk p50/p99':>20}  "
        f"KiB per open stream ({', '.join(MEMORY_HOPS)})  cores busy (same, then cassandra, its JIT)  errors",
        flush=True,
    )
    results: list[Held] = []
    try:
        # The restarted engines are back in the router once a few short streams get through.
        for _ in range(60):
            if not (await hold_level(door, 4, 2, pids, "sse")).errors:
                break
            await asyncio.sleep(0.5)
        for streams in levels:
            for i in range(streams):
                door.auth(i)  # mint the tokens before the clock starts
            chats = await door.new_chats(streams) if args.hold_via == "chat" else []
            requests_before = await store_requests(orchestrator_ports)
            result = await hold_level(
                door, streams, args.hold_tokens, pids, args.hold_via, args.hold_open_rate, lag_ports, chats
            )
            results.append(result)
            memory = " ".join(f"{result.bytes_per_stream.get(hop, 0) / 1024:.1f}" for hop in MEMORY_HOPS)
            cores = " ".join(
                f"{result.cores.get(hop, 0):.2f}" for hop in (*MEMORY_HOPS, "cassandra", "cassandra JIT")
            )
            print(
                f"{streams:>7} {'yes' if result.held else 'NO':>5} {result.peak_open:>9} "
                f"{result.open_s:>14.1f}s {result.first_p50:>9.1f}s / {result.first_p99:.1f}s  "
                f"{memory}  {cores}  {result.failed} failed {result.errors[:3]}",
                flush=True,
            )
            print_lag(result)
            if args.hold_via == "chat":
                print_store_requests(await store_requests(orchestrator_ports), requests_before, streams)
            if not result.held:
                break
    finally:
        await door.close()
    return results


DB_OPERATIONS = "db_client_operation_duration_seconds"


async def store_requests(ports: Mapping[str, int]) -> Counter[str]:
    """The Cassandra requests the orchestrators have made so far, by statement (memory_store's
    db.client.operation.duration counts)."""
    counts: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=10.0) as client:
        for port in ports.values():
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
            for family in text_string_to_metric_families(text):
                if family.name == DB_OPERATIONS:
                    for sample in family.samples:
                        if sample.name == f"{DB_OPERATIONS}_count":
                            counts[sample.labels["db_operation_name"]] += int(sample.value)
    return counts


def print_store_requests(after: Counter[str], before: Counter[str], streams: int) -> None:
    """The level's Cassandra requests by statement, in all and per stream."""
    made = after - before
    total = sum(made.values())
    print(
        f"        orchestrators' Cassandra requests over the level: {total:.0f} ({total / streams:.1f} a "
        "stream); by statement: " + ", ".join(f"{name} {count:.0f}" for name, count in made.most_common(8))
    )


def print_lag(result: Held) -> None:
    """The level's event loop lag by hop, and how it grew with the streams (ms, mean/p99 bucket)."""
    if not result.lag:
        return
    hops = [hop for hop in LAG_HOPS if hop in result.lag]
    print(
        "        event loop lag over the level, ms mean/p99: "
        + ", ".join(f"{hop} {loop_lag.describe(result.lag[hop])}" for hop in hops)
    )
    print(
        f"        {'at':>6} {'opened':>7} {'waiting':>7} {'open':>6}  "
        + "  ".join(f"{hop:>13}" for hop in hops)
    )
    for point in result.timeline:
        lags = "  ".join(
            f"{loop_lag.describe(point.lag[hop]) if hop in point.lag else '-':>13}" for hop in hops
        )
        print(f"        {point.at_s:>5.0f}s {point.opened:>7} {point.waiting:>7} {point.open:>6}  {lags}")


# What each process relays: its CPU time per token relayed is that hop's cost. Envoy carries every token
# once (edge -> client).
HOPS = {
    "engine": "engine -> router (the engines' own sending)",
    "router": "router -> orchestrator",
    "orchestrator": "orchestrator -> edge",
    "edge": "edge -> client (SSE)",
    "envoy": "Envoy, every pass",
}
DOOR = ("router", "orchestrator", "edge", "envoy")
# The streams the relay cost can be read on (``--cost-path``).
COST_PATHS = {"openai": "OpenAI streams", "chat": "the chat page's sends (stored runs)"}
MEMORY_HOPS = (*HOPS, "client")
# The hops that are Python services: each reports its event loop's lag.
LAG_HOPS = ("engine", "router", "orchestrator", "edge")


def process_ids(launcher: Launcher) -> dict[str, int]:
    """The mesh's processes by launcher name, and this benchmark's own as ``client``."""
    return {**{name: running.pid for name, running in launcher.running.items()}, "client": os.getpid()}


def pin_door(pids: Mapping[str, int]) -> None:
    """Puts the door's processes (every thread) on the upper half of the CPUs and everything else
    (engines, Cassandra, this client) on the lower half: the door saturates on its own cores while the
    engines keep their pace, as when they run on their own machines. Without it the engines share the
    cores and slow down with the door, so no queue forms inside the door."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin-door needs at least two CPUs")
    half = len(cpus) // 2
    for name, pid in pids.items():
        mask = set(cpus[half:] if hop_of(name) in DOOR else cpus[:half])
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(task.name), mask)
    print(f"pinned: the door on CPUs {cpus[half:]}, engines, Cassandra and the client on {cpus[:half]}")


def hop_of(name: str) -> str:
    """A process's hop: its launcher name, less a replica's ``-<i>``."""
    tier, _, index = name.rpartition("-")
    return tier if tier and index.isdigit() else name


def by_hop(values: Mapping[str, float]) -> dict[str, float]:
    """Per-process values summed by hop (a tier's replicas, ``<tier>-<i>``, together)."""
    hops: dict[str, float] = {}
    for name, value in values.items():
        hop = hop_of(name)
        hops[hop] = hops.get(hop, 0.0) + value
    return hops


@dataclass
class Cost:
    path: str  # openai or chat
    streams: int
    tokens_per_s: float  # tokens the client received per second in the window
    tokens_per_event: float  # tokens per chunk or delta it received then (over 1: the door merged them)
    us_per_token: dict[str, float]  # CPU microseconds per relayed token, by hop
    cancels: Counter[str]  # how the cancels of a chat level's runs were answered (Door.cancel_runs)
    cancel_s: tuple[float, float]  # p50 and p99 of the seconds until a run's cancel was answered
    health_ms: list[float]  # how long each health check of an orchestrator took in the window
    lag: dict[str, loop_lag.LagHistogram]  # each hop's event loop lag over the window (most lagging replica)
    gaps_ms: tuple[float, float]  # p50 and p99 of the time between a stream's events in the window

    @property
    def door_us(self) -> float:
        return sum(self.us_per_token[hop] for hop in DOOR)


async def probe_health(orchestrators: Sequence[str], answered_ms: list[float]) -> None:
    """Asks each orchestrator's gRPC health every ``HEALTH_PROBE_INTERVAL_S`` (a new call each time, as
    a kubelet's probe is), adding how long each took to be answered, until cancelled."""
    channels = [grpc.aio.insecure_channel(address) for address in orchestrators]
    stubs = [health_pb2_grpc.HealthStub(channel) for channel in channels]

    async def check(stub: health_pb2_grpc.HealthStub) -> None:
        asked = time.perf_counter()
        with contextlib.suppress(grpc.RpcError):
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=30.0)
        answered_ms.append(1000 * (time.perf_counter() - asked))

    checks: set[asyncio.Task[None]] = set()
    try:
        while True:
            for stub in stubs:
                task = asyncio.create_task(check(stub))
                checks.add(task)
                task.add_done_callback(checks.discard)
            await asyncio.sleep(HEALTH_PROBE_INTERVAL_S)
    finally:
        for task in checks:
            task.cancel()
        for channel in channels:
            await channel.close()


async def relay_cost(
    door: Door,
    path: str,
    streams: int,
    tokens: int,
    window_s: float,
    pids: dict[str, int],
    lag_ports: Mapping[str, int],
    orchestrators: Sequence[str],
) -> Cost:
    """Opens ``streams`` long streams along ``path`` (``openai``, or ``chat``: a send in a new chat
    each); once every one has its first token (and a second for the opening burst to settle), reads
    each process's CPU time over ``window_s`` and divides by the tokens the client received meanwhile,
    asking the ``orchestrators``' health meanwhile (``probe_health``). Then the streams are closed and
    their runs cancelled."""
    received = events = started = 0
    all_started = asyncio.Event()
    window: list[float] | None = None  # the gaps between a stream's events while the window is open
    chats = await door.new_chats(streams) if path == "chat" else []

    def chunks(i: int) -> AsyncIterator[int]:
        return door.chat_chunks(i, chats[i], tokens) if chats else door.openai_chunks(i, tokens)

    async def one(i: int) -> None:
        nonlocal received, events, started
        first, last_at = True, 0.0
        async for count in chunks(i):
            received, events = received + count, events + 1
            now = time.perf_counter()
            if window is not None:
                window.append(now - last_at)
            last_at = now
            if first:
                first, started = False, started + 1
                if started == streams:
                    all_started.set()

    tasks = [asyncio.create_task(one(i)) for i in range(streams)]
    try:
        try:
            async with asyncio.timeout(120):
                await all_started.wait()
        except TimeoutError:
            failed = [t.exception() for t in tasks if t.done() and t.exception() is not None]
            raise StreamFailedError(
                f"{started} of {streams} streams started in 120 s; {len(failed)} failed"
                + (f", the first with {failed[0]!r}" if failed else "")
            ) from None
        await asyncio.sleep(1.0)
        lag_before = await loop_lag.scrape(lag_ports)
        before, counted, events_before, began = Usage.of(pids), received, events, time.perf_counter()
        window = gaps = []
        health_ms: list[float] = []
        probing = asyncio.create_task(probe_health(orchestrators, health_ms))
        await asyncio.sleep(window_s)
        probing.cancel()
        after, relayed, elapsed = Usage.of(pids), received - counted, time.perf_counter() - began
        window = None
        lag = lag_since(await loop_lag.scrape(lag_ports), lag_before)
        per_event = relayed / max(1, events - events_before)
        failed = [t for t in tasks if t.done() and t.exception() is not None]
        if failed:
            raise StreamFailedError(f"{len(failed)} streams failed: {failed[0].exception()}")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        cancels, answered_s = await door.cancel_runs()  # a chat's run goes on when its stream is dropped
    cpu = by_hop(after.cpu_since(before))
    us_per_token = {hop: seconds * 1e6 / relayed for hop, seconds in cpu.items()}
    gaps_ms = (1000 * percentile(gaps, 0.5), 1000 * percentile(gaps, 0.99)) if gaps else (0.0, 0.0)
    cancel_s = (percentile(answered_s, 0.5), percentile(answered_s, 0.99)) if answered_s else (0.0, 0.0)
    return Cost(
        path, streams, relayed / elapsed, per_event, us_per_token, cancels, cancel_s, health_ms, lag, gaps_ms
    )


async def cost_levels(
    args: argparse.Namespace,
    url: str,
    keys: DevKeys,
    pids: dict[str, int],
    lag_ports: Mapping[str, int],
    orchestrators: Sequence[str],
) -> list[Cost]:
    tokens = min(4096, round(args.tokens_per_s * (args.cost_window_s + 60)))
    door = Door(url, keys, tokens)
    results = []
    try:
        for path in args.cost_path:
            print(
                f"\nrelay cost: {COST_PATHS[path]} through Envoy, null engines paced at {args.tokens_per_s:g} "
                f"tokens/s per stream, CPU time of each process over a {args.cost_window_s:g} s window with "
                f"every stream open, per token the client received\n"
                f"{'streams':>7} {'tokens/s':>8} "
                + " ".join(f"{hop:>12}" for hop in HOPS)
                + f" {'door':>7} {'door tok/s/core':>15} {'client':>7} {'cassandra':>9} {'its JIT':>7}"
                f" {'tok/event':>9}  (µs CPU per token; its JIT: Cassandra's compiler threads, apart; tokens"
                " per chunk or delta the client got)",
                flush=True,
            )
            for streams in args.cost_streams:
                for i in range(streams):
                    door.auth(i)
                cost = await relay_cost(
                    door, path, streams, tokens, args.cost_window_s, pids, lag_ports, orchestrators
                )
                results.append(cost)
                us = cost.us_per_token
                print(
                    f"{streams:>7} {cost.tokens_per_s:>8,.0f} "
                    + " ".join(f"{us[hop]:>12.1f}" for hop in HOPS)
                    + f" {cost.door_us:>7.1f} {1e6 / cost.door_us:>15,.0f} {us['client']:>7.1f} "
                    f"{us.get('cassandra', 0):>9.1f} {us.get('cassandra JIT', 0):>7.1f}"
                    f" {cost.tokens_per_event:>9.2f}",
                    flush=True,
                )
                print(
                    f"{'':>7} a stream's events {cost.gaps_ms[0]:.1f} / {cost.gaps_ms[1]:.1f} ms apart (p50 / p99);"
                    " event loop lag over the window, ms mean/p99: "
                    + ", ".join(
                        f"{hop} {loop_lag.describe(cost.lag[hop])}" for hop in LAG_HOPS if hop in cost.lag
                    ),
                    flush=True,
                )
                if cost.health_ms:
                    health = sorted(cost.health_ms)
                    print(
                        f"{'':>7} {len(cost.health_ms)} health checks of the orchestrators over the window,"
                        f" answered in {percentile(health, 0.5):.0f} / {percentile(health, 0.99):.0f}"
                        f" / {health[-1]:.0f} ms (p50 / p99 / max), over 1 s (a readiness probe's"
                        f" default timeout): {sum(ms > 1000 for ms in health)}",
                        flush=True,
                    )
                if cost.cancels:
                    print(
                        f"{'':>7} cancels answered: {dict(cost.cancels.most_common())}, a run's in"
                        f" {cost.cancel_s[0]:.1f} / {cost.cancel_s[1]:.1f} s (p50 / p99, its tries included)",
                        flush=True,
                    )
                await asyncio.sleep(2.0)  # the cancelled runs end before the next level
    finally:
        await door.close()
    return results


async def request_cost(
    door: Door, path: str, requests: int, concurrency: int, pids: dict[str, int]
) -> dict[str, float]:
    """Milliseconds of CPU per request by process: ``requests`` short answers along ``path``, ``concurrency``
    at a time, each from a user of its own (a chat's is created before the clock starts)."""
    for i in range(requests):
        door.auth(i)
    chats = await door.new_chats(requests) if path == "chat" else [""] * requests
    await asyncio.sleep(2.0)  # the chats' own writes settle before the reading
    pending = iter(range(requests))

    async def worker() -> None:
        for i in pending:
            await door.stream(path, i, chats[i])

    before = Usage.of(pids)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu = by_hop(Usage.of(pids).cpu_since(before))
    return {hop: seconds * 1e3 / requests for hop, seconds in cpu.items()}


async def warm_door(args: argparse.Namespace, url: str, keys: DevKeys, pids: dict[str, int]) -> None:
    """``--warm-door-sends`` short stored sends through the door, then how much of Cassandra's CPU its JIT
    compilers still took over the last fifth of them (what is left of its warming)."""
    door = Door(url, keys, args.cost_request_tokens)
    try:
        began = time.perf_counter()
        await request_cost(door, "chat", args.warm_door_sends * 4 // 5, 10, pids)
        last = await request_cost(door, "chat", max(1, args.warm_door_sends // 5), 10, pids)
    finally:
        await door.close()
    print(
        f"warmed the door: {args.warm_door_sends} stored sends in {time.perf_counter() - began:.0f}s; over the "
        f"last fifth Cassandra used {last.get('cassandra', 0):.1f} ms of CPU a send and its JIT compilers "
        f"{last.get('cassandra JIT', 0):.1f} more",
        flush=True,
    )


async def request_costs(args: argparse.Namespace, url: str, keys: DevKeys, pids: dict[str, int]) -> None:
    door = Door(url, keys, args.cost_request_tokens)
    columns = (*HOPS, "cassandra", "cassandra JIT", "client")
    print(
        f"\ncost per request: {args.cost_requests} requests a path, {args.cost_concurrency} at a time, "
        f"{args.cost_request_tokens} tokens each, a user and a chat of its own each; CPU of each process "
        f"from the first request to the last end, per request\n"
        f"{'path':<7} "
        + " ".join(f"{name:>12}" for name in columns)
        + f" {'door':>7} {'door+db':>8} {'requests/s/core':>15}  (ms CPU per request; door+db: door and "
        "Cassandra, its JIT compilers apart)",
        flush=True,
    )
    try:
        for path in ("openai", "chat"):
            ms = await request_cost(door, path, args.cost_requests, args.cost_concurrency, pids)
            door_ms = sum(ms[hop] for hop in DOOR)
            with_db = door_ms + ms.get("cassandra", 0.0)
            print(
                f"{path:<7} "
                + " ".join(f"{ms.get(name, 0.0):>12.2f}" for name in columns)
                + f" {door_ms:>7.2f} {with_db:>8.2f} {1e3 / with_db:>15,.0f}",
                flush=True,
            )
    finally:
        await door.close()


def plot_cost(costs: list[Cost], path: Path, title: str) -> None:
    """A panel a path: each level's CPU per relayed token stacked by hop (and Cassandra's, its JIT
    compilers apart), its tokens/s above the bar."""
    plt = pyplot()
    if plt is None:
        return
    paths = list(dict.fromkeys(c.path for c in costs))
    fig, axes = plt.subplots(1, len(paths), figsize=(5.5 * len(paths) + 2, 4.2), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], paths, strict=True):
        mine = [c for c in costs if c.path == name]
        xs = [str(c.streams) for c in mine]
        bottom = [0.0] * len(mine)
        for hop, label in {**HOPS, "cassandra": "Cassandra (the runs' and budgets' writes)"}.items():
            heights = [c.us_per_token.get(hop, 0.0) for c in mine]
            ax.bar(xs, heights, bottom=bottom, label=label)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        for x, c, top in zip(xs, mine, bottom, strict=True):
            ax.annotate(f"{c.tokens_per_s:,.0f} tok/s", (x, top), ha="center", va="bottom", fontsize=8)
        ax.set_xlabel("concurrent streams")
        ax.set_title(COST_PATHS[name], fontsize=9)
    axes[0][0].set_ylabel("CPU µs per relayed token")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def plot(rows: list[Row], path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in (
        (axes[0], "ttft", "time to first token (ms)"),
        (axes[1], "tpot", "time per output token (ms)"),
    ):
        for name, colour in zip(PATHS, ("tab:gray", "tab:blue", "tab:orange"), strict=True):
            mine = [r for r in rows if r.path == name]
            xs = [r.concurrency for r in mine]
            ax.plot(
                xs,
                [getattr(r, f"{metric}_p50") * 1000 for r in mine],
                "o-",
                color=colour,
                label=f"{name} p50",
            )
            ax.plot(
                xs,
                [getattr(r, f"{metric}_p99") * 1000 for r in mine],
                "x--",
                color=colour,
                alpha=0.6,
                label=f"{name} p99",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def start_door(launcher: Launcher, orchestrators: list[str], run_dir: Path, keys: DevKeys) -> str:
    """The edge and Envoy with ``make run``'s config (default rate limits) in front of ``orchestrators``
    (Envoy spreads calls over them); ``keys`` sign the tokens Envoy, the edge and the orchestrators all
    verify."""
    ports = FrontDoorPorts(envoy=free_port(), envoy_admin=free_port(), edge=free_port())
    orchestrator_ports = [int(address.rsplit(":", 1)[1]) for address in orchestrators]
    edge_flags = ["--metrics-port", str(free_port())]  # its event loop's lag (bench/loop_lag.py)
    specs = front_door_specs(ports, orchestrator_ports, run_dir, keys, edge_flags=edge_flags)
    for spec in specs:
        launcher.start(spec)
    return f"http://127.0.0.1:{ports.envoy}"


def restart_engines(launcher: Launcher, engines: list[str], tokens_per_s: float, max_running: int) -> None:
    """The same engines on the same ports, paced anew (the router reconnects to them), each with room to
    decode ``max_running`` streams and to take all of their prompts into one step: a step lasts a token's
    pace, and prompts waiting a step for room would count as a queue at the router's admission."""
    for i, address in enumerate(engines):
        launcher.stop(f"engine-{i}")
        port = int(address.rsplit(":", 1)[1])
        launcher.start(null_engine(i, port, tokens_per_s, max_running, max_running * PROMPT_ROOM))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 50, 500])
    parser.add_argument("--requests", type=int, default=20, help="streams per row (at least the concurrency)")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per stream")
    parser.add_argument("--tokens-per-s", type=float, default=50.0, help="null engines' pace per stream")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument(
        "--orchestrators", type=int, default=1, help="orchestrator replicas (Envoy spreads calls over them)"
    )
    parser.add_argument(
        "--stream-interval-max-ms",
        type=int,
        default=None,
        help="the orchestrators' --stream-interval-max-ms (default: theirs; 0: every delta alone, always)",
    )
    parser.add_argument(
        "--warm-sends",
        type=int,
        default=6000,
        help="sends' statements run on Cassandra before measuring (a fresh JVM compiles for thousands)",
    )
    parser.add_argument(
        "--warm-door-sends",
        type=int,
        default=0,
        help="short stored sends through the door before measuring, 10 at a time (Cassandra's JIT compiles "
        "the mesh's own requests; the statements of --warm-sends are not all of them)",
    )
    parser.add_argument("--hold-cap", type=int, default=2000, help="most streams the ramp opens (0: no ramp)")
    parser.add_argument("--hold-start", type=int, default=250, help="the ramp's first level (then doubling)")
    parser.add_argument("--hold-tokens", type=int, default=60, help="tokens per stream in the ramp")
    parser.add_argument("--hold-tokens-per-s", type=float, default=1.0, help="engines' pace in the ramp")
    parser.add_argument(
        "--hold-via",
        choices=("sse", "grpc", "chat"),
        default="sse",
        help="the ramp's streams: the OpenAI SSE route (browsers' door), gRPC Complete (services' door), "
        "or the chat page's stored sends",
    )
    parser.add_argument(
        "--hold-open-rate", type=float, default=0.0, help="streams the ramp opens a second (0: all at once)"
    )
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "front_door_latency.png")
    parser.add_argument(
        "--cost-streams",
        type=int,
        nargs="*",
        default=[10, 50, 100, 200],
        help="relay cost levels (none: skip)",
    )
    parser.add_argument("--cost-window-s", type=float, default=10.0, help="CPU is read over this window")
    parser.add_argument(
        "--cost-path",
        choices=tuple(COST_PATHS),
        nargs="+",
        default=["openai"],
        help="the streams whose relay is costed, in turn: OpenAI streams, the chat page's stored sends",
    )
    parser.add_argument(
        "--pin-door",
        action="store_true",
        help="door on half the CPUs, engines/Cassandra/client on the rest, for the relay cost and after",
    )
    parser.add_argument("--cost-plot", type=Path, default=ROOT / "docs" / "front_door_cost.png")
    parser.add_argument(
        "--cost-requests", type=int, default=200, help="requests a path for the cost per request (0: skip)"
    )
    parser.add_argument("--cost-concurrency", type=int, default=10, help="requests at a time for it")
    parser.add_argument("--cost-request-tokens", type=int, default=8, help="tokens each of them answers")
    parser.add_argument(
        "--run-dir", type=Path, help="keep the services' data and logs here (default: a temp dir)"
    )
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory(prefix="bench-front-door-") as tmp:
        run(args, args.run_dir or Path(tmp))


def run(args: argparse.Namespace, run_dir: Path) -> None:
    with Launcher(run_dir, echo=print) as launcher:
        print("starting Cassandra, engines, router, orchestrator, edge and Envoy ...", flush=True)
        keys = generate_keys(run_dir / "dev-jwt")
        interval = args.stream_interval_max_ms
        engines, router, orchestrators = start_mesh(
            launcher,
            args,
            run_dir,
            keys,
            args.warm_sends,
            args.orchestrators,
            () if interval is None else ("--stream-interval-max-ms", str(interval)),
        )
        url = start_door(launcher, orchestrators, run_dir, keys)
        asyncio.run(wait_for_engines(router, len(engines)))
        if args.warm_door_sends:
            asyncio.run(warm_door(args, url, keys, process_ids(launcher)))
        if args.concurrency:
            rows = asyncio.run(latency(args, engines, router, orchestrators[0], url, keys))
            plot(
                rows,
                args.plot,
                f"chatmesh front door: mesh overhead, null engine ({args.tokens_per_s:g} tok/s per stream, "
                f"{args.tokens} tokens); shared 2-core machine: provisional",
            )
        pids = process_ids(launcher)
        if args.pin_door:
            pin_door(pids)
        if args.cost_streams:
            costs = asyncio.run(
                cost_levels(args, url, keys, pids, loop_lag.metrics_ports(launcher), orchestrators)
            )
            plot_cost(
                costs,
                args.cost_plot,
                f"CPU per relayed token by hop, null engines at {args.tokens_per_s:g} tok/s per stream; "
                "shared 2-core machine",
            )
        if args.cost_requests:
            asyncio.run(request_costs(args, url, keys, pids))
        if args.hold_cap:
            print(f"\nrestarting the engines paced at {args.hold_tokens_per_s:g} tokens/s ...", flush=True)
            # Every stream of the largest level decodes at once, however placement spreads them (the
            # streams share one prompt, so cache-aware placement gathers them): the ramp measures the
            # door, not an engine's queue.
            restart_engines(launcher, engines, args.hold_tokens_per_s, args.hold_cap)
            asyncio.run(wait_for_engines(router, len(engines)))
            asyncio.run(hold_ramp(args, url, keys, process_ids(launcher), loop_lag.metrics_ports(launcher)))
        print(f"\nmachine at the end: {machine()}")


if __name__ == "__main__":
    main()
