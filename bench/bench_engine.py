"""chatmesh's CPU engine vs llama.cpp, side by side: same GGUF, same box, same thread count.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_engine.py [--reps 3] [--json out.json]
    [--peer quoted|binding] [--model smollm2|gemma3] [--plot docs/engine_throughput.png]

Each engine runs in its own fresh process (its own thread pool, its own peak RSS), one after the other,
repeated --reps times; the table shows medians and chatmesh/llama.cpp ratios. chatmesh runs twice: its
default kernels ("native-int8": 8-bit activations, VNNI) and "native" (float32 activations, the reference
forward's numbers). llama.cpp runs twice too, both built by `make bench` from the same source: its own
native tools (llama-bench, llama-batched-bench: the strongest form of the peer) and llama-cpp-python
through its batch API; each ratio is against the stronger of the two on that row.
``--peer quoted``: without them, compare against llama.cpp's native tools as measured on this box in
issue 19 (``QUOTED_LLAMACPP``; those rows have no TTFT); ``--peer binding``: llama-cpp-python alone (where
the native tools are not built). ``--model gemma3``: Gemma 3 270M (its GGUF and tokenizer) instead of the
bundled SmolLM2 (issue 57 sets both models the same targets). Ratios show the median and, in brackets, the
range of the per-repetition ratios (a repetition runs every engine once, back to back, so its ratio
compares runs under similar load). Rows:
- prefill: one 256-token prompt, time to its logits;
- decode b=1, 8, 32: aggregate greedy decode tokens/s of b streams (64-token prompts, 32 new tokens each);
  llama-cpp-python through its batch API (one llama_decode per step over all streams), llama-batched-bench
  the same way in C++ (b=1 also llama-bench's 32 tokens from an empty context: the better of the two);
- TTFT of a follow-up turn whose 1,024-token history is already in the KV cache, vs the same prompt cold;
- paged vs dense: chatmesh's decode b=32 with scattered blocks vs each sequence's blocks contiguous
  (the memory layout of a dense padded cache), at the decode row's short contexts and at 1k-token
  contexts, where attention is a third of a step (timing only: KV values do not change a step's time,
  so those contexts are written with a constant, not prefilled);
- engine rows (when the engine core, engine/llm_engine.py, is present): the same TTFT through the
  engine's scheduler and prefix cache, and the cost of prefix caching at 0 % hits: b=32 requests with
  prefix caching on vs off, alternating, compared end to end (throughput) and by the host CPU time the
  engine spends per step outside the model (the only work prefix caching adds; CPU time of the step
  thread, which other processes on a shared machine do not inflate).
Greedy argmax over the logits is part of every decode step on both sides. Every ratio is in one table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402
from bench.plotting import pyplot  # noqa: E402
from chatmesh.model_files import bundled_model_path, gemma3_model_path  # noqa: E402
from chatmesh.tokenizer import ChatTokenizer, load_tokenizer  # noqa: E402

THREADS = int(os.environ.get("CHATMESH_BENCH_THREADS", "2"))  # each engine's compute threads
MODELS = {"smollm2": bundled_model_path, "gemma3": gemma3_model_path}
MODEL_ENV = "CHATMESH_BENCH_MODEL"  # how main tells its workers which model (--model)
PREFILL_TOKENS = 256
DECODE_PROMPT, DECODE_NEW = 64, 32
BATCHES = (1, 8, 32)
LONG_CONTEXT, LONG_STEPS, LONG_PAIRS = 1024, 4, 5  # paged vs dense at long contexts
HISTORY_TOKENS, FOLLOW_UP_TOKENS = 1024, 40
CORPUS = (
    "The history of computing is a story of people trying to make machines do arithmetic faster and more "
    "reliably than clerks could. Early mechanical calculators added and multiplied with gears; punched "
    "cards stored census data; vacuum tubes made electronic computers possible, and transistors made them "
    "small. Every generation of hardware changed what programmers thought was cheap: memory, then "
    "bandwidth, then energy. Today a laptop holds more memory than every computer of 1970 together, yet "
    "the same questions return: where does the data live, how far must it travel, and who waits for it? "
)


def model_path() -> Path:
    """The GGUF this run benchmarks (--model, passed to the workers through the environment)."""
    return MODELS[os.environ.get(MODEL_ENV, "smollm2")]()


def tokenizer() -> ChatTokenizer:
    return load_tokenizer(str(model_path()))


def text_tokens(n: int, salt: int = 0) -> list[int]:
    """n tokens of English text; different salts start at different words (distinct prompts)."""
    words = tokenizer().encode(CORPUS * (2 + n // 80))
    start = (salt * 37) % 200
    return [*words[start:], *words][:n]


def distinct_tokens(n: int, salt: int) -> list[int]:
    """n tokens whose first block no other salt shares (``text_tokens`` repeats one text, so two salts
    can start at the same word): the salt is written out first."""
    return (tokenizer().encode(f"Note {salt}:") + text_tokens(n, salt))[:n]


# -- chatmesh (runner level) ---------------------------------------------------------------------------


def run_chatmesh(kernels: str) -> dict[str, float]:
    from engine.model.cpu_runner import CpuModelRunner
    from engine.model.runner import SequenceChunk

    runner = CpuModelRunner.from_gguf(model_path(), num_threads=THREADS, kernels=kernels)
    # 8,192 positions of KV, the context llama.cpp is given below (both store float16).
    num_blocks, bs = 512, 16
    runner.allocate_kv_cache(num_blocks, bs)
    order = np.random.default_rng(0).permutation(num_blocks).astype(np.int32)
    out: dict[str, float] = {}

    def blocks(first: int, n_tokens: int, contiguous: bool = False) -> np.ndarray:
        """Blocks first.. of the pool, by default scattered through a fixed random permutation."""
        ids = np.arange(first, first + -(-n_tokens // bs), dtype=np.int32)
        return ids if contiguous else order[ids]

    def prefill(tokens: list[int], table: np.ndarray, start: int = 0, chunk: int = 512) -> np.ndarray:
        for lo in range(start, len(tokens), chunk):
            hi = min(len(tokens), lo + chunk)
            logits = runner.execute(
                [SequenceChunk(np.asarray(tokens[lo:hi], np.int32), lo, table, hi == len(tokens))]
            )
        return logits

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    prompt = text_tokens(PREFILL_TOKENS)
    prefill_blocks = blocks(400, PREFILL_TOKENS)
    prefill(prompt, prefill_blocks)  # warm-up
    out["prefill"] = PREFILL_TOKENS / statistics.median(
        timed(lambda: prefill(prompt, prefill_blocks)) for _ in range(3)
    )

    def decode(batch: int, contiguous: bool = False) -> float:
        per_seq = -(-(DECODE_PROMPT + DECODE_NEW) // bs)
        tables = [blocks(s * per_seq, DECODE_PROMPT + DECODE_NEW, contiguous) for s in range(batch)]
        return greedy_decode_rate(runner, tables)

    decode(4)  # warm-up
    for b in BATCHES[:-1]:
        out[f"decode_b{b}"] = decode(b)
    # paged (scattered blocks) and dense-layout (contiguous blocks) runs alternate, so drift in the
    # machine's load hits both alike
    b = BATCHES[-1]
    runs = [(decode(b), decode(b, contiguous=True)) for _ in range(3)]
    out[f"decode_b{b}"] = statistics.median(r[0] for r in runs)
    out[f"decode_b{b}_contiguous"] = statistics.median(r[1] for r in runs)
    out.update(sampler_cost(runner, blocks(0, DECODE_PROMPT + 1), b))

    history = text_tokens(HISTORY_TOKENS, salt=5)
    follow_up = history + text_tokens(FOLLOW_UP_TOKENS, salt=9)
    table = blocks(300, len(follow_up))
    colds, warms = [], []
    for _ in range(3):
        colds.append(timed(lambda: prefill(follow_up, table)))
        prefill(history, table)  # the earlier turn left its KV in these blocks
        warms.append(timed(lambda: prefill(follow_up, table, start=HISTORY_TOKENS)))
    out["ttft_cold_s"], out["ttft_cached_s"] = statistics.median(colds), statistics.median(warms)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # what one decode step reads from memory at least: every packed weight matrix once
    matrices = [
        packed_size(m) for layer in runner._layers for m in (layer.qkv, layer.wo, layer.gate_up, layer.down)
    ]
    lm_head = packed_size(runner._lm_head)
    out["weight_mib"] = sum(nbytes for nbytes, _ in [*matrices, lm_head]) / 2**20
    out["vocab_size"] = runner.config.vocab_size
    # and what it computes at least: a multiply and an add per weight (attention over these short
    # contexts adds under 1 %); a prompt token skips the LM head, which only the last one needs
    macs = sum(weights for _, weights in matrices)
    out["gflop_per_token"] = 2 * (macs + lm_head[1]) / 1e9
    out["gflop_per_prompt_token"] = 2 * macs / 1e9
    out.update(paged_vs_dense_long(runner))  # last: its larger pool must not count in the peak RSS
    return out


# The sampler's modes timed on a decode step's logits: what a request pays over the whole vocabulary.
SAMPLER_MODES = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top_p": {"temperature": 0.8, "top_p": 0.9},
    "top_k": {"temperature": 0.8, "top_k": 40},
}


def sampler_cost(runner, table: np.ndarray, streams: int) -> dict[str, float]:
    """Seconds the engine's sampler takes per step for ``streams`` rows of real logits (one stream's
    prompt, its next-token row repeated), per mode, median of 5."""
    from engine.model.runner import SequenceChunk
    from engine.request import SamplingParams
    from engine.sampler import sample

    prompt = np.asarray(text_tokens(DECODE_PROMPT), np.int32)
    row = runner.execute([SequenceChunk(prompt, 0, table, True)])[0]
    logits = np.ascontiguousarray(np.broadcast_to(row, (streams, len(row))))
    out = {}
    for mode, fields in SAMPLER_MODES.items():
        params = [SamplingParams(seed=s, **fields) for s in range(streams)]
        times = []
        for _ in range(5):
            start = time.perf_counter()
            sample(logits, params, [DECODE_PROMPT] * streams)
            times.append(time.perf_counter() - start)
        out[f"sampler_{mode}_s"] = statistics.median(times)
    return out


def packed_size(matrix) -> tuple[int, int]:
    """(bytes, weights) of a packed matrix: the native kernels' panels or numpy's float32 [in, out]."""
    if isinstance(matrix, np.ndarray):
        return matrix.nbytes, matrix.size
    return matrix.data.nbytes, matrix.out_features * matrix.in_features


def paged_vs_dense_long(runner) -> dict[str, float]:
    """Decode steps of 32 streams at 1k-token contexts, scattered vs contiguous blocks, alternating:
    process CPU seconds per step (median), which competing processes inflate less than wall time."""
    from engine.model.runner import SequenceChunk

    b, bs = BATCHES[-1], 16
    per_seq = -(-(LONG_CONTEXT + LONG_STEPS) // bs)
    runner.allocate_kv_cache(b * per_seq, bs)
    # Every block written, as a real 1k-token history leaves it: a pool never written is read through the
    # kernel's shared zero page, which moved the gap between the layouts (+16 % unwritten, +10 % written).
    for cache in (*runner._k_cache, *runner._v_cache):
        cache[...] = 0.01
    scattered = np.random.default_rng(1).permutation(b * per_seq).astype(np.int32).reshape(b, per_seq)
    contiguous = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)

    def step_cpu_s(tables: np.ndarray) -> float:
        start = time.process_time()
        for step in range(LONG_STEPS):
            runner.execute(
                [SequenceChunk(np.array([1], np.int32), LONG_CONTEXT + step, t, True) for t in tables]
            )
        return (time.process_time() - start) / LONG_STEPS

    step_cpu_s(contiguous)  # warm-up
    pairs = [(step_cpu_s(scattered), step_cpu_s(contiguous)) for _ in range(LONG_PAIRS)]
    return {
        "long_step_cpu_paged_s": statistics.median(p[0] for p in pairs),
        "long_step_cpu_dense_s": statistics.median(p[1] for p in pairs),
    }


def greedy_decode_rate(runner, tables: list[np.ndarray]) -> float:
    """Aggregate greedy decode tok/s of one stream per block table: each stream's DECODE_PROMPT-token
    prompt is prefilled (untimed), then DECODE_NEW steps decode every stream together."""
    from engine.model.runner import SequenceChunk

    prompts = [text_tokens(DECODE_PROMPT, salt=s) for s in range(len(tables))]
    logits = runner.execute(
        [SequenceChunk(np.asarray(p, np.int32), 0, t, True) for p, t in zip(prompts, tables, strict=True)]
    )
    next_tokens = logits.argmax(axis=1)
    start = time.perf_counter()
    for step in range(DECODE_NEW):
        chunks = [
            SequenceChunk(np.array([tok], np.int32), DECODE_PROMPT + step, table, True)
            for tok, table in zip(next_tokens, tables, strict=True)
        ]
        next_tokens = runner.execute(chunks).argmax(axis=1)
    return len(tables) * DECODE_NEW / (time.perf_counter() - start)


# -- llama.cpp through llama-cpp-python's low-level batch API ---------------------------------------------

_LLAMA_LOG_SILENT = None  # the log callback must outlive the context that calls it


def run_llamacpp() -> dict[str, float]:
    import llama_cpp as L

    global _LLAMA_LOG_SILENT
    _LLAMA_LOG_SILENT = L.llama_log_callback(lambda level, text, user_data: None)

    L.llama_backend_init()
    L.llama_log_set(_LLAMA_LOG_SILENT, None)
    model = L.llama_model_load_from_file(str(model_path()).encode(), L.llama_model_default_params())
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(2048, 0, 32)
    out: dict[str, float] = {}
    ctx = memory = None

    def open_context(streams: int) -> None:
        """8,192 positions of KV; with several streams, a separate range per stream (as llama-server's
        slots and llama-batched-bench use it), so a token attends only to its own stream's cells."""
        nonlocal ctx, memory
        if ctx is not None:
            L.llama_free(ctx)
        params = L.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 8192, 2048, 512
        params.n_seq_max, params.kv_unified = streams, False
        params.n_threads = params.n_threads_batch = THREADS
        ctx = L.llama_init_from_model(model, params)
        memory = L.llama_get_memory(ctx)

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """entries: (token, position, sequence, wants logits) → argmax of each row that wants logits."""
        for i, (tok, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(entries)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = [i for i, e in enumerate(entries) if e[3]]
        return [
            int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())
            for i in rows
        ]

    def prefill(tokens: list[int], seq: int = 0, start: int = 0) -> list[int]:
        return decode([(t, start + i, seq, i == len(tokens) - 1) for i, t in enumerate(tokens)])

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    open_context(1)
    prompt = text_tokens(PREFILL_TOKENS)

    def cold_prefill(tokens: list[int]) -> None:
        L.llama_memory_clear(memory, True)
        prefill(tokens)

    cold_prefill(prompt)  # warm-up
    out["prefill"] = PREFILL_TOKENS / statistics.median(timed(lambda: cold_prefill(prompt)) for _ in range(3))

    def decode_streams(b: int) -> float:
        L.llama_memory_clear(memory, True)
        prompts = [text_tokens(DECODE_PROMPT, salt=s) for s in range(b)]
        nxt = [prefill(p, seq=s)[0] for s, p in enumerate(prompts)]
        start = time.perf_counter()
        for step in range(DECODE_NEW):
            nxt = decode([(nxt[s], DECODE_PROMPT + step, s, True) for s in range(b)])
        return b * DECODE_NEW / (time.perf_counter() - start)

    out["decode_b1"] = decode_streams(1)
    open_context(max(BATCHES))
    decode_streams(4)  # warm-up
    for b in BATCHES[1:]:
        out[f"decode_b{b}"] = decode_streams(b)
    open_context(1)

    history = text_tokens(HISTORY_TOKENS, salt=5)
    follow_up = text_tokens(FOLLOW_UP_TOKENS, salt=9)
    colds, warms = [], []
    for _ in range(3):
        colds.append(timed(lambda: cold_prefill(history + follow_up)))
        cold_prefill(history)  # the earlier turn left its KV in sequence 0
        warms.append(timed(lambda: prefill(follow_up, start=HISTORY_TOKENS)))
    out["ttft_cold_s"], out["ttft_cached_s"] = statistics.median(colds), statistics.median(warms)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return out


