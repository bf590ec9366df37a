"""Admission under overload on real-model engines: multi-turn chats driven at 1x, 2x, 3x the mesh's
measured capacity, and what the admitted requests waited for their first token, per tier.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_admission_chat.py \
        [--engines 2] [--loads 1 2 3] [--duration-s 30] [--warmup-s 8] [--capacity-s 20] \
        [--rules wait] [--engine-flag=--threads=1 ...] [--json out.json]

The load is issue 54's: chats of a ~450-token system prompt shared by every chat, each turn resending
the whole history (the system prompt, every earlier question and answer) plus a new question of 20-60
tokens, answered in 64 tokens (``ignore_eos``). A chat has at most ``--turns`` turns, then a new chat
takes its place; a refused turn is dropped from its chat (its user would ask again later). Tiers are
drawn per chat, 60 % free, 30 % pro, 10 % enterprise (``bench_admission.TIER_MIX``).

One router over ``--engines`` real SmolLM2 engines (``--backend cpu``, one compute thread each by
default: two engines share a 2-core box), kept for the whole run so every phase finds the shared
system prompt cached. Per rule:

1. **Capacity**: ``--capacity-chats`` chats per engine, each sending its next turn as soon as the last
   ended (closed loop), for ``--capacity-s`` seconds after a warm-up of the same length, through a
   second router over the same engines admitting by the count rule (which refuses nothing here: the
   engines' throughput, not what a rule lets through); capacity is the requests finished per second.
2. **Each load** L of ``--loads``: Poisson arrivals at 0.5x capacity for ``--warmup-s`` (not in the
   figures: the router learns the engines' pace), then at L x capacity for ``--duration-s``; then the
   mesh drains before the next load.

Reported per load and tier, for requests sent after the warm-up: requests, refused share (of them,
refused late: by an engine's queue at the objective, after `routed`), admitted TTFT p50 / p90 / p99
against the tier's objective, and how long a refusal at once took (p50 / p99; goal < 50 ms). TTFT is
measured at the client, from sending the request to its first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_admission import TIER_MIX, WARMUP_LOAD, Sent, start_mesh  # noqa: E402
from bench.bench_router import percentile  # noqa: E402
from bench.link_client import frames, router_link  # noqa: E402
from bench.machine import machine  # noqa: E402
from chatmesh.engine.v1 import engine_pb2  # noqa: E402
from chatmesh.errors import ServiceError  # noqa: E402
from chatmesh.router.v1 import router_pb2  # noqa: E402
from chatmesh.tiers import TIERS, TTFT_OBJECTIVES_S, tier_named  # noqa: E402
from meshkit.launcher import Launcher  # noqa: E402
from meshkit.links import Link  # noqa: E402

SYSTEM_TOKENS = 450
QUESTION_TOKENS = (20, 60)
ANSWER_TOKENS = 64
VOCAB = (1_000, 40_000)  # token ids questions are drawn from (SmolLM2's vocabulary is 49,152)


@dataclass
class Chat:
    tier: str
    history: list[int]  # the system prompt, then every question and answer so far
    turns: int = 0
    busy: bool = False


@dataclass
class ChatLoad:
    """The chats of one phase, sharing one system prompt; turns are drawn from a seeded generator."""

    system: list[int]
    max_turns: int
    rng: random.Random
    chats: list[Chat] = field(default_factory=list)

    def question(self) -> list[int]:
        return [self.rng.randrange(*VOCAB) for _ in range(self.rng.randint(*QUESTION_TOKENS))]

    def idle_chat(self, tier: str | None = None) -> Chat:
        """A chat of ``tier`` (drawn by the mix when None) with no turn in flight, a new one if none."""
        tier = tier or self.rng.choices(list(TIER_MIX), list(TIER_MIX.values()))[0]
        idle = [c for c in self.chats if not c.busy and c.tier == tier and c.turns < self.max_turns]
        if idle:
            return self.rng.choice(idle)
        chat = Chat(tier, list(self.system))
        self.chats.append(chat)
        return chat


async def one_turn(link: Link, chat: Chat, load: ChatLoad, serial: int, sent_at: float) -> Sent:
    """Sends the chat's next turn (its history plus a new question); on an answer, both join it."""
    chat.busy = True
    question = load.question()
    start = router_pb2.GenerateStart(
        request_id=f"chat-{serial}-{time.monotonic_ns()}",
        prompt_token_ids=chat.history + question,
        sampling=engine_pb2.SamplingParams(max_tokens=ANSWER_TOKENS, ignore_eos=True, seed=serial),
        tier=tier_named(chat.tier).proto,
    )
    began, first, routed, answer = time.perf_counter(), None, False, []
    try:
        async for frame in frames(link, start, timeout_ms=600_000):
            kind = frame.WhichOneof("kind")
            routed = routed or kind == "routed"
            if kind == "tokens":
                first = first or time.perf_counter()
                answer += frame.tokens.token_ids
    except ServiceError as error:
        took = time.perf_counter() - began
        return Sent(chat.tier, sent_at, False, took, error.code.name, error.retry_after_s, late=routed)
    finally:
        chat.busy = False
    chat.history += question + answer
    chat.turns += 1
    return Sent(chat.tier, sent_at, True, (first or time.perf_counter()) - began)


