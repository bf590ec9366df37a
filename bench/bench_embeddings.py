"""all-MiniLM-L6-v2 embeddings side by side: chatmesh's encoder (engine/model/bert.py, native float32
GEMMs) against llama.cpp (llama-cpp-python) on a GGUF converted from the same safetensors
(bench/make_embedding_fixture.py's converter, float32), both on the same threads, tokenization included.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_embeddings.py [--reps 5]

Workloads: batch 1 (each of the 24 fixture sentences in a call of its own) and batch 32 (calls of 32
sentences cycled from the same set, 4-194 tokens each). Each system runs in a fresh process per
repetition (model load and a warm-up call not timed), the systems alternating, so a busy neighbour
hurts both alike; the last column is the median [range] of each repetition's own ratio. onnxruntime and sentence-transformers are not measured: sentence-transformers needs
torch, and neither ships an ONNX export of this model without it (docs/benchmarks/embeddings.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_engine import THREADS  # noqa: E402
from bench.machine import machine  # noqa: E402

SYSTEMS = ("chatmesh", "llama.cpp")
BATCH_32_CALLS = 4
ROUNDS = 3  # timed passes over each workload within one process; its best is taken


def sentences() -> list[str]:
    from bench.make_embedding_fixture import SENTENCES

    return SENTENCES


def workloads() -> dict[str, list[list[str]]]:
    texts = sentences()
    batch_32 = [[texts[(c * 32 + i) % len(texts)] for i in range(32)] for c in range(BATCH_32_CALLS)]
    return {"batch_1": [[t] for t in texts], "batch_32": batch_32}


def chatmesh_embedder():
    from chatmesh.model_files import minilm_model_path
    from engine.embeddings.tokenizer import EmbeddingTokenizer
    from engine.model.bert import BertEncoder, load_bert
    from engine.model.kernels import select_kernels
    from engine.model.kernels.blas import limit_blas_threads

    checkpoint = load_bert(minilm_model_path())
    encoder = BertEncoder(checkpoint, select_kernels(None, THREADS))
    if encoder.kernels.name != "numpy":  # as the embedding engine does (engine/embeddings/loading.py)
        limit_blas_threads(1)
    tokenizer = EmbeddingTokenizer(minilm_model_path(), checkpoint.config.max_tokens)
    return lambda texts: encoder.encode(tokenizer.encode_texts(texts))


def llamacpp_embedder(gguf: Path):
    from llama_cpp import LLAMA_POOLING_TYPE_MEAN, Llama

    llm = Llama(
        model_path=str(gguf),
        embedding=True,
        pooling_type=LLAMA_POOLING_TYPE_MEAN,
        n_ctx=8192,
        n_batch=8192,
        n_ubatch=8192,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        verbose=False,
    )
    return lambda texts: llm.embed(texts, normalize=True)


def worker(system: str, gguf: Path) -> dict[str, float]:
    embed = chatmesh_embedder() if system == "chatmesh" else llamacpp_embedder(gguf)
    results = {}
    for name, calls in workloads().items():
        embed(calls[0])  # warm-up
        best = float("inf")
        for _ in range(ROUNDS):
            started = time.perf_counter()
            for call in calls:
                embed(call)
            best = min(best, time.perf_counter() - started)
        results[name] = sum(len(c) for c in calls) / best  # sentences per second
    return results


def run_worker(system: str, gguf: Path) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", system, "--gguf", str(gguf)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{system} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--worker", choices=SYSTEMS)
    parser.add_argument("--gguf", type=Path)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.gguf)))
        return
    from bench.make_embedding_fixture import write_gguf
    from chatmesh.model_files import minilm_model_path

    print(machine())
    print(f"all-MiniLM-L6-v2, {THREADS} threads each, {args.reps} alternating repetitions, sentences/s")
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "minilm-f32.gguf"
        write_gguf(minilm_model_path(), gguf)
        runs: dict[str, list[dict[str, float]]] = {s: [] for s in SYSTEMS}
        for rep in range(args.reps):
            for system in SYSTEMS if rep % 2 == 0 else reversed(SYSTEMS):
                runs[system].append(run_worker(system, gguf))
    print(
        f"{'workload':<10} {'chatmesh':>22} {'llama.cpp':>22} {'ratio of medians':>17} {'paired ratios':>22}"
    )
    for name in workloads():
        cells, medians = [], []
        for system in SYSTEMS:
            values = [r[name] for r in runs[system]]
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:.0f} [{min(values):.0f}, {max(values):.0f}]")
        # Each repetition's two runs were neighbours in time: their ratio cancels most of a busy box.
        paired = [
            ours[name] / peer[name] for ours, peer in zip(runs["chatmesh"], runs["llama.cpp"], strict=True)
        ]
        spread = f"{statistics.median(paired):.2f}x [{min(paired):.2f}, {max(paired):.2f}]"
        print(f"{name:<10} {cells[0]:>22} {cells[1]:>22} {medians[0] / medians[1]:>16.2f}x {spread:>22}")


if __name__ == "__main__":
    main()
