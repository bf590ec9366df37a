"""Admission under overload: the router's wait rule against its count rule, in one run, on paced null
engines driven at a multiple of the mesh's capacity.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_admission.py \
        [--engines 2] [--running 8] [--answer-tokens 50] [--tokens-per-s 50] [--load 3] \
        [--duration-s 20] [--warmup-s 5] [--rules wait count] [--json out.json]

Capacity: each null engine runs ``--running`` requests at once, each ``--answer-tokens`` tokens at
``--tokens-per-s`` per stream, so the mesh finishes engines x running x tokens-per-s / answer-tokens
requests a second. Requests arrive as a Poisson process, at half that for ``--warmup-s`` and then at
``--load`` times it until ``--duration-s``, with tiers drawn 60 % free, 30 % pro, 10 % enterprise (one
seed: every rule sees the same arrivals). Each rule gets fresh engines and a fresh router
(``--admission RULE``); nothing retries.

The warm-up is there because the wait rule needs a drain rate: until an engine has finished two
requests the count rule alone admits to it, and a cold start straight into overload queues free
requests up to the free depth, where the paid tiers starve them until the engines' priority aging
(10 s) lifts them ahead of pro requests. ``--warmup-s 0`` shows that case.

Reported per rule and tier, for requests sent after the warm-up: requests, rejected share, TTFT p50 /
p99 of admitted requests against the tier's objective, and how long a rejection took (p50 / p99; goal
< 50 ms). Under the wait rule a request admitted on a wrong prediction is refused by its engine when its
objective runs out in the queue (after `routed`): those are counted apart ("refused late"), with the
time they took, and are not in the admitted TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_router import percentile, wait_for_engines  # noqa: E402
from bench.link_client import frames, router_link  # noqa: E402
from bench.machine import machine  # noqa: E402
from chatmesh.engine.v1 import engine_pb2  # noqa: E402
from chatmesh.errors import ServiceError  # noqa: E402
from chatmesh.router.v1 import router_pb2  # noqa: E402
from chatmesh.tiers import TIERS, TTFT_OBJECTIVES_S, tier_named  # noqa: E402
from meshkit.launcher import GrpcHealthy, Launcher, ServiceSpec, free_port  # noqa: E402
from meshkit.links import Link  # noqa: E402

TIER_MIX = {"free": 0.6, "pro": 0.3, "enterprise": 0.1}
WARMUP_LOAD = 0.5  # of capacity: every engine finishes requests, so the router knows its drain rate


@dataclass
class Sent:
    tier: str
    sent_s: float  # from the start of the drive
    admitted: bool
    seconds: float  # admitted: its TTFT; rejected: how long the rejection took
    code: str = "OK"
    retry_after_s: float | None = None
    late: bool = False  # rejected after it was routed: its engine dropped it from the queue


def capacity_per_s(args: argparse.Namespace) -> float:
    return args.engines * args.running * args.tokens_per_s / args.answer_tokens


def arrivals(args: argparse.Namespace) -> list[tuple[float, str]]:
    """(when, tier) of every request: half the capacity during the warm-up, then ``--load`` times it."""
    rng = random.Random(args.seed)
    clock, out = 0.0, []
    while True:
        load = WARMUP_LOAD if clock < args.warmup_s else args.load
        clock += rng.expovariate(load * capacity_per_s(args))
        if clock >= args.duration_s:
            return out
        out.append((clock, rng.choices(list(TIER_MIX), list(TIER_MIX.values()))[0]))


async def one_request(link: Link, serial: int, tier: str, sent_at: float, args) -> Sent:
    start = router_pb2.GenerateStart(
        request_id=f"adm-{serial}-{time.monotonic_ns()}",
        prompt_token_ids=[1, 2, 3, 10 + serial % 1000],
        sampling=engine_pb2.SamplingParams(max_tokens=args.answer_tokens, ignore_eos=True),
        tier=tier_named(tier).proto,
    )
    began, first, routed = time.perf_counter(), None, False
    try:
        async for frame in frames(link, start, timeout_ms=600_000):
            routed = routed or frame.WhichOneof("kind") == "routed"
            if first is None and frame.WhichOneof("kind") == "tokens":
                first = time.perf_counter()
    except ServiceError as error:
        took = time.perf_counter() - began
        return Sent(tier, sent_at, False, took, error.code.name, error.retry_after_s, late=routed)
    return Sent(tier, sent_at, True, (first or time.perf_counter()) - began)


async def drive(address: str, plan: list[tuple[float, str]], args) -> list[Sent]:
    async with grpc.aio.insecure_channel(address) as channel:
        link = router_link(channel)
        t0, calls = time.perf_counter(), []
        for serial, (at, tier) in enumerate(plan):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            calls.append(asyncio.create_task(one_request(link, serial, tier, at, args)))
        return list(await asyncio.gather(*calls))


def start_mesh(
    launcher: Launcher, count: int, engine_flags: list[str], rules: list[str], ready_s: float = 60
) -> dict[str, str]:
    """Starts ``count`` engines (``python -m engine`` with ``engine_flags``) and, for each of ``rules``,
    a router over all of them admitting by it; each rule's router address, once it sees every engine
    healthy."""
    engines = []
    for i in range(count):
        port = free_port()
        argv = [sys.executable, "-m", "engine", "--port", str(port), "--engine-id", f"e{i}", *engine_flags]
        ready = GrpcHealthy(port)
        spec = ServiceSpec(f"e{i}", argv, ports=(port,), ready=ready, cwd=ROOT, ready_timeout_s=ready_s)
        engines.append(launcher.start(spec))
    addresses = {}
    for rule in rules:
        port = free_port()
        argv = [sys.executable, "-m", "router", "--port", str(port), "--admission", rule]
        for engine in engines:
            argv += ["--engine", f"{engine.spec.name}=127.0.0.1:{engine.spec.ports[0]}"]
        ready = GrpcHealthy(port)
        launcher.start(ServiceSpec(f"router-{rule}", argv, ports=(port,), ready=ready, cwd=ROOT))
        addresses[rule] = f"127.0.0.1:{port}"
        wait_for_engines(addresses[rule], count)
    return addresses


def run_rule(rule: str, plan: list[tuple[float, str]], args, run_dir: Path) -> list[Sent]:
    with Launcher(run_dir / rule, echo=lambda line: None) as launcher:
        flags = ["--backend", "null", "--null-tokens-per-s", str(args.tokens_per_s)]
        flags += ["--max-running-requests", str(args.running)]
        address = start_mesh(launcher, args.engines, flags, [rule])[rule]
        print(f"  --admission {rule}: {len(plan)} requests over {args.duration_s:g} s ...", flush=True)
        return asyncio.run(drive(address, plan, args))


def summarize(rule: str, results: list[Sent], args) -> list[dict]:
    rows = []
    measured = [r for r in results if r.sent_s >= args.warmup_s]
    for tier in TIERS:
        mine = [r for r in measured if r.tier == tier]
        admitted = sorted(r.seconds for r in mine if r.admitted)
        rejected = sorted(r.seconds for r in mine if not r.admitted and not r.late)
        late = sorted(r.seconds for r in mine if r.late)
        codes = sorted({r.code for r in mine if not r.admitted})
        rows.append(
            {
                "rule": rule,
                "tier": tier,
                "requests": len(mine),
                "rejected": (len(rejected) + len(late)) / len(mine) if mine else 0.0,
                "rejected_late": len(late) / len(mine) if mine else 0.0,
                "late_p50_s": percentile(late, 0.5) if late else float("nan"),
                "codes": codes,
                "ttft_p50_s": percentile(admitted, 0.5) if admitted else float("nan"),
                "ttft_p99_s": percentile(admitted, 0.99) if admitted else float("nan"),
                "objective_s": TTFT_OBJECTIVES_S[tier],
                "reject_p50_ms": 1000 * percentile(rejected, 0.5) if rejected else float("nan"),
                "reject_p99_ms": 1000 * percentile(rejected, 0.99) if rejected else float("nan"),
                "admitted_per_s": len(admitted) / (args.duration_s - args.warmup_s),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        "\n| rule | tier | requests | rejected | of them late (p50) | TTFT p50 / p99 admitted | objective | "
        "p99 within | rejection p50 / p99 (at once) | admitted/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        within = "yes" if row["ttft_p99_s"] <= row["objective_s"] else "**no**"
        print(
            f"| {row['rule']} | {row['tier']} | {row['requests']} | {row['rejected']:.0%} | "
            f"{row['rejected_late']:.0%} ({row['late_p50_s']:.2f} s) | "
            f"{row['ttft_p50_s']:.2f} / {row['ttft_p99_s']:.2f} s | {row['objective_s']:g} s | {within} | "
            f"{row['reject_p50_ms']:.1f} / {row['reject_p99_ms']:.1f} ms | {row['admitted_per_s']:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--running", type=int, default=8, help="requests an engine runs at once")
    parser.add_argument("--answer-tokens", type=int, default=50)
    parser.add_argument("--tokens-per-s", type=float, default=50.0, help="null engines' pace per stream")
    parser.add_argument("--load", type=float, default=3.0, help="arrival rate, in multiples of capacity")
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument(
        "--warmup-s", type=float, default=5.0, help="half-capacity arrivals first, not in the figures"
    )
    parser.add_argument("--rules", nargs="+", default=["wait", "count"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the rows and every request here")
    args = parser.parse_args()

    plan = arrivals(args)
    print(f"machine: {machine()}")
    print(
        f"mesh: {args.engines} null engines x {args.running} running, {args.answer_tokens} tokens at "
        f"{args.tokens_per_s:g} tokens/s a stream: capacity {capacity_per_s(args):g} requests/s; "
        f"arrivals (Poisson) {WARMUP_LOAD:g}x for {args.warmup_s:g} s (warm-up, not in the figures), then "
        f"{args.load:g}x = {args.load * capacity_per_s(args):g}/s until {args.duration_s:g} s; "
        f"tiers {', '.join(f'{t} {share:.0%}' for t, share in TIER_MIX.items())}"
    )
    rows, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-admission-") as tmp:
        for rule in args.rules:
            results = run_rule(rule, plan, args, Path(tmp))
            rows += summarize(rule, results, args)
            raw[rule] = [asdict(r) for r in results]
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "requests": raw}))


if __name__ == "__main__":
    main()