async def measure_capacity(link: Link, load: ChatLoad, chats: int, seconds: float) -> float:
    """Requests finished per second by ``chats`` closed-loop enterprise chats, after as long a warm-up."""
    t0 = time.perf_counter()
    finished: list[float] = []

    async def loop(serial: int) -> None:
        while time.perf_counter() - t0 < 2 * seconds:
            chat = load.idle_chat("enterprise")
            sent = await one_turn(link, chat, load, serial, time.perf_counter() - t0)
            if sent.admitted:
                finished.append(time.perf_counter() - t0)
            else:
                await asyncio.sleep(sent.retry_after_s or 0.5)
            serial += 1_000

    await asyncio.gather(*(loop(i) for i in range(chats)))
    return sum(seconds <= at < 2 * seconds for at in finished) / seconds


async def drive_load(link: Link, load: ChatLoad, capacity: float, factor: float, args) -> list[Sent]:
    """Poisson arrivals: 0.5x ``capacity`` for the warm-up, then ``factor`` x it."""
    rng = random.Random(args.seed + int(10 * factor))
    t0, clock, calls, serial = time.perf_counter(), 0.0, [], 0
    end = args.warmup_s + args.duration_s
    while True:
        rate = (WARMUP_LOAD if clock < args.warmup_s else factor) * capacity
        clock += rng.expovariate(rate)
        if clock >= end:
            break
        await asyncio.sleep(max(0.0, t0 + clock - time.perf_counter()))
        serial += 1
        calls.append(asyncio.create_task(one_turn(link, load.idle_chat(), load, serial, clock)))
    return list(await asyncio.gather(*calls))


async def drive(address: str, capacity_address: str, args) -> dict:
    rng = random.Random(args.seed)
    system = [rng.randrange(*VOCAB) for _ in range(SYSTEM_TOKENS)]
    out: dict = {"loads": {}}
    chats = args.capacity_chats * args.engines
    async with grpc.aio.insecure_channel(capacity_address) as channel:
        link = router_link(channel)
        capacity = await measure_capacity(link, ChatLoad(system, args.turns, rng), chats, args.capacity_s)
    out["capacity_per_s"] = capacity
    print(f"    capacity: {capacity:.2f} requests/s ({chats} closed-loop chats)", flush=True)
    async with grpc.aio.insecure_channel(address) as channel:
        link = router_link(channel)
        for factor in args.loads:
            load = ChatLoad(system, args.turns, random.Random(args.seed + 1))
            print(f"    {factor:g}x = {factor * capacity:.2f} requests/s ...", flush=True)
            out["loads"][factor] = await drive_load(link, load, capacity, factor, args)
    return out


def run_rule(rule: str, args, run_dir: Path) -> dict:
    with Launcher(run_dir / rule, echo=lambda line: None) as launcher:
        flags = ["--backend", "cpu", *args.engine_flag]
        routers = start_mesh(launcher, args.engines, flags, sorted({rule, "count"}), 300)
        print(f"  --admission {rule}:", flush=True)
        return asyncio.run(drive(routers[rule], routers["count"], args))


