"""Tensor parallelism on the CPU runner: TP=1 (one process, 2 kernel threads) vs TP=2 (two rank processes,
1 kernel thread each), same GGUF, same box.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_tp.py [--reps 3] [--json out.json]

Each configuration runs in its own fresh process (its own thread pool; TP=2 spawns its second rank), TP=1
then TP=2, repeated --reps times; the table shows medians, best runs and TP=2/TP=1 ratios. Rows, at runner level
(``execute`` over a paged KV cache with scattered blocks, greedy argmax each step):
- prefill: one 256-token prompt, time to its logits;
- decode, 1 stream and 32 streams: aggregate tok/s (64-token prompts, 32 new tokens each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_engine import DECODE_NEW, DECODE_PROMPT, greedy_decode_rate, run_worker, text_tokens  # noqa: E402
from machine import machine  # noqa: E402

from chatmesh.model_files import bundled_model_path  # noqa: E402

PREFILL_TOKENS = 256  # decode: bench_engine's workload (64-token prompts, 32 new tokens)
STREAMS = (1, 32)
CONFIGS = {"tp1": (1, 2), "tp2": (2, 1)}  # name: (ranks, kernel threads per rank)


def run_config(name: str) -> dict[str, float]:
    from engine.model.cpu_runner import CpuModelRunner
    from engine.model.runner import SequenceChunk
    from engine.model.tp.runner import TensorParallelRunner

    ranks, threads = CONFIGS[name]
    path = bundled_model_path()
    if ranks == 1:
        runner = CpuModelRunner.from_gguf(path, num_threads=threads, kernels="native")
    else:
        runner = TensorParallelRunner(path, ranks, threads_per_rank=threads)
    num_blocks, bs = 512, 16
    runner.allocate_kv_cache(num_blocks, bs)
    order = np.random.default_rng(0).permutation(num_blocks).astype(np.int32)
    out: dict[str, float] = {}

    def table(first: int, n_tokens: int) -> np.ndarray:
        return order[np.arange(first, first + -(-n_tokens // bs))]

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    prompt = np.asarray(text_tokens(PREFILL_TOKENS), np.int32)
    prefill = [SequenceChunk(prompt, 0, table(400, PREFILL_TOKENS), True)]
    runner.execute(prefill)  # warm-up
    out["prefill"] = PREFILL_TOKENS / statistics.median(
        timed(lambda: runner.execute(prefill)) for _ in range(3)
    )

    def decode(streams: int) -> float:
        per_seq = -(-(DECODE_PROMPT + DECODE_NEW) // bs)
        return greedy_decode_rate(
            runner, [table(s * per_seq, DECODE_PROMPT + DECODE_NEW) for s in range(streams)]
        )

    decode(4)  # warm-up
    for streams in STREAMS:
        out[f"decode_b{streams}"] = decode(streams)
    runner.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the medians here")
    parser.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_config(args.worker)))
        return

    print(f"machine: {machine()}")
    print(
        f"model: {bundled_model_path().name}; TP=1: 1 process x 2 kernel threads; "
        "TP=2: 2 rank processes x 1 kernel thread"
    )
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    for rep in range(args.reps):
        for name in CONFIGS:
            print(f"  rep {rep + 1}/{args.reps}: {name} ...", flush=True)
            runs[name].append(run_worker(name, __file__))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    best = {n: {k: max(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    rows = [("prefill, 256-token prompt (tok/s)", "prefill")] + [
        (f"decode, {b} stream{'s' * (b > 1)} (aggregate tok/s)", f"decode_b{b}") for b in STREAMS
    ]
    # Best runs alongside medians: on a shared machine the best run is the one least disturbed.
    print(
        f"\n| {'workload':<38} | {'TP=1 median (best)':>18} | {'TP=2 median (best)':>18} | TP=2/TP=1 median (best) |"
    )
    print(f"|{'-' * 40}|{'-' * 20}|{'-' * 20}|-------------------------|")
    for label, key in rows:
        a, b = med["tp1"][key], med["tp2"][key]
        a_best, b_best = best["tp1"][key], best["tp2"][key]
        print(
            f"| {label:<38} | {a:9.1f} ({a_best:6.1f}) | {b:9.1f} ({b_best:6.1f}) |"
            f" {b / a:12.2f}x ({b_best / a_best:.2f}x) |"
        )
    print(f"\nmachine load average at the end: {machine().rsplit('load average', 1)[1]}")
    if args.json:
        args.json.write_text(
            json.dumps({"machine": machine(), "medians": med, "runs": runs}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
