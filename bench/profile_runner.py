"""Where a CPU runner step spends its time: each kernel call timed, per step, for a few workloads.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/profile_runner.py [--kernels native|native-int8|numpy] [--threads 2]
    [--model smollm2|gemma3]

"other" is everything outside the kernels: Python, batch assembly, KV writes, the embedding lookup.
Kernel calls can only be timed one by one in the runner's per-kernel loop, so the native kernels' layer
stack (all layers in one C call, bench_engine's configuration) is switched off here: "other" is larger
than in a real step by what the one-call stack saves. "lm_head" is the linear kernel's time on the LM head
(Gemma 3's tied 640 x 262,144 Q8_0 matrix: most of the bytes a one-stream step reads), "linear" the rest.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_engine import MODELS
from engine.model.cpu_runner import CpuModelRunner
from engine.model.gguf_loader import load_gguf
from engine.model.kernels import select_kernels
from engine.model.runner import SequenceChunk

KERNELS = ("linear", "attention", "rms_norm", "rope", "silu_mul", "gelu_mul")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default="native")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    args = parser.parse_args()
    checkpoint = load_gguf(MODELS[args.model]())
    kernels = select_kernels(args.kernels, args.threads, checkpoint.config)
    kernels.layer_stack = lambda *args: None  # the per-kernel loop, whose calls can be timed
    spent: collections.Counter[str] = collections.Counter()
    for name in KERNELS[1:]:
        setattr(kernels, name, _timed(getattr(kernels, name), name, spent))
    linear = kernels.linear
    runner = CpuModelRunner(checkpoint, kernels)

    def timed_linear(x: np.ndarray, packed: object) -> np.ndarray:
        start = time.perf_counter()
        try:
            return linear(x, packed)
        finally:
            spent["lm_head" if packed is runner._lm_head else "linear"] += time.perf_counter() - start

    kernels.linear = timed_linear
    runner.allocate_kv_cache(4096, 16)
    rng = np.random.default_rng(0)

    def table(seq: int) -> np.ndarray:
        return np.arange(seq * 80, seq * 80 + 80, dtype=np.int32)

    def profile(label: str, make_step, steps: int, tokens_per_step: int) -> None:
        make_step(-1)  # warm-up (and the prefill a decode workload starts from)
        totals = []
        spent.clear()
        for i in range(steps):
            start = time.perf_counter()
            runner.execute(make_step(i))
            totals.append(time.perf_counter() - start)
        step = statistics.median(totals)
        parts = {n: spent[n] / steps for n in ("lm_head", *KERNELS) if n in spent}
        parts["other"] = max(0.0, sum(totals) / steps - sum(parts.values()))
        shares = " ".join(f"{n} {v * 1e3:.2f} ({v / step:.0%})" for n, v in parts.items())
        print(f"{label:<28} {step * 1e3:8.2f} ms/step {tokens_per_step / step:7.1f} tok/s | {shares}")

    for batch, context in ((1, 64), (8, 200), (32, 300)):
        prompts = [rng.integers(100, 40000, context).astype(np.int32) for _ in range(batch)]

        def decode_step(i: int, batch=batch, context=context, prompts=prompts) -> list[SequenceChunk]:
            if i < 0:
                runner.execute([SequenceChunk(p, 0, table(s), True) for s, p in enumerate(prompts)])
                return []
            return [SequenceChunk(np.array([5], np.int32), context + i, table(s), True) for s in range(batch)]

        profile(f"decode b={batch} ctx={context}", decode_step, 8, batch)
    prompt = rng.integers(100, 40000, 256).astype(np.int32)
    profile("prefill 256 tokens", lambda i: [SequenceChunk(prompt, 0, table(40), True)], 3, 256)


def _timed(fn, name: str, spent: collections.Counter):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return wrapper


if __name__ == "__main__":
    main()
