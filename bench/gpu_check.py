"""The first GPU run of ``--backend cuda``: what scripts/gpu_check.sh runs on the GPU machine, step by step.

    python bench/gpu_check.py env      [--device cuda]   versions, the GPU, imports, one SDPA like the runner's
    python bench/gpu_check.py smoke    [--device cuda]   the runner on a random tiny LLaMA vs the reference
                                                         (no model file needed)
    python bench/gpu_check.py parity   [--device cuda]   the runner vs the reference forward in float32 and
                                                         bfloat16, then the runner's own step times
    python bench/gpu_check.py serve    [--device cuda]   GGUF → HF directory, ``python -m engine --backend cuda``
                                                         on it, real gRPC requests, then throughput

Each step merges what it measured into ``--json`` (results.json) and prints one line per check; a failed
check makes the step exit 1. ``--device cpu`` is the dry run on a machine without a GPU: the same code
with the runner on the CPU (the engine process then swaps ``create_cuda_runner`` for a CPU-placed
``CudaModelRunner``, ``engine-on-cpu`` below), smaller batches and fewer tokens.

Tolerances. float32: the tests' LOGIT_TOL (0.05) on every logit, greedy tokens equal except near-ties.
bfloat16 (the production dtype) has an 8-bit mantissa: weights, activations, K/V and the logits
themselves (the LM head runs in bfloat16, so a logit near 25 is rounded to a multiple of 0.125) carry
that rounding through 30 layers: on the CPU (torch 2.11, this script's dry run) the bfloat16 runner
differed from the float32 reference by up to 1.05 (0.75 on the reference's top 20 tokens) over these
prompts' 48 tokens and flipped one greedy token whose reference margin was 0.31. So its logits are
compared on the reference's top ``TOP_K`` tokens within ``BF16_TOL`` = 1.5, and a greedy token may
differ from the reference's only where the reference's margin is below it (the rule of the int8
kernels' tests, tests/engine/test_model_parity.py). A wrong rotation, mask or block gather moves logits
by several units and changes the answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chatmesh.model_files import bundled_model_path  # noqa: E402
from chatmesh.tokenizer import ChatMessage, load_tokenizer  # noqa: E402

BF16_TOL, TOP_K = 1.5, 20
SMOKE_F32_TOL, SMOKE_BF16_TOL = 1e-3, 0.25  # the tiny random model's logits are of order 1
NEW_TOKENS = 12
# Per device: (decode batches, decode context, timed steps, prefill chunk length, prefill chunks per step)
RUNNER_SHAPES = {"cuda": ((1, 32, 256), 128, 20, 1024, 8), "cpu": ((1, 4), 32, 3, 128, 2)}
# Per device: (decode streams, tokens per stream, prefill streams, prefill prompt tokens)
SERVE_LOAD = {"cuda": ((1, 32, 256), 128, 16, 1024), "cpu": ((1, 4), 8, 2, 64)}


def merge_results(path: Path, key: str, value: object) -> None:
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = value
    path.write_text(json.dumps(results, indent=1) + "\n")


class Checks:
    """Named pass/fail checks: each printed as it is decided; any failure fails the step."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, name: str, ok: bool, detail: object = "") -> bool:
        print(f"  [{'ok' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail != "" else ""), flush=True)
        if not ok:
            self.failed.append(name)
        return ok

    def attempt(self, name: str, fn, *args):
        """``fn(*args)``; an exception fails check ``name`` (traceback printed) and returns None, so the
        checks after it still run."""
        try:
            return fn(*args)
        except Exception as exc:
            traceback.print_exc()
            self(name, False, f"{type(exc).__name__}: {exc}")
            return None

    def exit_code(self) -> int:
        if self.failed:
            print(f"FAILED: {', '.join(self.failed)}", flush=True)
        return 1 if self.failed else 0


# -- env -----------------------------------------------------------------------------------------------


def run_env(args: argparse.Namespace) -> int:
    import importlib.metadata as metadata

    checks = Checks()
    versions = {"python": platform.python_version()}
    for dist in (
        "torch",
        "numpy",
        "grpcio",
        "protobuf",
        "tokenizers",
        "gguf",
        "safetensors",
        "pytest",
        "uvloop",
        "opentelemetry-sdk",
        "jinja2",
        "pyyaml",
        "wrapt",
    ):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    print(json.dumps(versions), flush=True)
    result: dict[str, object] = {"versions": versions}

    # What the engine, the converter and the tests import, with the wheels' versions (the generated
    # *_pb2 code checks protobuf's and grpcio's at import).
    import chatmesh.engine.v1.engine_pb2_grpc  # noqa: F401
    import engine.__main__
    import engine.model.convert_gguf_to_hf
    import engine.model.cuda_runner  # noqa: F401
    import tests.engine.service_client  # noqa: F401

    checks("the engine, converter and gRPC code import", True)
    import torch

    result["torch_cuda"] = torch.version.cuda
    if args.device == "cuda":
        if not checks("torch sees a CUDA device", torch.cuda.is_available()):
            merge_results(args.json, "env", result)
            return checks.exit_code()
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
        }
        print(json.dumps(result["gpu"]), flush=True)
    # The runner's attention call in its production shape: bfloat16, GQA (9 query heads over 3 KV
    # heads), a boolean mask, padded queries.
    q = torch.randn(4, 9, 5, 64, device=args.device, dtype=torch.bfloat16)
    k = torch.randn(4, 3, 48, 64, device=args.device, dtype=torch.bfloat16)
    mask = torch.ones(4, 1, 5, 48, dtype=torch.bool, device=args.device).tril(diagonal=43)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
    repeated = k.repeat_interleave(3, dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), repeated.float(), repeated.float(), attn_mask=mask
    )
    error = float((out.float() - expected).abs().max())
    checks(
        "bfloat16 SDPA with enable_gqa and a boolean mask matches float32",
        error < 0.05,
        f"max |Δ| {error:.4f}",
    )
    merge_results(args.json, "env", result)
    return checks.exit_code()


