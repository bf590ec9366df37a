"""The CPU runner's kernel sets side by side on this machine: every set this CPU runs, each in a fresh
process, on the bundled GGUF (SmolLM2-135M-Instruct Q4_1), the runner-level workloads of
bench_engine.py (a 256-token prefill, greedy decode of 1, 8 and 32 streams, a follow-up turn's TTFT).

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_kernels.py [--reps 3]

Where bench_engine.py sets chatmesh against llama.cpp with the default kernels (which need AVX-512
VNNI), this one answers what a CPU without them gets: the native kernels' AVX2 build (the same
numbers as the AVX-512 build, batch-invariant) against the numpy fallback (not batch-invariant).
Repetitions alternate the sets; the table shows medians [low, high] and each set's ratio to numpy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_engine import THREADS, run_chatmesh, run_worker  # noqa: E402
from bench.machine import machine  # noqa: E402
from chatmesh.model_files import bundled_model_path  # noqa: E402

ROWS = (
    ("prefill, 256-token prompt (tok/s)", "prefill", 1.0),
    ("decode, 1 stream (tok/s)", "decode_b1", 1.0),
    ("decode, 8 streams (aggregate tok/s)", "decode_b8", 1.0),
    ("decode, 32 streams (aggregate tok/s)", "decode_b32", 1.0),
    ("TTFT, follow-up after a 1k-token history, cold (ms)", "ttft_cold_s", 1e3),
    ("TTFT, same, history cached (ms)", "ttft_cached_s", 1e3),
    ("peak RSS (MiB)", "peak_rss_mib", 1.0),
)


def runnable_sets() -> list[str]:
    """The kernel sets this CPU and build run, fastest first; numpy always."""
    from engine.model.kernels.native import NativeKernels, NativeUnavailable

    sets = []
    for name, q8 in (("native-int8", True), ("native", False)):
        try:
            NativeKernels(q8_activations=q8)
            sets.append(name)
        except NativeUnavailable as exc:
            print(f"{name}: not run here ({exc})")
    return [*sets, "numpy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import json

        print(json.dumps(run_chatmesh(args.worker)))
        return

    from engine.model.kernels.native import NativeUnavailable, cpu_isa

    print(f"machine: {machine()}")
    sets = runnable_sets()
    try:
        isa = f"the native kernels' {cpu_isa().name} build"
    except NativeUnavailable as exc:
        isa = f"no native build ({exc})"
    print(f"model: {bundled_model_path().name}; {THREADS} threads; {isa}")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sets}
    for rep in range(args.reps):
        for name in sets:
            print(f"  rep {rep + 1}/{args.reps}: {name} ...", flush=True)
            runs[name].append(run_worker(name, script=__file__))
    header = ["workload", *sets, *(f"{name} / numpy" for name in sets if name != "numpy")]
    print("| " + " | ".join(header) + " |")
    print("|---" + "|---:" * (len(header) - 1) + "|")
    for label, key, scale in ROWS:
        cells, medians = [], {}
        for name in sets:
            values = [run[key] * scale for run in runs[name]]
            medians[name] = statistics.median(values)
            cells.append(f"{medians[name]:,.1f} [{min(values):,.1f}, {max(values):,.1f}]")
        ratios = [f"{medians[name] / medians['numpy']:.2f}x" for name in sets if name != "numpy"]
        print("| " + " | ".join([label, *cells, *ratios]) + " |")


if __name__ == "__main__":
    main()