# -- llama.cpp's own native tools, built from the same source as the binding (`make bench`) -------------

LLAMACPP_TOOLS = ROOT / ".cache" / "llama.cpp" / "bin"


def llamacpp_tools_available() -> bool:
    return all((LLAMACPP_TOOLS / tool).exists() for tool in ("llama-bench", "llama-batched-bench"))


def run_llamacpp_native() -> dict[str, float]:
    """llama-bench (prefill of one 256-token prompt; 32 generated tokens from an empty context) and
    llama-batched-bench (b streams, each a 64-token prompt then 32 generated tokens, one llama_decode per
    step): the same workloads as the other workers, measured by llama.cpp's own C++ drivers, each its
    own process. Peak RSS is the largest of those processes'."""
    model = str(model_path())

    def tool(name: str, *args: str) -> str:
        argv = [str(LLAMACPP_TOOLS / name), "-m", model, "-t", str(THREADS), *args]
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout

    def bench_rate(*args: str) -> float:
        [result] = json.loads(tool("llama-bench", "-r", "3", "-o", "json", *args))
        return float(result["avg_ts"])

    out = {
        "prefill": bench_rate("-p", str(PREFILL_TOKENS), "-n", "0"),
        "decode_b1_empty_context": bench_rate("-p", "0", "-n", str(DECODE_NEW)),
    }
    streams = ",".join(str(b) for b in BATCHES)
    batched = tool(
        "llama-batched-bench", "-c", "8192", "-npp", str(DECODE_PROMPT), "-ntg", str(DECODE_NEW),
        "-npl", streams, "--output-format", "jsonl",
    )  # fmt: skip
    for line in batched.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[f"decode_b{row['pl']}"] = float(row["speed_tg"])
    # The stronger of its two single-stream figures (llama-bench's starts from an empty context).
    out["decode_b1"] = max(out["decode_b1"], out["decode_b1_empty_context"])
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return out