# -- smoke: the runner on a random tiny LLaMA (no model file: call 1 runs it) -------------------------------


def tiny_checkpoint(seed: int = 0):
    """Two layers of SmolLM2's attention shape (9 query heads over 3 KV heads of 64) with random float32
    weights, a 2,048-token vocabulary and a tied LM head; activations and logits of order 1."""
    from gguf import GGMLQuantizationType as QType

    from engine.model.checkpoint import LlamaCheckpoint, LlamaConfig, LlamaLayer, WeightMatrix

    cfg = LlamaConfig(
        name="tiny-random",
        num_layers=2,
        hidden_size=576,
        intermediate_size=1536,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=2048,
        context_length=2048,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    )
    rng = np.random.default_rng(seed)
    hidden, q_width, kv_width = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def matrix(name: str, rows: int, columns: int) -> WeightMatrix:
        values = (rng.standard_normal((rows, columns)) / np.sqrt(columns)).astype(np.float32)
        return WeightMatrix(name, QType.F32, (rows, columns), values)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    layers = [
        LlamaLayer(
            norm(),
            matrix("wq", q_width, hidden),
            matrix("wk", kv_width, hidden),
            matrix("wv", kv_width, hidden),
            matrix("wo", hidden, q_width),
            norm(),
            matrix("w_gate", cfg.intermediate_size, hidden),
            matrix("w_up", cfg.intermediate_size, hidden),
            matrix("w_down", hidden, cfg.intermediate_size),
        )
        for _ in range(cfg.num_layers)
    ]
    embedding = matrix("token_embd", cfg.vocab_size, hidden)
    return LlamaCheckpoint(cfg, embedding, layers, norm(), embedding)


def run_smoke(args: argparse.Namespace) -> int:
    from engine.model.cuda_runner import CudaModelRunner
    from tests.engine.paged_driver import PagedDriver
    from tests.engine.reference_model import ReferenceModel

    checks = Checks()
    checkpoint = tiny_checkpoint()
    reference = ReferenceModel(checkpoint)
    rng = np.random.default_rng(1)
    # Within one block, across blocks, and long enough for several; fed 7 tokens a step, then at once.
    prompts = [rng.integers(0, 2048, n).tolist() for n in (5, 16, 23, 70)]
    result: dict[str, object] = {}

    def one_dtype(dtype: str, tol: float) -> None:
        runner = CudaModelRunner(checkpoint, device=args.device, dtype=dtype)
        for chunk in (7, None):
            gens = PagedDriver(runner, num_blocks=32, shuffle_seed=3).generate(
                prompts, 8, prefill_chunk=chunk, keep_logits=True
            )
            measured = compare_with_reference(gens, reference, tol, None)
            result[f"{dtype}_prefill_{chunk or 'whole'}"] = measured
            checks(
                f"tiny random model, {dtype}, prefill {chunk or 'whole'}: runner vs reference",
                bool(measured["ok"]),
                {k: measured[k] for k in ("max_abs_logit_diff", "greedy_tokens_equal", "flips")},
            )
        runner.close()

    for dtype, tol in (("float32", SMOKE_F32_TOL), ("bfloat16", SMOKE_BF16_TOL)):
        checks.attempt(f"tiny random model, {dtype}", one_dtype, dtype, tol)
    merge_results(args.json, "smoke", result)
    return checks.exit_code()