def summarize(rule: str, factor: float, results: list[Sent], args) -> list[dict]:
    rows = []
    measured = [r for r in results if r.sent_s >= args.warmup_s]
    for tier in TIERS:
        mine = [r for r in measured if r.tier == tier]
        admitted = sorted(r.seconds for r in mine if r.admitted)
        at_once = sorted(r.seconds for r in mine if not r.admitted and not r.late)
        late = [r for r in mine if r.late]

        def q(values: list[float], at: float) -> float:
            return percentile(values, at) if values else float("nan")

        rows.append(
            {
                "rule": rule,
                "load": factor,
                "tier": tier,
                "requests": len(mine),
                "refused": (len(at_once) + len(late)) / len(mine) if mine else 0.0,
                "refused_late": len(late) / len(mine) if mine else 0.0,
                "ttft_p50_s": q(admitted, 0.5),
                "ttft_p90_s": q(admitted, 0.9),
                "ttft_p99_s": q(admitted, 0.99),
                "objective_s": TTFT_OBJECTIVES_S[tier],
                "refusal_p50_ms": 1000 * q(at_once, 0.5),
                "refusal_p99_ms": 1000 * q(at_once, 0.99),
                "admitted_per_s": len(admitted) / args.duration_s,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        "\n| rule | load | tier | requests | refused (late) | TTFT p50 / p90 / p99 admitted | objective | "
        "p99 within | refusal at once p50 / p99 | admitted/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        within = "yes" if not row["ttft_p99_s"] > row["objective_s"] else "**no**"
        print(
            f"| {row['rule']} | {row['load']:g}x | {row['tier']} | {row['requests']} | "
            f"{row['refused']:.0%} ({row['refused_late']:.0%}) | {row['ttft_p50_s']:.2f} / "
            f"{row['ttft_p90_s']:.2f} / {row['ttft_p99_s']:.2f} s | {row['objective_s']:g} s | {within} | "
            f"{row['refusal_p50_ms']:.1f} / {row['refusal_p99_ms']:.1f} ms | {row['admitted_per_s']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument(
        "--engine-flag",
        action="append",
        default=None,
        help="a flag for every engine, e.g. --engine-flag=--threads=1 (default: --threads=1)",
    )
    parser.add_argument("--loads", type=float, nargs="+", default=[1.0, 2.0, 3.0])
    parser.add_argument("--duration-s", type=float, default=30.0, help="each load's measured drive")
    parser.add_argument("--warmup-s", type=float, default=8.0, help="0.5x before each load, not reported")
    parser.add_argument("--capacity-s", type=float, default=20.0)
    parser.add_argument("--capacity-chats", type=int, default=8, help="closed-loop chats per engine")
    parser.add_argument("--turns", type=int, default=8, help="turns a chat has at most")
    parser.add_argument("--rules", nargs="+", default=["wait"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the rows and every request here")
    args = parser.parse_args()
    args.engine_flag = args.engine_flag or ["--threads=1"]

    print(f"machine: {machine()}")
    print(
        f"mesh: {args.engines} SmolLM2 cpu engines ({' '.join(args.engine_flag)}), one router; chats: "
        f"{SYSTEM_TOKENS}-token shared system prompt, questions of {QUESTION_TOKENS[0]}-{QUESTION_TOKENS[1]} "
        f"tokens, {ANSWER_TOKENS}-token answers, history resent, <= {args.turns} turns; tiers "
        f"{', '.join(f'{t} {share:.0%}' for t, share in TIER_MIX.items())}; loads "
        f"{', '.join(f'{f:g}x' for f in args.loads)} of the measured capacity, {args.duration_s:g} s each "
        f"after {args.warmup_s:g} s at {WARMUP_LOAD:g}x"
    )
    rows, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-admission-chat-") as tmp:
        for rule in args.rules:
            out = run_rule(rule, args, Path(tmp))
            raw[rule] = {"capacity_per_s": out["capacity_per_s"], "loads": {}}
            for factor, results in out["loads"].items():
                rows += summarize(rule, factor, results, args)
                raw[rule]["loads"][factor] = [asdict(r) for r in results]
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "requests": raw}))


if __name__ == "__main__":
    main()
