"""Prompt-lookup speculative decoding, on vs off, side by side in one process on the real model.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_speculative.py [--reps 5] [--k 4]
    [--json out.json]

The bundled SmolLM2-135M-Instruct on the engine's default kernels and THREADS compute threads, through
the engine core (scheduler, KV cache, sampler: ``LLMEngine.step``), chat-templated prompts, greedy.
Each repetition runs every workload with speculation off and on, back to back, in alternating order,
each run in a fresh engine over the one loaded model; a repetition's ratio compares two runs under
similar load. Rows:
- input-grounded, one stream: answers that quote their input (repeat a given text, rename a variable in
  a given function, summarize a given paragraph; greedy, up to 128 tokens);
- no match, one stream and 32 streams: open questions whose answers the prompt does not hold, sampled
  (temperature 1, seeded: greedy answers of a small model repeat themselves, which drafts then match).
Rate: output tokens per second of decode, from the run's first token to its last (prefill is the same
work either way), over all its streams; beside it the same ratio in process CPU time (both compute
threads), which the other work on a shared machine inflates less than wall time. Both runs produce the same tokens (the engine
guarantees it; the bench checks it), so the ratio is the time ratio. Acceptance: draft tokens accepted /
verified, over the workload's speculating runs. Goals (issue 62): >= 1.5x one stream on input-grounded
prompts; <= 2 % slower where nothing matches, at one stream and at 32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402
from chatmesh.model_files import bundled_model_path  # noqa: E402
from chatmesh.tokenizer import ChatMessage, ChatTokenizer, load_tokenizer  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model.cpu_runner import CpuModelRunner  # noqa: E402
from engine.request import EngineRequest, SamplingParams  # noqa: E402

THREADS = int(os.environ.get("CHATMESH_BENCH_THREADS", "2"))
MAX_TOKENS = 128
BATCH_MAX_TOKENS = 32  # per stream at 32 streams
NO_MATCH = {"temperature": 1.0, "top_p": 0.95}
PARAGRAPH = (
    "The lighthouse keeper's log, autumn. Each evening I climb the ninety-seven steps, trim the wick, "
    "polish the great lens and write down the weather: wind from the west, a heavy swell, gulls flying "
    "low over the rocks. Ships pass far out, their lights small as stars. Supplies come by boat every "
    "second Thursday: flour, lamp oil, letters from my sister in the city, who asks when I will come home."
)
CODE = """def summarize_orders(orders):
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = order["quantity"] * order["unit_price"]
        if customer not in totals:
            totals[customer] = 0
        totals[customer] = totals[customer] + amount
    return sorted(totals.items(), key=lambda item: item[1], reverse=True)