# -- parity and the runner's step times ------------------------------------------------------------------


def compare_with_reference(gens, reference, tol: float, top_k: int | None) -> dict[str, object]:
    """Teacher-forced, as ``assert_greedy_matches_reference``, but measured instead of asserted."""
    max_all = max_top = 0.0
    tokens = same = 0
    flips, bad_flips = [], []
    for gen in gens:
        expected = reference.logits(gen.prompt + gen.tokens[:-1])[len(gen.prompt) - 1 :]
        for i, (token, ours, theirs) in enumerate(zip(gen.tokens, gen.logits, expected, strict=True)):
            top = np.argsort(-theirs)[:TOP_K]
            max_all = max(max_all, float(np.abs(ours - theirs).max()))
            max_top = max(max_top, float(np.abs(ours[top] - theirs[top]).max()))
            best = int(np.argmax(theirs))
            tokens, same = tokens + 1, same + (token == best)
            if token != best:
                margin = float(theirs[best] - theirs[token])
                flips.append({"token": i, "margin": round(margin, 4)})
                if margin >= tol:
                    bad_flips.append(flips[-1])
    compared = max_top if top_k else max_all
    return {
        "max_abs_logit_diff": float(f"{max_all:.3g}"),
        f"max_abs_logit_diff_top{TOP_K}": float(f"{max_top:.3g}"),
        "greedy_tokens_equal": f"{same}/{tokens}",
        "flips": flips[:8],  # the first ones; a broken forward flips most tokens
        "num_flips": len(flips),
        "tolerance": tol,
        "ok": compared <= tol and not bad_flips,
    }