# -- chatmesh through the engine core (scheduler, prefix cache) -----------------------------------------


def run_chatmesh_engine() -> dict[str, float]:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model.cpu_runner import CpuModelRunner
    from engine.request import EngineRequest, SamplingParams

    # the engine's default kernels
    runner = CpuModelRunner.from_gguf(model_path(), num_threads=THREADS, kernels="auto")
    engine_tokenizer = tokenizer()
    out: dict[str, float] = {}

    def make_engine(prefix_caching: bool):
        firsts: dict[str, float] = {}
        finished: set[str] = set()

        def on_outputs(outputs) -> None:
            now = time.perf_counter()
            for o in outputs:
                if o.token_ids:
                    firsts.setdefault(o.request_id, now)
                if o.finish is not None:
                    finished.add(o.request_id)

        config = EngineConfig(backend="cpu", num_threads=THREADS, enable_prefix_caching=prefix_caching)
        return LLMEngine(config, runner, engine_tokenizer, on_outputs=on_outputs), firsts, finished

    def run(engine, finished, requests) -> float:
        start = time.perf_counter()
        for r in requests:
            engine.add_request(r)
        while not {r.request_id for r in requests} <= finished:
            engine.step()
        return start

    def request(rid: str, prompt: list[int], max_tokens: int) -> EngineRequest:
        return EngineRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    engine, firsts, finished = make_engine(prefix_caching=True)
    colds, warms = [], []
    for rep in range(3):
        history = text_tokens(HISTORY_TOKENS, salt=20 + rep)
        follow_up = history + text_tokens(FOLLOW_UP_TOKENS, salt=9)
        start = run(engine, finished, [request(f"cold{rep}", follow_up, 1)])
        colds.append(firsts[f"cold{rep}"] - start)
        other = history + text_tokens(FOLLOW_UP_TOKENS, salt=11)  # same history, another follow-up
        start = run(engine, finished, [request(f"warm{rep}", other, 1)])
        warms.append(firsts[f"warm{rep}"] - start)
    out["engine_ttft_cold_s"], out["engine_ttft_cached_s"] = (
        statistics.median(colds),
        statistics.median(warms),
    )

    # Prefix caching at 0 % hits, on and off alternating. Its only work is host work (hashing blocks,
    # cache lookups and inserts, events), so besides end-to-end throughput each run measures the CPU
    # time of the step thread outside the model, per step; the model's own step (its CPU time on this
    # thread, which takes part in the kernels' pool) is the scale a cost is relative to.
    rates: dict[bool, list[float]] = {True: [], False: []}
    host_s: dict[bool, list[float]] = {True: [], False: []}
    model_s: list[float] = []
    for rep in range(3):
        for caching in (True, False) if rep % 2 else (False, True):
            engine, firsts, finished = make_engine(caching)
            prompts = [distinct_tokens(DECODE_PROMPT, 100 * rep + s) for s in range(32)]
            reqs = [request(f"r{rep}-{s}", p, DECODE_NEW) for s, p in enumerate(prompts)]
            timed_runner = _ThreadTimedRunner(runner)
            engine.runner = timed_runner
            start, steps, step_cpu = time.perf_counter(), 0, 0.0
            for r in reqs:
                engine.add_request(r)
            while not {r.request_id for r in reqs} <= finished:
                cpu = time.thread_time()
                engine.step()
                step_cpu += time.thread_time() - cpu
                steps += 1
            rates[caching].append(32 * DECODE_NEW / (time.perf_counter() - start))
            if engine.stats.prefix_hit_tokens:
                raise RuntimeError("the 0 %-hit workload hit the prefix cache")
            host_s[caching].append((step_cpu - timed_runner.thread_cpu_s) / steps)
            if not caching:
                model_s.append(timed_runner.thread_cpu_s / steps)
    out["engine_b32_prefix_on"] = statistics.median(rates[True])
    out["engine_b32_prefix_off"] = statistics.median(rates[False])
    costs = [
        (on - off) / (off + model)
        for on, off, model in zip(host_s[True], host_s[False], model_s, strict=True)
    ]
    out["engine_host_cost_min"], out["engine_host_cost_max"] = min(costs), max(costs)
    out["engine_host_cpu_on_s"] = statistics.median(host_s[True])
    out["engine_host_cpu_off_s"] = statistics.median(host_s[False])
    out["engine_model_cpu_s"] = statistics.median(model_s)
    out["engine_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


class _ThreadTimedRunner:
    """A runner whose ``execute`` also adds up the CPU time it takes on the calling (step) thread."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self.thread_cpu_s = 0.0

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def execute(self, chunks):
        start = time.thread_time()
        try:
            return self._runner.execute(chunks)
        finally:
            self.thread_cpu_s += time.thread_time() - start


def engine_core_available() -> bool:
    return (ROOT / "engine" / "llm_engine.py").exists()


# -- orchestration ----------------------------------------------------------------------------------------

WORKERS = {
    "chatmesh-int8": lambda: run_chatmesh("native-int8"),
    "chatmesh-float32": lambda: run_chatmesh("native"),
    "llama.cpp": run_llamacpp,
    "llama.cpp-native": run_llamacpp_native,
    "chatmesh-engine": run_chatmesh_engine,
}
# llama.cpp 0.3.36's own llama-bench -t 2 -p 256 -n 32 and llama-batched-bench -t 2 -npp 64 -ntg 32 on
# this box, same GGUF (issue 19; decode b=1 was 95-100 tok/s): the peer for --peer quoted, where neither
# the tools nor the binding are built.
QUOTED_LLAMACPP = {
    "prefill": 264.0,
    "decode_b1": 97.5,
    "decode_b8": 167.0,
    "decode_b32": 200.0,
    "peak_rss_mib": 391.0,
}


def run_worker(name: str, script: str = __file__) -> dict[str, float]:
    """Runs ``script --worker name`` in a fresh process; the JSON dict on its last output line."""
    proc = subprocess.run(
        [sys.executable, script, "--worker", name], capture_output=True, text=True, cwd=ROOT, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compute_roof() -> dict[str, float]:
    """This machine's float32 FMA and int8 VNNI peaks and its memory read bandwidth on THREADS threads,
    measured by compute_roof.c; empty if it cannot be built here."""
    with tempfile.TemporaryDirectory() as build:
        binary = Path(build) / "roof"
        flags = ["-O3", "-mavx512f", "-mavx512vnni", "-pthread"]
        try:
            subprocess.run(
                ["gcc", *flags, str(ROOT / "bench" / "compute_roof.c"), "-o", str(binary)], check=True
            )
            runs = [
                json.loads(subprocess.run([binary, str(THREADS)], capture_output=True, check=True).stdout)
                for _ in range(3)
            ]
            return {key: max(run[key] for run in runs) for key in runs[0]}  # a peak: the best of three
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"compute roof not measured: {exc}")
            return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the medians here")
    parser.add_argument(
        "--peer",
        choices=("measured", "quoted", "binding"),
        default="measured",
        help="llama.cpp's native tools and llama-cpp-python, run side by side (default; `make bench` builds "
        "both), the native tools' numbers quoted from issue 19 (SmolLM2's), or llama-cpp-python alone",
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="the GGUF to run")
    parser.add_argument("--plot", type=Path, help="also draw decode throughput vs batch size here (PNG)")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # its model comes from main, through the environment
        print(json.dumps(WORKERS[args.worker]()))
        return
    os.environ[MODEL_ENV] = args.model  # the workers inherit it

    print(f"machine: {machine()}")
    peers: list[str] = []
    if args.peer == "quoted" and args.model != "smollm2":
        sys.exit("issue 19's quoted figures are SmolLM2's: measure the peer for another model")
    if args.peer in ("measured", "binding"):
        try:
            import llama_cpp
        except ImportError:
            sys.exit("llama-cpp-python is missing: run `make bench`, or pass --peer quoted")
        if args.peer == "measured" and not llamacpp_tools_available():
            sys.exit(f"llama.cpp's native tools are missing from {LLAMACPP_TOOLS}: run `make bench`")
        peers = ["llama.cpp-native", "llama.cpp"] if args.peer == "measured" else ["llama.cpp"]
        print(
            f"model: {model_path().name}; {THREADS} threads each; llama.cpp {llama_cpp.__version__}: "
            + (
                "llama-bench and llama-batched-bench, and llama-cpp-python, built from the same source"
                if args.peer == "measured"
                else "llama-cpp-python alone"
            )
        )
    else:
        print(f"model: {model_path().name}; {THREADS} threads; llama.cpp: issue 19's native-tool figures")
    names = ["chatmesh-int8", "chatmesh-float32", *peers]
    # The engine rows measure the scheduler and the prefix cache, which do not depend on the model: SmolLM2's.
    names += ["chatmesh-engine"] if engine_core_available() and args.model == "smollm2" else []
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for rep in range(args.reps):
        for name in names:
            print(f"  rep {rep + 1}/{args.reps}: {name} ...", flush=True)
            runs[name].append(run_worker(name))
    if args.peer == "quoted":
        runs["llama.cpp-native"] = [QUOTED_LLAMACPP]
    print(f"load average after the runs: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print_table(runs, compute_roof())
    if args.plot:
        plot_throughput(runs, args.plot, quoted=args.peer == "quoted")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "runs": runs}, indent=1) + "\n")


def print_table(runs: dict[str, list[dict[str, float]]], roof: dict[str, float]) -> None:
    """One table: chatmesh's default kernels (native-int8) and its float32 ones against llama.cpp's
    native tools and its Python binding, ratios against the stronger of the two on each row (higher
    throughput, lower time and memory), then chatmesh's own ratios (cached vs cold, caching on vs off,
    paged vs dense) with their targets. Costs show the median over repetitions and, in brackets, their
    range."""
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    int8, float32 = med["chatmesh-int8"], med["chatmesh-float32"]
    native, binding = med.get("llama.cpp-native", {}), med.get("llama.cpp", {})
    rows: list[tuple[str, ...]] = []

    def versus(
        label: str, key: str, target: str = "", scale: float = 1.0, lower_is_better: bool = False
    ) -> None:
        """Both kernel sets against llama.cpp's stronger form on one workload; the target applies to the
        default kernels (native-int8)."""
        q, a = int8[key] * scale, float32[key] * scale
        figures = [peer[key] * scale for peer in (native, binding) if key in peer]
        shown = [f"{peer[key] * scale:.1f}" if key in peer else "-" for peer in (native, binding)]
        if not figures:
            rows.append((label, f"{q:.1f}", f"{a:.1f}", *shown, "", "", ""))
            return
        b = min(figures) if lower_is_better else max(figures)
        met = _met(q / b >= float(target[2:-1])) if target else ""
        # per repetition, the default kernels against the same peer's run of that repetition
        peer = "llama.cpp-native" if key in native and native[key] * scale == b else "llama.cpp"
        peer_reps = [r[key] for r in runs[peer]]
        peer_reps = peer_reps * len(runs["chatmesh-int8"]) if len(peer_reps) == 1 else peer_reps
        ratios = [r[key] / p for r, p in zip(runs["chatmesh-int8"], peer_reps, strict=True)]
        rows.append(
            (
                label,
                f"{q:.1f}",
                f"{a:.1f}",
                *shown,
                f"{q / b:.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]",
                f"{a / b:.2f}x",
                f"{target} {met}".strip(),
            )
        )

    def own(label: str, values: list[float], peer_value: str, target: float, unit: str) -> None:
        """A chatmesh-only figure (per repetition), checked against ``target`` (at most)."""
        mid = statistics.median(values)
        shown = f"{mid:+.1%}" if unit == "%" else f"{mid:.3f}"
        spread = f" [{min(values):+.1%}, {max(values):+.1%}]" if unit == "%" else ""
        limit = f"{target:.0%}" if unit == "%" else f"{target}"
        rows.append((label, "", "", "", peer_value, shown + spread, "", f"≤ {limit} {_met(mid <= target)}"))

    versus("prefill, 256-token prompt (tok/s)", "prefill", "≥ 4x")
    for b, target in zip(BATCHES, ("≥ 1.2x", "", "≥ 4x"), strict=True):
        versus(f"decode, {b} stream{'s' * (b > 1)} (aggregate tok/s)", f"decode_b{b}", target)
    versus(
        "TTFT, follow-up after a 1k-token history, cold (ms)", "ttft_cold_s", scale=1e3, lower_is_better=True
    )
    versus("TTFT, same, history cached (ms)", "ttft_cached_s", scale=1e3, lower_is_better=True)
    versus("peak RSS (MiB)", "peak_rss_mib", lower_is_better=True)

    cm = runs["chatmesh-int8"]
    peer_ratio = (
        f"{binding['ttft_cached_s'] / binding['ttft_cold_s']:.3f}" if "ttft_cold_s" in binding else ""
    )
    own(
        "TTFT cached / cold, runner",
        [r["ttft_cached_s"] / r["ttft_cold_s"] for r in cm],
        peer_ratio,
        0.1,
        "x",
    )
    own(
        "paged vs dense, 32 streams, 96-token contexts (tok/s)",
        [1 - r["decode_b32"] / r["decode_b32_contiguous"] for r in cm],
        "",
        0.05,
        "%",
    )
    own(
        "paged vs dense, 32 streams, 1k-token contexts (CPU/step)",
        [r["long_step_cpu_paged_s"] / r["long_step_cpu_dense_s"] - 1 for r in cm],
        "",
        0.05,
        "%",
    )
    if "chatmesh-engine" in runs:
        en = runs["chatmesh-engine"]
        own(
            "TTFT cached / cold, through the engine core",
            [r["engine_ttft_cached_s"] / r["engine_ttft_cold_s"] for r in en],
            "",
            0.1,
            "x",
        )
        own(
            "prefix caching at 0 % hits, end to end (tok/s)",
            [1 - r["engine_b32_prefix_on"] / r["engine_b32_prefix_off"] for r in en],
            "",
            0.01,
            "%",
        )
        own(
            "prefix caching at 0 % hits, host CPU per step",
            [
                (r["engine_host_cpu_on_s"] - r["engine_host_cpu_off_s"])
                / (r["engine_host_cpu_off_s"] + r["engine_model_cpu_s"])
                for r in en
            ],
            "",
            0.01,
            "%",
        )
    width = max(len(r[0]) for r in rows)
    print(
        f"\n| {'workload':<{width}} | chatmesh (native-int8, default) | chatmesh (native, float32) | "
        "llama.cpp native tools | llama-cpp-python | ratio | ratio float32 | target |"
    )
    print(f"|{'-' * (width + 2)}|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        print(f"| {row[0]:<{width}} | " + " | ".join(row[1:]) + " |")
    if "chatmesh-engine" in runs:
        e = med["chatmesh-engine"]
        print(
            f"\nengine core: TTFT cold {e['engine_ttft_cold_s'] * 1e3:.0f} ms, cached history "
            f"{e['engine_ttft_cached_s'] * 1e3:.0f} ms; b=32 with prefix caching on {e['engine_b32_prefix_on']:.1f} "
            f"vs off {e['engine_b32_prefix_off']:.1f} tok/s; host CPU per step on "
            f"{e['engine_host_cpu_on_s'] * 1e3:.2f} ms vs off {e['engine_host_cpu_off_s'] * 1e3:.2f} ms, model "
            f"{e['engine_model_cpu_s'] * 1e3:.1f} ms (step-thread CPU); host-CPU cost per on/off pair from "
            f"{min(r['engine_host_cost_min'] for r in runs['chatmesh-engine']):+.2%} to "
            f"{max(r['engine_host_cost_max'] for r in runs['chatmesh-engine']):+.2%}; "
            f"peak RSS {e['engine_peak_rss_mib']:.0f} MiB"
        )
    elif not engine_core_available():
        print(
            "\nengine rows: the engine core (engine/llm_engine.py) is not in this tree; they run once it is"
        )
    print(
        f"1k-token contexts: {int8['long_step_cpu_paged_s'] * 1e3:.0f} ms CPU per step scattered vs "
        f"{int8['long_step_cpu_dense_s'] * 1e3:.0f} ms contiguous"
    )
    if roof:
        print(
            f"compute roof, {THREADS} threads (bench/compute_roof.c): float32 FMA {roof['float32_gflops']:.0f} "
            f"GFLOP/s, int8 VNNI {roof['int8_gops']:.0f} GOP/s"
        )
    if "sampler_greedy_s" in int8:
        b = BATCHES[-1]
        costs = ", ".join(f"{mode} {int8[f'sampler_{mode}_s'] * 1e3:.1f} ms" for mode in SAMPLER_MODES)
        print(
            f"sampler, {b} rows of {int8['vocab_size']:.0f}-token logits per step: {costs} "
            f"(a decode b={b} step: {b / int8[f'decode_b{b}'] * 1e3:.0f} ms)"
        )
    if roof:
        theirs = model_tensor_mib()
        print(
            f"memory roof: {roof['read_gbps']:.1f} GB/s read ({THREADS} threads, best of 10 passes): a one-stream "
            f"step reads every weight once, so decode b=1 is at most {roof_tok_s(roof, int8['weight_mib']):.0f} "
            f"tok/s over chatmesh's {int8['weight_mib']:.0f} MiB (measured: "
            f"{int8['decode_b1'] / roof_tok_s(roof, int8['weight_mib']):.0%} of it) and "
            f"{roof_tok_s(roof, theirs):.0f} tok/s over the file's {theirs:.0f} MiB (llama.cpp's)"
        )
    for name, m, peak in (
        ("native-int8", int8, roof.get("int8_gops")),
        ("native", float32, roof.get("float32_gflops")),
    ):
        b = BATCHES[-1]
        decode, prefill = m["gflop_per_token"] * m[f"decode_b{b}"], m["gflop_per_prompt_token"] * m["prefill"]
        share = f" ({decode / peak:.0%} and {prefill / peak:.0%} of its roof)" if peak else ""
        print(
            f"{name}: decode b=1 reads {m['weight_mib']:.0f} MiB of weights per token: "
            f"{m['weight_mib'] * 2**20 * m['decode_b1'] / 1e9:.1f} GB/s; decode b={b} computes "
            f"{decode:.0f} GOP/s, prefill {prefill:.0f} GOP/s{share}"
        )


def model_tensor_mib() -> float:
    """MiB of the GGUF's tensors: what llama.cpp reads per one-stream decode step, the tied head included."""
    from engine.model.gguf_loader import read_gguf

    _, tensors = read_gguf(model_path())
    return sum(data.nbytes for _, _, data in tensors.values()) / 2**20


