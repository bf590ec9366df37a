"""Session hints vs a lagging KV-event index, by simulation: the real router code, side by side.

    .venv/bin/python bench/bench_session_hints.py [--engines 100] [--json out.json]

The router's index hears of a chat's blocks from KV events, after the engine stored them. A chat's next
turn that comes sooner finds the index without the last answer's blocks (or, past a whole turn, without
any of its own). The router's session hints (router/sessions.py) remember where each session last
finished and what that engine computed; placement credits it when the index predicts no better engine
(router/policy.py ``with_hint``). This runs the scale simulation (bench/sim, bench/bench_scale_sim.py:
the same workload and assumed GPU-class engines) with every KV event delivered ``lag`` seconds late, with
hints off and on, next to the lag-free references (kv_aware, and the oracle: the longest cached prefix,
ignoring load). It reports the prefix hit rate (against the oracle's), TTFT p50/p99 by tier, how often
the index's predicted cached prefix was the engine's exact one, and the share of placements a hint
changed; then three router replicas taking requests in turn (a replica holds only the hints of the
sessions it finished).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from bench_scale_sim import PER_ENGINE_PROMPTS_PER_S, run
from machine import machine

from bench.sim.costs import SEEDS_GPU
from bench.sim.setup import Setup
from bench.sim.workload import Workload

LAGS = (0.05, 0.5, 2.0)  # seconds: a quiet router's stream, a busy one's, a stalled one's
FAST_THINK_S = 0.25  # follow-ups that come right after the answer (regenerate, quick replies, agents)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, default=100, help="simulated engines (20 prompts/s each)")
    parser.add_argument("--seconds", type=float, default=12.0, help="seconds of arrivals per run")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    args = parser.parse_args()

    base = Setup(
        engines=args.engines,
        costs=SEEDS_GPU,
        workload=Workload(
            peak_prompts_per_s=PER_ENGINE_PROMPTS_PER_S * args.engines,
            duration_s=args.seconds,
            ramp_s=0.3 * args.seconds,
        ),
    )
    w = base.workload
    print(f"machine: {machine()}")
    print(
        f"{args.engines} engines, {w.peak_prompts_per_s:,.0f} prompts/s, {args.seconds:g} s of arrivals, "
        f"think ~{w.think_s:g} s (and ~{FAST_THINK_S:g} s), policy kv_aware unless said"
    )

    def setup(lag: float, hints: bool, think_s: float = w.think_s, **changes) -> Setup:
        workload = replace(w, think_s=think_s)
        return replace(
            base,
            workload=workload,
            event_lag_s=lag,
            session_hints=base.session_hints if hints else 0,
            **changes,
        )

    rows: list[dict] = []
    for think_s, lags in ((w.think_s, LAGS), (FAST_THINK_S, (0.5,))):
        print(f"\nthink ~{think_s:g} s")
        rows.append(run(setup(0.0, False, think_s, policy="oracle")))
        rows.append(run(setup(0.0, False, think_s)))
        for lag in lags:
            rows.append(run(setup(lag, False, think_s)))
            rows.append(run(setup(lag, True, think_s)))
    print("\n3 router replicas")
    for hints in (False, True):
        rows.append(run(setup(0.5, hints, routers=3)))
    report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def report(rows: list[dict]) -> None:
    print(
        "\n| think | routers | KV event lag | policy | hints | hit rate | vs oracle | TTFT free p50 / p99 s | "
        "TTFT paid p50 / p99 s | predicted exact | hinted | decision p50 µs |"
    )
    print("|---|---:|---:|---|---|---:|---:|---|---|---:|---:|---:|")
    for r in rows:
        oracle = next(o for o in rows if o["policy"] == "oracle" and o["think_s"] == r["think_s"])
        print(
            f"| {r['think_s']:g} s | {r['routers']} | {r['event_lag_s'] * 1000:,.0f} ms | {r['policy']} | "
            f"{'on' if r['session_hints'] else 'off'} | {r['hit_rate']:.1%} | "
            f"{r['hit_rate'] / oracle['hit_rate']:.3f} | "
            f"{r['ttft_free_p50_s']:.3f} / {r['ttft_free_p99_s']:.3f} | "
            f"{r['ttft_paid_p50_s']:.3f} / {r['ttft_paid_p99_s']:.3f} | {r['predicted_exact']:.1%} | "
            f"{r['hinted']:.1%} | {r['decision_us_p50']:.0f} |"
        )


if __name__ == "__main__":
    main()