def time_runner(runner, device: str) -> dict[str, object]:
    """Median step times of the runner alone: decode with B sequences of ``context`` cached tokens, and
    prefill of one and of several ``prefill_len``-token chunks in one step (each step ends with the logits
    on the host, as the engine needs them)."""
    from engine.model.runner import SequenceChunk

    batches, context, steps, prefill_len, prefill_chunks = RUNNER_SHAPES[device]
    block = 16
    per_seq = -(-(context + steps + 4) // block)
    num_blocks = max(max(batches) * per_seq, prefill_chunks * -(-prefill_len // block)) + 1
    runner.allocate_kv_cache(num_blocks, block)
    rng = np.random.default_rng(0)
    vocab = runner.config.vocab_size

    def table(seq: int, blocks: int) -> np.ndarray:
        return np.arange(seq * blocks, (seq + 1) * blocks, dtype=np.int32)

    def timed(chunks_of_step) -> float:
        began = time.perf_counter()
        runner.execute(chunks_of_step)
        return time.perf_counter() - began

    result: dict[str, object] = {"decode": {}, "prefill": {}}
    for batch in batches:
        tables = [table(s, per_seq) for s in range(batch)]
        for first in range(0, batch, 32):  # prefill the contexts, 32 sequences a step
            runner.execute(
                [
                    SequenceChunk(rng.integers(100, vocab, context, dtype=np.int32), 0, tables[s], True)
                    for s in range(first, min(batch, first + 32))
                ]
            )
        times = []
        for step in range(steps + 3):  # 3 warm-up steps
            position = context + step
            chunks = [
                SequenceChunk(rng.integers(100, vocab, 1, dtype=np.int32), position, tables[s], True)
                for s in range(batch)
            ]
            elapsed = timed(chunks)
            if step >= 3:
                times.append(elapsed)
        step_s = statistics.median(times)
        result["decode"][str(batch)] = {"step_ms": round(1000 * step_s, 2), "tok_s": round(batch / step_s)}
        print(
            f"  decode b={batch:<4} context {context}: {1000 * step_s:7.2f} ms/step, {batch / step_s:8.0f} tok/s",
            flush=True,
        )
    prefill_blocks = -(-prefill_len // block)
    for n in (1, prefill_chunks):
        chunks = [
            SequenceChunk(
                rng.integers(100, vocab, prefill_len, dtype=np.int32), 0, table(s, prefill_blocks), True
            )
            for s in range(n)
        ]
        times = [timed(chunks) for _ in range(4)][1:]
        step_s = statistics.median(times)
        tokens = n * prefill_len
        result["prefill"][f"{n}x{prefill_len}"] = {
            "step_ms": round(1000 * step_s, 2),
            "tok_s": round(tokens / step_s),
        }
        print(
            f"  prefill {n}x{prefill_len}: {1000 * step_s:8.2f} ms/step, {tokens / step_s:8.0f} tok/s",
            flush=True,
        )
    return result


def run_parity(args: argparse.Namespace) -> int:
    import torch

    from engine.model.cuda_runner import CudaModelRunner
    from engine.model.gguf_loader import load_gguf
    from tests.engine.paged_driver import PagedDriver
    from tests.engine.reference_model import ReferenceModel
    from tests.engine.service_client import capital_question
    from tests.engine.test_model_parity import CHATS, LOGIT_TOL

    checks = Checks()
    checkpoint = load_gguf(bundled_model_path())
    reference = ReferenceModel(checkpoint)
    tokenizer = load_tokenizer()
    prompts = [tokenizer.encode_chat([ChatMessage("user", text)]) for text in CHATS]
    prompts.append(capital_question(tokenizer))
    result: dict[str, object] = {}

    def one_dtype(dtype: str, tol: float, top_k: int | None) -> None:
        began = time.perf_counter()
        runner = CudaModelRunner(checkpoint, device=args.device, dtype=dtype)
        loaded_s = time.perf_counter() - began
        driver = PagedDriver(runner, num_blocks=64, shuffle_seed=1)
        gens = driver.generate(prompts, NEW_TOKENS, prefill_chunk=7, keep_logits=True)
        measured = compare_with_reference(gens, reference, tol, top_k)
        # The same prompts again in one-shot prefill on other blocks: the answer must not depend on the
        # chunking beyond rounding (greedy tokens compared; bfloat16 may flip a near-tie).
        again = PagedDriver(runner, num_blocks=64, shuffle_seed=2).generate(prompts, NEW_TOKENS)
        measured["same_tokens_one_shot_prefill"] = [
            a.tokens == b.tokens for a, b in zip(gens, again, strict=True)
        ]
        measured["answer"] = tokenizer.decode(gens[-1].tokens)
        measured["load_s"] = round(loaded_s, 2)
        result[dtype] = measured
        merge_results(args.json, "parity", result)  # as it goes: a time limit keeps what was measured
        checks(
            f"{dtype} runner vs the reference forward",
            bool(measured["ok"]),
            {
                k: measured[k]
                for k in (
                    "max_abs_logit_diff",
                    f"max_abs_logit_diff_top{TOP_K}",
                    "greedy_tokens_equal",
                    "flips",
                )
            },
        )
        print(
            f"    {dtype} answers {measured['answer']!r}; one-shot prefill gives the same tokens: "
            f"{measured['same_tokens_one_shot_prefill']}",
            flush=True,
        )
        if dtype == "bfloat16":
            print("  runner step times (bfloat16):", flush=True)
            result["runner_bfloat16"] = checks.attempt("runner step times", time_runner, runner, args.device)
            if args.device == "cuda":
                result["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        runner.close()

    for dtype, tol, top_k in (("float32", LOGIT_TOL, None), ("bfloat16", BF16_TOL, TOP_K)):
        checks.attempt(f"{dtype} runner vs the reference forward", one_dtype, dtype, tol, top_k)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    merge_results(args.json, "parity", result)
    return checks.exit_code()


# -- serve: the engine process over gRPC ------------------------------------------------------------------


async def functional_checks(address: str, tokenizer, checks: Checks, result: dict[str, object]) -> None:
    """Fills ``result`` as it goes, so a step stopped by its time limit still reports what it saw."""
    from chatmesh.engine.v1 import engine_pb2
    from tests.engine.service_client import (
        TIMEOUT_S,
        Stream,
        capital_question,
        engine_stub,
        start_frame,
        wait_until,
    )
    from tests.engine.test_model_parity import CHATS

    async with engine_stub(address) as stub:

        async def load() -> engine_pb2.EngineLoad:
            return (await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S)).load

        async def idle() -> bool:
            current = await load()
            return (
                current.running_requests == 0
                and current.waiting_requests == 0
                and current.kv_blocks_used == 0
            )

        info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT_S)
        result["model_info"] = {
            "model": info.model,
            "backend": info.backend,
            "block_size": info.block_size,
            "context_length": info.context_length,
            "kv_blocks_total": info.kv_blocks_total,
        }
        checks("GetModelInfo says backend cuda", info.backend == "cuda", result["model_info"])

        prompt = capital_question(tokenizer)
        first = await Stream.start(stub, start_frame("paris-1", prompt, max_tokens=32)).rest()
        result["answer"] = first.text
        checks("the capital question is answered with Paris", "Paris" in first.text, repr(first.text))
        checks("the text is the decoded tokens", first.text == tokenizer.decode(first.token_ids))
        second = await Stream.start(stub, start_frame("paris-2", prompt, max_tokens=32)).rest()
        cached, expected = (
            second.finished.usage.cached_prompt_tokens,
            (len(prompt) - 1) // info.block_size * info.block_size,
        )
        result["cached_prompt_tokens"] = {
            "second": cached,
            "expected": expected,
            "first": first.finished.usage.cached_prompt_tokens,
        }
        checks(
            "the repeated prompt is served from the prefix cache",
            cached == expected > 0,
            f"{cached} of {len(prompt)} prompt tokens",
        )
        result["same_answer_from_the_cache"] = second.text == first.text
        print(
            f"    the cached run answers the same: {second.text == first.text} ({second.text!r})", flush=True
        )

        start = start_frame("to-cancel", prompt, max_tokens=2000)
        start.sampling.ignore_eos = True
        stream = Stream.start(stub, start)
        await stream.read()  # accepted
        await stream.read()  # the first tokens: it runs and holds blocks
        used = (await load()).kv_blocks_used
        stream.send_cancel()
        outcome = await stream.rest()
        reason = engine_pb2.FinishReason.Name(outcome.finished.finish_reason)
        checks(
            "a cancel frame ends the request as CANCELLED",
            reason == "FINISH_REASON_CANCELLED",
            f"{reason} after {outcome.finished.usage.completion_tokens} tokens, {used} blocks held",
        )
        try:
            await wait_until(idle, timeout_s=10, what="the cancelled request's blocks back in the pool")
            checks("its blocks go back to the pool", True)
        except AssertionError as exc:
            checks("its blocks go back to the pool", False, exc)

        # A mixed batch: three chats at once, each also alone; the answers should read as answers.
        async def answer(request_id: str, text: str) -> str:
            chat = tokenizer.encode_chat([ChatMessage("user", text)])
            return (await Stream.start(stub, start_frame(request_id, chat, max_tokens=24)).rest()).text

        together = await asyncio.gather(*(answer(f"batch-{i}", text) for i, text in enumerate(CHATS)))
        alone = [await answer(f"alone-{i}", text) for i, text in enumerate(CHATS)]
        result["chats"] = [
            {"prompt": p, "batched": b, "alone": a} for p, b, a in zip(CHATS, together, alone, strict=True)
        ]
        for p, b, a in zip(CHATS, together, alone, strict=True):
            print(f"    {p!r} → {b!r}" + ("" if a == b else f" (alone: {a!r})"), flush=True)
        checks("every batched chat gets a non-empty answer", all(t.strip() for t in together))


async def throughput(address: str, tokenizer, device: str, result: dict[str, dict]) -> None:
    from bench.bench_engine_overhead import grpc_run, start_frame, timed_stream
    from bench.link_client import engine_link

    streams, tokens, prefill_streams, prefill_len = SERVE_LOAD[device]
    prompt = tokenizer.encode_chat([ChatMessage("user", "Write a long story about a fox and a dog.")])
    await grpc_run(address, prompt, 4, 8)  # warm-up
    result |= {"decode": {}, "prefill": {}}
    print(
        f"  decode: prompt {len(prompt)} tokens, {tokens} tokens per stream (ignore_eos), greedy", flush=True
    )
    for concurrency in streams:
        measured = await grpc_run(address, prompt, concurrency, tokens)
        result["decode"][str(concurrency)] = {k: round(v, 1) for k, v in measured.items()}
        print(
            f"  {concurrency:>4} streams: {measured['tok_s']:8.0f} tok/s, TTFT p50 {measured['ttft_p50_ms']:.1f} ms, "
            f"gap p50 {measured['gap_p50_ms']:.1f} ms, p99 {measured['gap_p99_ms']:.1f} ms",
            flush=True,
        )
    rng = np.random.default_rng(1)
    vocab = tokenizer.vocab_size
    async with grpc.aio.insecure_channel(address) as channel:
        link = engine_link(channel)
        for n in (1, prefill_streams):
            prompts = [rng.integers(100, vocab, prefill_len).tolist() for _ in range(n)]  # no shared prefix
            began = time.perf_counter()
            done = await asyncio.gather(
                *(
                    timed_stream(link, start_frame(f"prefill-{n}-{i}-{time.monotonic_ns()}", p, 1))
                    for i, p in enumerate(prompts)
                )
            )
            elapsed = time.perf_counter() - began
            result["prefill"][f"{n}x{prefill_len}"] = {
                "tok_s": round(n * prefill_len / elapsed),
                "ttft_p50_ms": round(1000 * statistics.median(d.ttft_s for d in done), 1),
            }
            print(
                f"  prefill {n}x{prefill_len} tokens, 1 new token each: {n * prefill_len / elapsed:8.0f} prompt tok/s, "
                f"TTFT p50 {1000 * statistics.median(d.ttft_s for d in done):.1f} ms",
                flush=True,
            )


def run_serve(args: argparse.Namespace) -> int:
    from engine.model.convert_gguf_to_hf import convert
    from meshkit.launcher import GrpcHealthy, Launcher, ServiceSpec, free_port

    checks = Checks()
    result: dict[str, object] = {}
    out_dir = args.json.parent
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        began = time.perf_counter()
        model_dir = convert(bundled_model_path(), Path(tmp) / "SmolLM2-135M-Instruct")
        result["convert_s"] = round(time.perf_counter() - began, 1)
        print(f"  converted the GGUF to {model_dir} in {result['convert_s']}s", flush=True)
        tokenizer = load_tokenizer(str(model_dir))
        port = free_port()
        flags = {
            "backend": "cuda",
            "model": model_dir,
            "port": port,
            "kv-memory-gib": args.kv_memory_gib,
            "max-running-requests": 256,
            "max-batched-tokens": 8192,
            "max-waiting-requests": 1024,
        }
        engine_args = [part for flag, value in flags.items() for part in (f"--{flag}", str(value))]
        if args.device == "cuda":
            argv = [sys.executable, "-m", "engine", *engine_args]
        else:
            argv = [sys.executable, str(Path(__file__).resolve()), "engine-on-cpu", *engine_args]
        # The engine's log lands in out_dir/engine/logs/engine.log (it comes back with the results).
        with Launcher(out_dir / "engine") as launcher:
            try:
                began = time.perf_counter()
                launcher.start(
                    ServiceSpec(
                        "engine",
                        argv,
                        ports=(port,),
                        ready=GrpcHealthy(port),
                        cwd=ROOT,
                        ready_timeout_s=args.ready_timeout_s,
                    )
                )
                result["engine_ready_s"] = round(time.perf_counter() - began, 1)
                address = f"127.0.0.1:{port}"
                checks.attempt(
                    "gRPC checks", asyncio.run, functional_checks(address, tokenizer, checks, result)
                )
                result["throughput"] = {}
                checks.attempt(
                    "throughput",
                    asyncio.run,
                    throughput(address, tokenizer, args.device, result["throughput"]),
                )
            finally:
                merge_results(args.json, "serve", result)
            running = launcher.running["engine"].process.poll() is None
            checks("the engine is still running after the load", running)
    return checks.exit_code()


def engine_on_cpu(argv: list[str]) -> None:
    """The dry run's engine: ``python -m engine --backend cuda`` with the runner placed on the CPU."""
    import engine.model.cuda_runner as cuda_runner
    from engine.__main__ import main

    def create_on_cpu(checkpoint, dtype: str = "bfloat16"):
        return cuda_runner.CudaModelRunner(checkpoint, device="cpu", dtype=dtype)

    cuda_runner.create_cuda_runner = create_on_cpu
    main(argv)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "engine-on-cpu":
        engine_on_cpu(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("step", choices=["env", "smoke", "parity", "serve"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", type=Path, default=ROOT / ".run" / "gpu-check" / "results.json")
    parser.add_argument(
        "--kv-memory-gib", type=float, help="the engine's KV pool (default 4 on cuda, 0.5 on cpu)"
    )
    parser.add_argument("--ready-timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    args.kv_memory_gib = args.kv_memory_gib or (4.0 if args.device == "cuda" else 0.5)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    # A timeout's SIGTERM unwinds (finally blocks write the results, the launcher stops the engine).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    steps = {"env": run_env, "smoke": run_smoke, "parity": run_parity, "serve": run_serve}
    sys.exit(steps[args.step](args))


if __name__ == "__main__":
    main()
