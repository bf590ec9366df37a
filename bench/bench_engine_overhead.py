"""Engine overhead without a model: what the scheduler, KV bookkeeping, detokenizer and gRPC cost per token.

Starts ``python -m engine --backend null`` unpaced (every step is pure engine work), drives C concurrent
requests over gRPC, on one link (``meshkit.links``: one GenerateMany stream, as the router reaches an
engine), and reports aggregate output tokens/s, time to first token and the gap
between token frames; then times the engine core alone (no gRPC) stepping N running requests.
These numbers bound what the mesh can push through one engine process before any model compute.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_engine_overhead.py \
        [--concurrency 1 16 64 256] [--tokens 128] [--runs 3] [--null-tokens-per-s 0]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.link_client import batches, engine_link  # noqa: E402
from bench.machine import machine  # noqa: E402
from chatmesh.engine.v1 import engine_pb2  # noqa: E402
from chatmesh.tokenizer import ChatMessage, load_tokenizer  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model.loading import create_runner  # noqa: E402
from engine.request import EngineRequest, SamplingParams  # noqa: E402
from meshkit.launcher import GrpcHealthy, Launcher, ServiceSpec, free_port  # noqa: E402
from meshkit.links import Link  # noqa: E402

MAX_RUNNING = 512


@dataclass
class StreamTimes:
    ttft_s: float
    gaps_s: list[float]  # between token frames
    tokens: int


async def timed_stream(link: Link, start: Any, **fields: Any) -> StreamTimes:
    """One request on ``link`` (to an engine or a router: the frames have the same shape), timed at the
    client: a gap is the time between two takes that brought tokens (frames that arrived together, for
    a reader that fell behind, are one delivery). ``fields``: the start frame's others."""
    sent, last, gaps, tokens, first = time.perf_counter(), None, [], 0, None
    async for batch in batches(link, start, **fields):
        arrived = sum(len(frame.tokens.token_ids) for frame in batch if frame.WhichOneof("kind") == "tokens")
        if not arrived:
            continue
        now = time.perf_counter()
        if last is None:
            first = now - sent
        else:
            gaps.append(now - last)
        last, tokens = now, tokens + arrived
    return StreamTimes(first or 0.0, gaps, tokens)


def start_frame(request_id: str, prompt: list[int], tokens: int) -> engine_pb2.GenerateStart:
    sampling = engine_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True)
    return engine_pb2.GenerateStart(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)


async def grpc_run(address: str, prompt: list[int], concurrency: int, tokens: int) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        link = engine_link(channel)
        began = time.perf_counter()
        results = await asyncio.gather(
            *(
                timed_stream(link, start_frame(f"c{concurrency}-{i}-{time.monotonic_ns()}", prompt, tokens))
                for i in range(concurrency)
            )
        )
        elapsed = time.perf_counter() - began
    ttfts = sorted(r.ttft_s for r in results)
    gaps = sorted(g for r in results for g in r.gaps_s)
    total = sum(r.tokens for r in results)
    assert total == concurrency * tokens, f"expected {concurrency * tokens} tokens, got {total}"
    return {
        "tok_s": total / elapsed,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "gap_p50_ms": 1000 * statistics.median(gaps) if gaps else 0.0,
        "gap_p99_ms": 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0,
    }


def core_step_ms(prompt: list[int], running: int) -> float:
    """Median wall time of one engine step with ``running`` decoding requests, no gRPC."""
    tok = load_tokenizer()
    config = EngineConfig(
        backend="null",
        null_tokens_per_s=0,
        max_running_requests=max(running, 1),
        max_batched_tokens=max(8192, running),
        num_kv_blocks=running * 64,
    )
    engine = LLMEngine(config, create_runner("null", None, tok), tok)
    for i in range(running):
        engine.add_request(
            EngineRequest(f"r{i}", tuple(prompt), SamplingParams(max_tokens=900, ignore_eos=True))
        )
    engine.step()  # prefill
    times = []
    for _ in range(40):
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--null-tokens-per-s", type=float, default=0, help="pace the null runner (0: unpaced, pure overhead)"
    )
    args = parser.parse_args()

    print(f"machine: {machine()}")
    tok = load_tokenizer()
    prompt = tok.encode_chat([ChatMessage("user", "Write a long story about a fox and a dog.")])
    print(
        f"workload: prompt {len(prompt)} tokens, {args.tokens} output tokens per stream, greedy, null backend"
    )
    pace = (
        f"paced at {args.null_tokens_per_s:.0f} tokens/s per stream" if args.null_tokens_per_s else "unpaced"
    )
    print(f"medians of {args.runs} runs; the null runner is {pace}: every step is engine work only\n")

    port = free_port()
    with (
        tempfile.TemporaryDirectory() as run_dir,
        Launcher(Path(run_dir), echo=lambda line: None) as launcher,
    ):
        argv = [sys.executable, "-m", "engine", "--backend", "null", "--port", str(port)]
        argv += [
            "--null-tokens-per-s",
            str(args.null_tokens_per_s),
            "--max-running-requests",
            str(MAX_RUNNING),
        ]
        argv += [
            "--max-batched-tokens",
            "16384",
            "--max-waiting-requests",
            "4096",
            "--num-kv-blocks",
            "40000",
        ]
        print("starting the null engine ...", flush=True)
        launcher.start(ServiceSpec("engine", argv, ports=(port,), ready=GrpcHealthy(port), cwd=ROOT))
        asyncio.run(grpc_run(f"127.0.0.1:{port}", prompt, 4, 16))  # warm-up
        print(f"{'streams':>8} {'tok/s':>9} {'TTFT p50':>10} {'TTFT p99':>10} {'gap p50':>9} {'gap p99':>9}")
        for concurrency in args.concurrency:
            runs = [
                asyncio.run(grpc_run(f"127.0.0.1:{port}", prompt, concurrency, args.tokens))
                for _ in range(args.runs)
            ]
            m = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            print(
                f"{concurrency:>8} {m['tok_s']:>9.0f} {m['ttft_p50_ms']:>8.1f}ms {m['ttft_p99_ms']:>8.1f}ms "
                f"{m['gap_p50_ms']:>7.1f}ms {m['gap_p99_ms']:>7.1f}ms",
                flush=True,
            )

    print("\nengine core alone (no gRPC): one step with N running requests")
    print(f"{'running':>8} {'step':>9} {'tok/s':>9}")
    for running in args.concurrency:
        ms = statistics.median(core_step_ms(prompt, running) for _ in range(args.runs))
        print(f"{running:>8} {ms:>7.2f}ms {running / ms * 1000:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