def roof_tok_s(roof: dict[str, float], weight_mib: float) -> float:
    return roof["read_gbps"] * 1e9 / (weight_mib * 2**20)


def plot_throughput(runs: dict[str, list[dict[str, float]]], path: Path, quoted: bool) -> None:
    """Aggregate decode tok/s against the number of streams (medians, with the range of repetitions)."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, label, colour in (
        ("chatmesh-int8", "chatmesh native-int8 (default)", "tab:green"),
        ("chatmesh-float32", "chatmesh native (float32 activations)", "tab:blue"),
        ("llama.cpp-native", "llama.cpp native tools" + (" (issue 19)" if quoted else ""), "tab:gray"),
        ("llama.cpp", "llama-cpp-python", "tab:olive"),
    ):
        if name not in runs:
            continue
        values = [[r[f"decode_b{b}"] for r in runs[name]] for b in BATCHES]
        mid = [statistics.median(v) for v in values]
        err = [
            [m - min(v) for m, v in zip(mid, values, strict=True)],
            [max(v) - m for m, v in zip(mid, values, strict=True)],
        ]
        ax.errorbar(BATCHES, mid, yerr=err, fmt="o-", color=colour, label=label, capsize=3)
    ax.set_xscale("log", base=2)
    ax.set_xticks(BATCHES, [str(b) for b in BATCHES])
    ax.set_xlabel("concurrent streams (greedy decode, 64-token prompts)")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_title(f"SmolLM2-135M Q4_1, {THREADS} threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    main()
