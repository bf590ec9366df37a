"""Placement at the seeds' scale, by simulation: the real router code over 1,000 simulated engines.

    flock /tmp/chatmesh-cpu.lock .venv/bin/python bench/bench_scale_sim.py [--quick] [--json out.json] [--plots docs]

``bench.sim`` drives the router's own ``Placer``, ``PrefixIndex`` and ``EngineState`` with simulated
users and engines (bench/sim/__init__.py). What it reports:

1. Decision cost vs engine count: µs per ``Placer.place`` call (real clock) at the seeds' per-engine
   rate (20 prompts/s an engine), for growing fleets.
2. The seeds' point (1,000 engines, 20k prompts/s at 1x, 60k at 3x): kv_aware and round_robin against
   the oracle (longest cached prefix, ignoring load): prefix hit rate, TTFT p50/p99 and shed rate by
   tier, open streams, requests lost, the index's memory and the KV event ingestion per router core.
3. Router replicas: several replicas each following every engine's events; their indexes agree, and
   the fan-out costs each replica the whole event stream.
4. TTFT vs load (kv_aware), for docs/benchmarks/scale_sim.md's plot.
5. What the simulation hands the router pre-computed: hashing a prompt's blocks (real clock).

Simulated time is short (16 s of arrivals: a 4.8 s ramp, figures from 7.2 s on, then the run drains), chats
join mid-conversation with their history cached on a random engine (a fleet already warm), and think
time is compressed to 2 s: see docs/benchmarks/scale_sim.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402
from bench.sim.costs import SEEDS_GPU  # noqa: E402
from bench.sim.setup import Setup  # noqa: E402
from bench.sim.simulation import Simulation  # noqa: E402
from bench.sim.workload import Workload  # noqa: E402
from chatmesh.block_hash import block_hashes  # noqa: E402

PER_ENGINE_PROMPTS_PER_S = 20.0  # the seeds: 20k prompts/s over 1,000 engines


def run(setup: Setup) -> dict:
    gc.collect()
    # The simulation's own millions of objects (chats, hash lists) would make the cyclic collector pause
    # inside timed router calls; nothing in it forms cycles that must be collected during a run.
    gc.disable()
    try:
        summary = Simulation(setup).run().summary()
    finally:
        gc.enable()
    print(
        f"  {setup.policy:<11} engines {setup.engines:>5} routers {setup.routers} load {setup.workload.load:g}x: "
        f"{summary['requests']:,} requests, {summary['wall_s']:.0f} s",
        flush=True,
    )
    return summary


def hashing_us(tokens: int, block_size: int) -> float:
    prompt = list(range(tokens))
    started = time.perf_counter()
    for _ in range(20):
        block_hashes(prompt, block_size)
    return (time.perf_counter() - started) / 20 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="100 engines, a few seconds each (CI-sized)")
    parser.add_argument(
        "--seconds", type=float, default=0, help="seconds of arrivals per run (default 8; quick 4)"
    )
    parser.add_argument("--fleets-only", action="store_true", help="only the decision cost vs engine count")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument(
        "--plots", type=Path, help="write decision-cost and TTFT-vs-load PNGs into this folder"
    )
    args = parser.parse_args()

    engines = 100 if args.quick else 1000
    seconds = args.seconds or (12.0 if args.quick else 16.0)
    fleets = (10, 30, 100) if args.quick else (10, 100, 300, 1000, 2000)
    loads = (0.5, 1.0, 2.0, 3.0)
    costs = SEEDS_GPU

    def setup(
        engine_count: int, policy: str = "kv_aware", load: float = 1.0, routers: int = 1, share: float = 1.0
    ) -> Setup:
        workload = Workload(
            peak_prompts_per_s=PER_ENGINE_PROMPTS_PER_S * engine_count,
            load=load,
            duration_s=seconds * share,
            ramp_s=0.3 * seconds * share,
        )
        return Setup(engines=engine_count, routers=routers, policy=policy, costs=costs, workload=workload)

    w = setup(engines).workload
    print(f"machine: {machine()}")
    print(
        f"workload: {w.peak_prompts_per_s:,.0f} prompts/s at 1x ({PER_ENGINE_PROMPTS_PER_S:g} an engine), "
        f"{seconds:g} s of arrivals (ramp {w.ramp_s:g} s), chats of 1-{w.max_turns} turns "
        f"(~{w.user_tokens} user + ~{w.answer_tokens} answer tokens a turn), think ~{w.think_s:g} s, "
        f"{w.system_prompts} shared system prompts of {w.system_tokens} tokens, window {w.context_window} "
        f"(then a {w.summary_tokens}-token summary), {w.paid_fraction:.0%} paid"
    )
    print(
        f"engine (assumed GPU class, bench/sim/costs.py): step {costs.fixed_ms} ms + {costs.per_sequence_ms} ms "
        f"a sequence + {costs.per_prefill_token_ms} ms a prefill token + {costs.per_context_token_ms * 1e6:g} ns "
        f"a context token; {costs.kv_blocks:,} KV blocks of {costs.block_size}; "
        f"{costs.max_running_requests} running, {costs.max_waiting_requests} waiting at most"
    )
    results: dict[str, list[dict]] = {"fleets": [], "seeds": [], "replicas": [], "loads": []}

    print("\n1. decision cost vs engine count (kv_aware, 1x)")
    for count in fleets:  # the fleet of the seeds' point runs in full below; the others for half as long
        results["fleets"].append(run(setup(count, share=1.0 if count == engines else 0.5)))
    if args.fleets_only:
        report_fleets(results)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return

    print("\n2. the seeds' point")
    for load in (1.0, 3.0):
        for policy in ("kv_aware", "oracle", "round_robin"):
            row = next(
                (
                    r
                    for r in results["fleets"]
                    if r["engines"] == engines and load == 1.0 and policy == "kv_aware"
                ),
                None,
            )
            results["seeds"].append(row or run(setup(engines, policy, load)))

    print("\n3. router replicas")
    replica_engines = engines // 10
    results["replicas"].append(run(setup(replica_engines, routers=3)))

    print("\n4. TTFT vs load (kv_aware)")
    for load in loads:
        row = next((r for r in results["seeds"] if r["load"] == load and r["policy"] == "kv_aware"), None)
        results["loads"].append(row or run(setup(engines, load=load)))

    hash_us = hashing_us(4096, costs.block_size)
    report(results, engines, hash_us, costs.kv_blocks, costs.block_size)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plots:
        plot(results, args.plots)


def report(results: dict, engines: int, hash_us: float, kv_blocks: int, block_size: int) -> None:
    report_fleets(results)
    report_seeds(results, engines, hash_us, kv_blocks, block_size)


def report_fleets(results: dict) -> None:
    print("\n## Decision cost vs engine count (µs per Placer.place, real clock)\n")
    print("| engines | prompts/s | decisions | p50 µs | p99 µs | mean µs | decisions/s per core |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results["fleets"]:
        print(
            f"| {r['engines']:,} | {PER_ENGINE_PROMPTS_PER_S * r['engines']:,.0f} | {r['requests']:,} | "
            f"{r['decision_us_p50']:.0f} | {r['decision_us_p99']:.0f} | {r['decision_us_mean']:.0f} | "
            f"{1e6 / r['decision_us_mean']:,.0f} |"
        )


def report_seeds(results: dict, engines: int, hash_us: float, kv_blocks: int, block_size: int) -> None:
    print(f"\n## The seeds' point: {engines:,} engines\n")
    print(
        "| load | policy | hit rate | vs oracle | TTFT free p50 / p99 s | TTFT paid p50 / p99 s | shed free | "
        "shed paid | peak streams | requests | lost |"
    )
    print("|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for r in results["seeds"]:
        oracle = next(
            (o for o in results["seeds"] if o["load"] == r["load"] and o["policy"] == "oracle"), None
        )
        versus = f"{r['hit_rate'] / oracle['hit_rate']:.2f}" if oracle else "-"
        print(
            f"| {r['load']:g}x | {r['policy']} | {r['hit_rate']:.1%} | {versus} | "
            f"{r['ttft_free_p50_s']:.3f} / {r['ttft_free_p99_s']:.3f} | "
            f"{r['ttft_paid_p50_s']:.3f} / {r['ttft_paid_p99_s']:.3f} | {r['shed_free']:.1%} | "
            f"{r['shed_paid']:.1%} | {r['peak_streams']:,} | {r['requests']:,} | {r['lost']} |"
        )

    main_row = next(r for r in results["seeds"] if r["load"] == 1.0 and r["policy"] == "kv_aware")
    per_block = main_row["index_bytes_per_block"]
    print("\n## Index and KV events (kv_aware, 1x)\n")
    print(
        f"- index: {main_row['index_mib']:,.0f} MiB for {main_row['indexed_blocks']:,} blocks when arrivals stopped "
        f"({per_block:.0f} bytes a block); full pools ({engines:,} x {kv_blocks:,} blocks of {block_size}) "
        f"would take {per_block * engines * kv_blocks / 2**30:.1f} GiB"
    )
    print(
        f"- KV events: {main_row['event_blocks_per_s']:,.0f} blocks/s published (simulated time); one router core "
        f"ingests {main_row['ingest_blocks_per_core_s']:,.0f} blocks/s, so following every engine costs each "
        f"replica {main_row['event_blocks_per_s'] / main_row['ingest_blocks_per_core_s']:.1%} of a core"
    )
    print(
        f"- router predicted the engine's actual cached prefix exactly for {main_row['predicted_exact']:.1%}"
    )
    print(f"- hashing one 4,096-token prompt into blocks of {block_size}: {hash_us:.0f} µs (real clock)")
    for r in results["replicas"]:
        print(
            f"- {r['routers']} replicas over {r['engines']} engines: indexes agree: {r['replicas_agree']}; "
            f"each ingested {r['event_blocks_per_s']:,.0f} blocks/s of events; decision p50 {r['decision_us_p50']:.0f} µs"
        )

    print("\n## TTFT vs load (kv_aware)\n")
    print(
        "| load | prompts/s | TTFT free p50 / p99 s | TTFT paid p50 / p99 s | shed free | shed paid | hit rate |"
    )
    print("|---|---:|---|---|---:|---:|---:|")
    for r in results["loads"]:
        print(
            f"| {r['load']:g}x | {PER_ENGINE_PROMPTS_PER_S * r['engines'] * r['load']:,.0f} | "
            f"{r['ttft_free_p50_s']:.3f} / {r['ttft_free_p99_s']:.3f} | "
            f"{r['ttft_paid_p50_s']:.3f} / {r['ttft_paid_p99_s']:.3f} | {r['shed_free']:.1%} | "
            f"{r['shed_paid']:.1%} | {r['hit_rate']:.1%} |"
        )


def plot(results: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fleets = results["fleets"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = [r["engines"] for r in fleets]
    ax.plot(x, [r["decision_us_p50"] for r in fleets], "o-", label="p50")
    ax.plot(x, [r["decision_us_p99"] for r in fleets], "s--", label="p99")
    ax.axhline(100, color="grey", linewidth=0.8, linestyle=":", label="goal: 100 µs")
    ax.set_xscale("log")
    ax.set_xlabel("engines (20 prompts/s each)")
    ax.set_ylabel("µs per placement decision")
    ax.set_title("Router decision cost vs fleet size (one core)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "sim_decision_cost.png", dpi=110)

    loads = results["loads"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = [r["load"] for r in loads]
    for tier, style in (("free", "o-"), ("paid", "s-")):
        ax.plot(x, [r[f"ttft_{tier}_p50_s"] for r in loads], style, label=f"{tier} p50")
        ax.plot(x, [r[f"ttft_{tier}_p99_s"] for r in loads], style.replace("-", "--"), label=f"{tier} p99")
    ax.set_yscale("log")
    ax.set_xlabel("load (x the seeds' 20k prompts/s peak)")
    ax.set_ylabel("simulated TTFT (s)")
    ax.set_title(f"TTFT vs load, {loads[0]['engines']:,} simulated engines, kv_aware")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "sim_ttft_vs_load.png", dpi=110)


if __name__ == "__main__":
    main()
