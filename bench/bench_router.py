"""Multi-turn chat through the router over several real-model engines: kv_aware vs round_robin vs random,
and an oracle (always the longest cached prefix) as the reference for the hit rate.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_router.py \
        [--engines 4] [--conversations 40] [--turns 6] [--rate 0.25] [--json out.json]

Workload (the same for every policy, from one seed): conversations arrive as a Poisson process; each
uses one of a few shared system prompts and runs several turns; a turn resends the whole history (system
prompt, every earlier user message and the assistant's actual output tokens) plus a new user message,
and the next turn follows the answer after an exponential think time. Greedy decoding with a fixed
answer length (ignore_eos), so every policy does the same work. Each policy gets freshly started
engines (cold caches) and one warm-up request per engine with an unrelated prompt.

Cores: engine i is pinned with ``taskset`` to core ``i mod cores`` and runs one compute thread, so with
4 engines on 2 cores each engine gets half a core; the router and this client are not pinned.

Reported per policy: prefix hit rate (prompt tokens served from cache ÷ prompt tokens, from the
engines' own usage), TTFT p50/p90 and TPOT p50 measured at the client, output tokens/s and requests/s
over the whole run, how often the router's predicted hit equalled the engine's actual one, and the
requests per engine; and how many times the router refused a turn (pro tier: admission by predicted
wait, or an engine's queue limit), which the client then sends again after the retry delay. Then the
router's own cost: the same streams straight to a null engine and
through the router.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_engine_overhead import StreamTimes, timed_stream  # noqa: E402
from bench.link_client import engine_link, frames, router_link  # noqa: E402
from chatmesh.engine.v1 import engine_pb2  # noqa: E402
from chatmesh.errors import ServiceError  # noqa: E402
from chatmesh.router.v1 import router_pb2, router_pb2_grpc  # noqa: E402
from chatmesh.tokenizer import ChatMessage, ChatTokenizer, load_tokenizer  # noqa: E402
from meshkit.launcher import GrpcHealthy, Launcher, ServiceSpec, free_port  # noqa: E402
from meshkit.links import Link  # noqa: E402

WORDS = [
    "river",
    "mountain",
    "cloud",
    "engine",
    "signal",
    "garden",
    "market",
    "window",
    "letter",
    "winter",
    "harbor",
    "silver",
    "planet",
    "forest",
    "library",
    "bridge",
    "lantern",
    "orchard",
    "circuit",
    "compass",
    "meadow",
    "canyon",
    "thunder",
    "ribbon",
    "pebble",
    "candle",
    "anchor",
    "marble",
    "violin",
    "harvest",
    "summit",
    "glacier",
    "prairie",
    "beacon",
    "falcon",
    "cobalt",
    "velvet",
    "quartz",
    "saddle",
    "tundra",
    "archive",
    "cipher",
    "delta",
    "ember",
    "fable",
    "gravity",
    "horizon",
    "island",
    "jungle",
    "kernel",
    "lattice",
    "meteor",
    "nebula",
    "oasis",
]


# -- workload --------------------------------------------------------------------------------------------


@dataclass
class Conversation:
    name: str
    start_s: float  # arrival, from the start of the run
    first_prompt: list[int]
    follow_ups: list[list[int]]  # tokens appended after each answer (end of answer, next user turn)
    think_s: list[float]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def turn_suffix(tok: ChatTokenizer, user_text: str) -> list[int]:
    """What follows an assistant answer in the chat template: its end, then the next user message."""
    end, start = tok.eos_token_ids[0], tok.bos_token_id
    newline = tok.encode("\n")
    return [
        end,
        *newline,
        start,
        *tok.encode("user\n" + user_text),
        end,
        *newline,
        start,
        *tok.encode("assistant\n"),
    ]


def check_turn_suffix(tok: ChatTokenizer) -> None:
    """The token-level history equals what the chat template renders (so the cache sees real prompts)."""
    first = tok.encode_chat([ChatMessage("system", "S."), ChatMessage("user", "One.")])
    answer = tok.encode("Fine")
    whole = tok.encode_chat(
        [
            ChatMessage("system", "S."),
            ChatMessage("user", "One."),
            ChatMessage("assistant", "Fine"),
            ChatMessage("user", "Two."),
        ]
    )
    assert first + answer + turn_suffix(tok, "Two.") == whole, "turn_suffix does not match the chat template"


def make_workload(tok: ChatTokenizer, args: argparse.Namespace) -> list[Conversation]:
    rng = random.Random(args.seed)
    systems = [text(rng, args.system_words) for _ in range(args.system_prompts)]
    conversations, clock = [], 0.0
    for i in range(args.conversations):
        clock += rng.expovariate(args.rate)
        user = [text(rng, args.user_words) for _ in range(args.turns)]
        first = tok.encode_chat([ChatMessage("system", rng.choice(systems)), ChatMessage("user", user[0])])
        conversations.append(
            Conversation(
                name=f"chat-{i}",
                start_s=clock,
                first_prompt=first,
                follow_ups=[turn_suffix(tok, u) for u in user[1:]],
                think_s=[rng.expovariate(1 / args.think_s) for _ in range(args.turns - 1)],
            )
        )
    return conversations


# -- one run ------------------------------------------------------------------------------------------------


@dataclass
class Result:
    conversation: str
    turn: int
    sent_s: float
    ttft_s: float
    done_s: float
    prompt_tokens: int
    cached_tokens: int
    predicted_tokens: int
    output_tokens: int
    engine: str
    attempts: int
    refusals: int = 0  # times the router refused this turn (RESOURCE_EXHAUSTED) before it was answered


async def one_request(
    link: Link, conv: Conversation, turn: int, prompt: list[int], args, t0: float, fingerprint: str
) -> tuple[Result, list[int]]:
    start = router_pb2.GenerateStart(
        request_id=f"{conv.name}-{turn}-{time.monotonic_ns()}",
        prompt_token_ids=prompt,
        sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True),
        tier=router_pb2.TIER_PRO,
        session_id=conv.name,
        tokenizer_fingerprint=fingerprint,
        new_session=turn == 0,
    )
    sent = time.perf_counter()
    first, tokens, routed, finished = None, [], [], None
    async for frame in frames(link, start, timeout_ms=3_600_000):
        kind = frame.WhichOneof("kind")
        if kind == "routed":
            routed.append(frame.routed)
        elif kind == "tokens":
            first = first or time.perf_counter()
            tokens += frame.tokens.token_ids
        elif kind == "finished":
            finished = frame.finished
    done = time.perf_counter()
    result = Result(
        conversation=conv.name,
        turn=turn,
        sent_s=sent - t0,
        ttft_s=(first or done) - sent,
        done_s=done - t0,
        prompt_tokens=finished.usage.prompt_tokens,
        cached_tokens=finished.usage.cached_prompt_tokens,
        predicted_tokens=routed[-1].predicted_cached_tokens,
        output_tokens=len(tokens),
        engine=routed[-1].engine_id,
        attempts=len(routed),
    )
    return result, tokens


async def answered(
    link: Link, conv: Conversation, turn: int, prompt: list[int], args, t0: float, fingerprint: str
) -> tuple[Result, list[int]]:
    """One turn, sent again after the router's retry delay each time it is refused, as a client would
    (admission by predicted wait, or an engine's queue limit); the result counts the refusals and
    times the attempt that was answered."""
    refusals = 0
    while True:
        try:
            result, tokens = await one_request(link, conv, turn, prompt, args, t0, fingerprint)
        except ServiceError as error:
            if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            refusals += 1
            await asyncio.sleep(error.retry_after_s or 1.0)
            continue
        result.refusals = refusals
        return result, tokens


async def converse(
    link: Link, conv: Conversation, args, t0: float, fingerprint: str, results: list[Result]
) -> None:
    await asyncio.sleep(max(0.0, t0 + conv.start_s - time.perf_counter()))
    prompt = conv.first_prompt
    for turn in range(args.turns):
        result, answer = await answered(link, conv, turn, prompt, args, t0, fingerprint)
        results.append(result)
        if turn + 1 < args.turns:
            prompt = prompt + answer + conv.follow_ups[turn]
            await asyncio.sleep(conv.think_s[turn])


async def drive(router_address: str, workload: list[Conversation], args, fingerprint: str) -> list[Result]:
    results: list[Result] = []
    async with grpc.aio.insecure_channel(router_address) as channel:
        link = router_link(channel)
        t0 = time.perf_counter()
        await asyncio.gather(*(converse(link, c, args, t0, fingerprint, results) for c in workload))
    return results


async def warm_up(addresses: list[str]) -> None:
    """One short request per engine, straight to it, with a prompt the workload never uses."""
    for i, address in enumerate(addresses):
        async with grpc.aio.insecure_channel(address) as channel:
            start = engine_pb2.GenerateStart(
                request_id=f"warm-{i}",
                prompt_token_ids=list(range(40000, 40020)),
                sampling=engine_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
            )
            async for _ in frames(engine_link(channel), start):
                pass


def engine_spec(i: int, backend: str, args, cores: int, null_tokens_per_s: float = 0) -> ServiceSpec:
    port = free_port()
    argv = [sys.executable, "-m", "engine", "--port", str(port), "--engine-id", f"e{i}", "--backend", backend]
    if backend == "cpu":
        argv = ["taskset", "-c", str(i % cores), *argv, "--threads", "1"]
        if args.kv_blocks:
            argv += ["--num-kv-blocks", str(args.kv_blocks)]
    else:
        argv += ["--null-tokens-per-s", str(null_tokens_per_s), "--max-running-requests", "256"]
        argv += ["--max-batched-tokens", "4096"]
    return ServiceSpec(f"e{i}", argv, ports=(port,), ready=GrpcHealthy(port), cwd=ROOT, ready_timeout_s=300)


def router_spec(engines: list[ServiceSpec], policy: str) -> ServiceSpec:
    """``policy`` is a router policy, or ``kv_aware:W[:S]`` for kv_aware with overlap weight W (and
    session weight S)."""
    port = free_port()
    name, _, weights = policy.partition(":")
    overlap, _, session = weights.partition(":")
    argv = [sys.executable, "-m", "router", "--port", str(port), "--policy", name]
    if overlap:
        argv += ["--overlap-weight", overlap]
    if session:
        argv += ["--session-weight", session]
    for spec in engines:
        argv += ["--engine", f"{spec.name}=127.0.0.1:{spec.ports[0]}"]
    return ServiceSpec("router", argv, ports=(port,), ready=GrpcHealthy(port), cwd=ROOT)


def wait_for_engines(address: str, count: int) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        deadline = time.monotonic() + 60
        while (
            sum(e.healthy for e in stub.ListEngines(router_pb2.ListEnginesRequest(), timeout=5).engines)
            < count
        ):
            if time.monotonic() > deadline:
                raise SystemExit("the router never saw every engine healthy")
            time.sleep(0.1)


def run_policy(
    policy: str, workload: list[Conversation], args, fingerprint: str, run_dir: Path
) -> list[Result]:
    cores = len(os.sched_getaffinity(0))
    with Launcher(run_dir / policy, echo=lambda line: None) as launcher:
        engines = [engine_spec(i, "cpu", args, cores) for i in range(args.engines)]
        for spec in engines:
            launcher.start(spec)
        router = launcher.start(router_spec(engines, policy))
        address = f"127.0.0.1:{router.spec.ports[0]}"
        wait_for_engines(address, len(engines))
        asyncio.run(warm_up([f"127.0.0.1:{spec.ports[0]}" for spec in engines]))
        print(f"  {policy}: {args.engines} fresh engines, running the workload ...", flush=True)
        return asyncio.run(drive(address, workload, args, fingerprint))


# -- router overhead --------------------------------------------------------------------------------------


async def compare(
    engine_address: str, router_address: str, prompt: list[int], streams: int, tokens: int
) -> dict:
    """The same streams straight to the engine and through the router, alternating, 3 times each."""
    sampling = engine_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True)
    samples: dict[str, list[tuple[list[StreamTimes], float]]] = {"direct": [], "router": []}
    async with (
        grpc.aio.insecure_channel(engine_address) as engine_channel,
        grpc.aio.insecure_channel(router_address) as router_channel,
    ):
        links = {
            "direct": (engine_link(engine_channel), engine_pb2),
            "router": (router_link(router_channel), router_pb2),
        }
        for rep in range(3):
            for path, (link, pb2) in links.items():
                starts = [
                    pb2.GenerateStart(
                        request_id=f"{path}-{streams}-{rep}-{i}-{time.monotonic_ns()}",
                        prompt_token_ids=prompt,
                        sampling=sampling,
                    )
                    for i in range(streams)
                ]
                began = time.perf_counter()
                times = await asyncio.gather(*(timed_stream(link, start) for start in starts))
                samples[path].append((times, sum(t.tokens for t in times) / (time.perf_counter() - began)))
    row: dict[str, float] = {"streams": streams}
    for path, reps in samples.items():
        row[f"ttft_ms_{path}"] = 1000 * statistics.median(
            statistics.median(t.ttft_s for t in ts) for ts, _ in reps
        )
        gaps = [g for ts, _ in reps for t in ts for g in t.gaps_s]
        row[f"gap_p50_ms_{path}"] = 1000 * percentile(gaps, 0.5)
        row[f"gap_p99_ms_{path}"] = 1000 * percentile(gaps, 0.99)
        row[f"tok_s_{path}"] = statistics.median(rate for _, rate in reps)
    return row


def measure_overhead(tok: ChatTokenizer, args, run_dir: Path) -> list[dict]:
    """Paced like a real engine (50 tokens/s per stream), and unpaced (the relay's ceiling)."""
    rows = []
    prompt = tok.encode_chat([ChatMessage("user", "How fast is the router?")])
    for pace, streams in ((50, 1), (50, 64), (0, 1), (0, 16)):
        with Launcher(run_dir / f"overhead-{pace}-{streams}", echo=lambda line: None) as launcher:
            engine = engine_spec(0, "null", args, 1, null_tokens_per_s=pace)
            launcher.start(engine)
            router = launcher.start(router_spec([engine], "kv_aware"))
            address = f"127.0.0.1:{router.spec.ports[0]}"
            wait_for_engines(address, 1)
            row = asyncio.run(
                compare(f"127.0.0.1:{engine.ports[0]}", address, prompt, streams, args.overhead_tokens)
            )
            rows.append({"tokens_per_s_per_stream": pace, **row})
    return rows


# -- report -------------------------------------------------------------------------------------------------


@dataclass
class Summary:
    policy: str
    requests: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    output_tok_s: float
    requests_s: float
    prediction_exact: float
    failovers: int
    refusals: int
    per_engine: dict[str, int] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(policy: str, results: list[Result]) -> Summary:
    makespan = max(r.done_s for r in results) - min(r.sent_s for r in results)
    tpots = [(r.done_s - r.sent_s - r.ttft_s) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    per_engine: dict[str, int] = {}
    for r in results:
        per_engine[r.engine] = per_engine.get(r.engine, 0) + 1
    return Summary(
        policy=policy,
        requests=len(results),
        hit_rate=sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results),
        ttft_p50_s=percentile([r.ttft_s for r in results], 0.5),
        ttft_p90_s=percentile([r.ttft_s for r in results], 0.9),
        tpot_p50_s=statistics.median(tpots),
        output_tok_s=sum(r.output_tokens for r in results) / makespan,
        requests_s=len(results) / makespan,
        prediction_exact=sum(r.predicted_tokens == r.cached_tokens for r in results) / len(results),
        failovers=sum(r.attempts - 1 for r in results),
        refusals=sum(r.refusals for r in results),
        per_engine=dict(sorted(per_engine.items())),
    )


def print_table(summaries: dict[str, Summary]) -> None:
    base = summaries.get("round_robin")
    print(
        "\n| policy | prefix hit rate | TTFT p50 / p90 | TPOT p50 | output tok/s | requests/s | "
        "predicted = actual hit | requests per engine |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for s in summaries.values():
        print(
            f"| {s.policy} | {s.hit_rate:.1%} | {s.ttft_p50_s:.2f} / {s.ttft_p90_s:.2f} s | "
            f"{1000 * s.tpot_p50_s:.0f} ms | {s.output_tok_s:.1f} | {s.requests_s:.3f} | "
            f"{s.prediction_exact:.0%} | {' '.join(str(n) for n in s.per_engine.values())} |"
        )
    for s in summaries.values():
        if s.refusals:
            print(
                f"{s.policy}: {s.refusals} refusals (RESOURCE_EXHAUSTED), each turn sent again after its delay"
            )
    if base is not None and "kv_aware" in summaries:
        kv = summaries["kv_aware"]
        print(
            f"\nkv_aware vs round_robin: throughput {kv.output_tok_s / base.output_tok_s:.2f}x (target >= 2), "
            f"TTFT p90 {kv.ttft_p90_s / base.ttft_p90_s:.2f}x (target <= 0.3), "
            f"TTFT p50 {kv.ttft_p50_s / base.ttft_p50_s:.2f}x, requests/s {kv.requests_s / base.requests_s:.2f}x"
        )
        if "oracle" in summaries:
            oracle = summaries["oracle"]
            print(f"kv_aware hit rate / oracle's: {kv.hit_rate / oracle.hit_rate:.2f} (target >= 0.9)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["kv_aware", "round_robin", "random", "oracle"],
        help="router policies; kv_aware:W[:S] runs kv_aware with --overlap-weight W [--session-weight S]",
    )
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument(
        "--rate", type=float, default=0.25, help="conversations starting per second (Poisson)"
    )
    parser.add_argument(
        "--think-s", type=float, default=4.0, help="mean pause between an answer and the next turn"
    )
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--user-words", type=int, default=30)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument(
        "--kv-blocks", type=int, default=0, help="KV blocks per engine (0: the engine's default)"
    )
    parser.add_argument("--overhead-tokens", type=int, default=200, help="0: skip the overhead part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the raw results here")
    args = parser.parse_args()

    tok = load_tokenizer()
    check_turn_suffix(tok)
    workload = make_workload(tok, args)
    cores = len(os.sched_getaffinity(0))
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        "?",
    )
    print(
        f"machine: {cpu}, {cores} cores, load average {os.getloadavg()[0]:.1f} at start, Python {platform.python_version()}"
    )
    print(
        f"engines: {args.engines} x cpu backend, 1 compute thread each, engine i pinned to core i mod {cores} "
        f"({args.engines / cores:g} engines per core); router and client unpinned"
    )
    firsts = [len(c.first_prompt) for c in workload]
    print(
        f"workload: {len(workload)} conversations x {args.turns} turns, Poisson arrivals at {args.rate}/s, think time "
        f"~exp({args.think_s} s), {args.system_prompts} system prompts, first prompts {min(firsts)}-{max(firsts)} "
        f"tokens, +{args.user_words} words per user turn, {args.output_tokens} greedy output tokens per turn"
    )
    # Arrivals and think time alone take this long, however fast the answers: a run this close to it is
    # bounded by its users, not by its engines, and its throughput says little about placement.
    floor_s = max(c.start_s + sum(c.think_s) for c in workload) - min(c.start_s for c in workload)
    print(
        f"ceiling: the last chat's arrival and think time take {floor_s:.0f} s, so at most "
        f"{len(workload) * args.turns * args.output_tokens / floor_s:.0f} output tok/s (every answer instant)"
    )
    summaries, raw = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        for policy in args.policies:
            results = run_policy(policy, workload, args, tok.fingerprint, Path(tmp))
            summaries[policy] = summarize(policy, results)
            raw[policy] = [asdict(r) for r in results]
            s = summaries[policy]
            if len(summaries) == 1:  # greedy and ignore_eos: every policy sends the same prompts
                prompts = [r.prompt_tokens for r in results]
                last = [r.prompt_tokens for r in results if r.turn == args.turns - 1]
                print(
                    f"    prompts: {statistics.mean(prompts):,.0f} tokens on average, last turn "
                    f"{min(last, default=0):,}-{max(last, default=0):,}"
                )
            print(
                f"    hit {s.hit_rate:.1%}, TTFT p90 {s.ttft_p90_s:.2f} s, {s.output_tok_s:.1f} output tok/s",
                flush=True,
            )
        print_table(summaries)
        rows = measure_overhead(tok, args, Path(tmp)) if args.overhead_tokens else []
    if rows:
        print(
            f"\nrouter overhead: one null engine, {args.overhead_tokens} tokens per stream, direct vs through the router"
        )
        print(
            "| pace per stream | streams | TTFT p50 direct / router | frame gap p50 / p99 direct | router | tok/s direct / router |"
        )
        print("|---|---|---|---|---|---|")
        for row in rows:
            pace = f"{row['tokens_per_s_per_stream']} tok/s" if row["tokens_per_s_per_stream"] else "unpaced"
            print(
                f"| {pace} | {row['streams']} | {row['ttft_ms_direct']:.1f} / {row['ttft_ms_router']:.1f} ms | "
                f"{row['gap_p50_ms_direct']:.1f} / {row['gap_p99_ms_direct']:.1f} ms | "
                f"{row['gap_p50_ms_router']:.1f} / {row['gap_p99_ms_router']:.1f} ms | "
                f"{row['tok_s_direct']:,.0f} / {row['tok_s_router']:,.0f} |"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"summaries": {k: asdict(v) for k, v in summaries.items()}, "results": raw, "overhead": rows}
            )
        )


if __name__ == "__main__":
    main()