"""
# name: (system prompt or None, user turn)
GROUNDED = {
    "repeat": (None, f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}"),
    "edit": (
        "You edit code. Reply with the complete edited code only, changing nothing else.",
        f"Rename the variable totals to revenue:\n\n```python\n{CODE}```",
    ),
    "summarize": (None, f"Summarize this paragraph:\n\n{PARAGRAPH}"),
}
OPEN_QUESTIONS = [
    "Write a short poem about the sea.",
    "Why is the sky blue?",
    "Give me three ideas for a birthday party.",
    "What makes a good cup of coffee?",
    "Tell me a story about a dragon who is afraid of the dark.",
    "How do plants grow?",
    "What should I pack for a weekend hike?",
    "Explain what a rainbow is to a child.",
]


def workloads(tok: ChatTokenizer) -> dict[str, list[EngineRequest]]:
    def chat(text: str, system: str | None = None) -> tuple[int, ...]:
        turns = [ChatMessage("system", system)] if system else []
        return tuple(tok.encode_chat([*turns, ChatMessage("user", text)]))

    grounded = SamplingParams(max_tokens=MAX_TOKENS)
    loads = {
        name: [EngineRequest(name, chat(text, system), grounded)] for name, (system, text) in GROUNDED.items()
    }
    loads["no match b=1"] = [
        EngineRequest("q", chat(OPEN_QUESTIONS[0]), SamplingParams(max_tokens=MAX_TOKENS, seed=1, **NO_MATCH))
    ]
    loads["no match b=32"] = [
        EngineRequest(
            f"q{i}",
            chat(OPEN_QUESTIONS[i % len(OPEN_QUESTIONS)]),
            SamplingParams(max_tokens=BATCH_MAX_TOKENS, seed=i, **NO_MATCH),
        )
        for i in range(32)
    ]
    return loads


@dataclass
class Run:
    tok_s: float  # decode tokens per second of wall time
    cpu_per_token_s: float  # process CPU seconds per decode token
    tokens: list[list[int]]  # each request's output
    drafted: int
    accepted: int


def run_once(runner, tok, requests: list[EngineRequest], k: int) -> Run:
    """Every request of a workload, together, in a fresh engine."""
    first: dict[str, float] = {}
    last: dict[str, tuple[float, float]] = {}
    cpu_first: list[float] = []
    tokens: dict[str, list[int]] = {}

    def on_outputs(outputs) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        for o in outputs:
            if o.token_ids:
                if not first:
                    cpu_first.append(cpu)
                first.setdefault(o.request_id, now)
                last[o.request_id] = (now, cpu)
                tokens.setdefault(o.request_id, []).extend(o.token_ids)

    config = EngineConfig(backend="cpu", num_threads=THREADS, speculative_tokens=k)
    engine = LLMEngine(config, runner, tok, on_outputs=on_outputs)
    for req in requests:
        engine.add_request(req)
    while engine.has_unfinished_requests():
        engine.step()
    # Decode tokens: every token after each request's first, over the span from the first first token
    # to the last last token (the streams of a batch decode together).
    ids = [req.request_id for req in requests]
    decoded = sum(len(tokens[rid]) - 1 for rid in ids)
    end, cpu_end = max(last.values())
    return Run(
        decoded / (end - min(first.values())),
        (cpu_end - cpu_first[0]) / decoded,
        [tokens[rid] for rid in ids],
        engine.draft_tokens,
        engine.accepted_draft_tokens,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step (--speculative-tokens)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(machine())
    tok = load_tokenizer()
    runner = CpuModelRunner.from_gguf(bundled_model_path(), num_threads=THREADS, kernels="auto")
    print(f"model {runner.spec.name}, kernels {runner.kernels.name}, threads {THREADS}, k {args.k}")
    loads = workloads(tok)
    runs: dict[str, dict[str, list[Run]]] = {name: {"off": [], "on": []} for name in loads}
    run_once(runner, tok, loads["no match b=1"], 0)  # warm-up: first touch of the weights and KV
    for rep in range(args.reps):
        for name, requests in loads.items():
            for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                runs[name][mode].append(run_once(runner, tok, requests, args.k if mode == "on" else 0))
            if runs[name]["on"][-1].tokens != runs[name]["off"][-1].tokens:
                raise RuntimeError(f"{name}: speculation changed the output")
        print(f"rep {rep + 1}/{args.reps} done", flush=True)

    print(
        f"\n{'workload':<14} {'tokens':>6} {'off tok/s':>9} {'on tok/s':>9} {'on/off tok/s (range)':>24} "
        f"{'CPU/token off/on (range)':>26} {'acceptance':>10} {'drafted/run':>11}"
    )
    report = {}
    for name in loads:
        off, on = runs[name]["off"], runs[name]["on"]
        ratios = [b.tok_s / a.tok_s for a, b in zip(off, on, strict=True)]
        cpu_ratios = [a.cpu_per_token_s / b.cpu_per_token_s for a, b in zip(off, on, strict=True)]
        drafted = sum(r.drafted for r in on)
        acceptance = sum(r.accepted for r in on) / drafted if drafted else 0.0
        report[name] = {
            "tokens": sum(len(t) for t in on[0].tokens),
            "off_tok_s": [r.tok_s for r in off],
            "on_tok_s": [r.tok_s for r in on],
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "cpu_ratio_median": statistics.median(cpu_ratios),
            "cpu_ratio_min": min(cpu_ratios),
            "cpu_ratio_max": max(cpu_ratios),
            "acceptance": acceptance,
            "drafted_per_run": drafted / args.reps,
        }
        row = report[name]
        print(
            f"{name:<14} {row['tokens']:>6} {statistics.median(row['off_tok_s']):>9.1f} "
            f"{statistics.median(row['on_tok_s']):>9.1f} "
            f"{row['ratio_median']:>10.3f}x ({row['ratio_min']:.3f}-{row['ratio_max']:.3f}) "
            f"{row['cpu_ratio_median']:>12.3f}x ({row['cpu_ratio_min']:.3f}-{row['cpu_ratio_max']:.3f}) "
            f"{acceptance:>10.0%} {row['drafted_per_run']:>11.0f}"
        )
    grounded = [report[name]["ratio_median"] for name in GROUNDED]
    print(f"\ninput-grounded one stream: {min(grounded):.2f}x-{max(grounded):.2f}x (goal >= 1.5x)")
    for name in ("no match b=1", "no match b=32"):
        row = report[name]
        print(f"{name}: {row['ratio_median']:.3f}x tok/s, {row['cpu_ratio_median']:.3f}x CPU (goal >= 0.98x)")
    if args.json:
        args.json.write_text(json.dumps({"k": args.k, "reps": args.reps, "workloads": report}, indent=2))


if __name__ == "__main__":
    main()
