"""Constrained decoding on the real model (SmolLM2-135M, the engine's own CPU runner), side by side in
one run: the numbers behind docs/structured-outputs.md.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_structured.py [--reps 3] [--max-tokens 256]
        [--suite-only] [--seeds 7,11,23]

CPU-time rates (this process's, all threads) are steadier than wall time on a machine shared with
other work; both are printed.

1. The schema suite (tests/data/json_schemas, each schema in the system turn, its description as the
   ask), all in one batch, greedy and at temperature 0.7 (``--seeds``, one suite per seed): how many finish with ``stop`` within
   ``--max-tokens``, and whether every finished output validates (jsonschema).
2. Decode throughput of 32 streams all constrained to one cached schema against 32 unconstrained, the
   same prompt, the same number of tokens (the schema cannot end sooner), rounds alternated; greedy
   (where a row whose best token its grammar allows needs no masking pass) and at temperature 0.7.
3. First-token cost of a cached schema: one request alone, constrained against not (its prompt's KV
   cached, so the step is one token), and the service's admission of a cached constraint.
4. Compile time (cold, no cache) of every schema in the suite, ``--reps`` times: p50 / p99.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from chatmesh.finish import FinishReason

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jsonschema  # noqa: E402
import numpy as np  # noqa: E402

from bench.machine import machine  # noqa: E402
from chatmesh.model_files import bundled_model_path  # noqa: E402
from chatmesh.tokenizer import ChatMessage, load_tokenizer  # noqa: E402
from engine import llm_engine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model.cpu_runner import CpuModelRunner  # noqa: E402
from engine.model.gguf_loader import load_gguf  # noqa: E402
from engine.model.kernels import select_kernels  # noqa: E402
from engine.outputs import RequestOutput  # noqa: E402
from engine.request import EngineRequest, SamplingParams  # noqa: E402
from engine.structured import (  # noqa: E402
    CompiledGrammar,
    Constraint,
    GrammarCompiler,
    GrammarState,
    constrained_logits,
)

SCHEMAS = ROOT / "tests" / "data" / "json_schemas"
STREAMS = 32
DECODE_TOKENS = 64
# A schema no output can complete within DECODE_TOKENS: every stream decodes them all.
ENDLESS = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 500}},
    "required": ["notes"],
    "additionalProperties": False,
}


class Bench:
    def __init__(self) -> None:
        checkpoint = load_gguf(bundled_model_path())
        self.runner = CpuModelRunner(checkpoint, select_kernels(None, None, checkpoint.config))
        self.tokenizer = load_tokenizer()
        self.compiler = GrammarCompiler(self.tokenizer)
        self.outputs: list[RequestOutput] = []
        config = EngineConfig(
            num_kv_blocks=2048, block_size=16, max_batched_tokens=512, max_running_requests=64
        )
        self.engine = LLMEngine(config, self.runner, self.tokenizer, on_outputs=self.outputs.extend)
        self._serial = 0

    def request(
        self, prompt: list[int], grammar: CompiledGrammar | None, max_tokens: int, **sampling: object
    ) -> EngineRequest:
        self._serial += 1
        params = SamplingParams(
            max_tokens=max_tokens, constraint=grammar.constraint if grammar else None, **sampling
        )
        return EngineRequest(f"r{self._serial}", tuple(prompt), params, grammar=grammar)

    def run(self, requests: list[EngineRequest]) -> dict[str, tuple[str, FinishReason]]:
        self.outputs.clear()
        for req in requests:
            self.engine.add_request(req)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        texts: dict[str, list[str]] = {}
        ends = {}
        for out in self.outputs:
            texts.setdefault(out.request_id, []).append(out.text)
            if out.finish is not None:
                texts[out.request_id].append(out.finish.text)
                ends[out.request_id] = out.finish.reason
        return {rid: ("".join(parts), ends[rid]) for rid, parts in texts.items()}

    def prompt(self, schema: dict) -> list[int]:
        system = "Answer with JSON that follows this schema: " + json.dumps(schema)
        return self.tokenizer.encode_chat(
            [ChatMessage("system", system), ChatMessage("user", schema["description"])]
        )


def suite(bench: Bench, max_tokens: int, temperature: float, seed: int = 7) -> dict:
    schemas = {p.stem: json.loads(p.read_text()) for p in sorted(SCHEMAS.glob("*.json"))}
    requests, names = [], {}
    for name, schema in schemas.items():
        grammar = bench.compiler.compile(Constraint("json_schema", json.dumps(schema)))
        req = bench.request(bench.prompt(schema), grammar, max_tokens, temperature=temperature, seed=seed)
        requests.append(req)
        names[req.request_id] = name
    done = bench.run(requests)
    stopped, invalid, cut = 0, [], []
    for rid, (text, reason) in done.items():
        if reason != FinishReason.STOP:
            cut.append(names[rid])
            continue
        stopped += 1
        try:
            jsonschema.validate(json.loads(text), schemas[names[rid]])
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append(f"{names[rid]}: {exc}")
    return {"schemas": len(schemas), "stop": stopped, "invalid": invalid, "cut_by_max_tokens": cut}


@dataclass
class Round:
    wall_tok_s: float  # aggregate decode tokens per second of wall time
    cpu_tok_s: float  # per second of this process's CPU time (all threads): steadier on a busy machine
    mask_ms_per_step: float  # wall time in constrained_logits per step (0 unconstrained)


def decode_round(bench: Bench, constrained: bool, temperature: float) -> Round:
    """Aggregate decode tokens/s of STREAMS streams over the steps where all of them decode."""
    # The ask a constrained request makes (the schema in the system turn), for both sides alike.
    prompt = bench.prompt({**ENDLESS, "description": "Take notes on the history of Rome."})
    grammar = bench.compiler.compile(Constraint("json_schema", json.dumps(ENDLESS))) if constrained else None
    for _ in range(STREAMS):
        bench.engine.add_request(
            bench.request(prompt, grammar, DECODE_TOKENS, ignore_eos=True, temperature=temperature, seed=3)
        )
    bench.outputs.clear()
    while len(bench.engine.scheduler.running) < STREAMS or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in bench.engine.scheduler.running
    ):
        bench.engine.step()  # the prompts' prefill
    MASK_TIMES.clear()
    steps, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while bench.engine.has_unfinished_requests():
        running = len(bench.engine.scheduler.running)
        bench.engine.step()
        if running == STREAMS:
            steps += 1
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return Round(STREAMS * steps / elapsed, STREAMS * steps / cpu, sum(MASK_TIMES) * 1e3 / steps)


MASK_TIMES: list[float] = []


def _timed_masks(
    logits: np.ndarray,
    argmax: np.ndarray | None,
    rows: Sequence[int],
    states: Sequence[GrammarState],
    greedy: Sequence[bool],
) -> tuple[np.ndarray, np.ndarray | None]:
    start = time.perf_counter()
    constrained = constrained_logits(logits, argmax, rows, states, greedy)
    MASK_TIMES.append(time.perf_counter() - start)
    return constrained


llm_engine.constrained_logits = _timed_masks  # the step's masks, timed (the engine calls it by this name)


def decode_side_by_side(bench: Bench, temperature: float, reps: int) -> None:
    rounds: dict[bool, list[Round]] = {False: [], True: []}
    for _ in range(reps):
        for constrained in (False, True):
            rounds[constrained].append(decode_round(bench, constrained, temperature))
    what = f"decode at temperature {temperature}, {STREAMS} streams x {DECODE_TOKENS} tokens"
    for label, pick in (("wall", lambda r: r.wall_tok_s), ("CPU", lambda r: r.cpu_tok_s)):
        free, held = [pick(r) for r in rounds[False]], [pick(r) for r in rounds[True]]
        ratios = [c / u for c, u in zip(held, free, strict=True)]
        print(
            f"{what}, aggregate tok/s of {label} time: unconstrained {statistics.median(free):.0f} "
            f"[{min(free):.0f}, {max(free):.0f}], constrained {statistics.median(held):.0f} "
            f"[{min(held):.0f}, {max(held):.0f}]; constrained/unconstrained per round: "
            f"{', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f})"
        )
    masks = [r.mask_ms_per_step for r in rounds[True]]
    print(
        f"{what}: masks per step (ms, wall): median {statistics.median(masks):.2f} "
        f"[{min(masks):.2f}, {max(masks):.2f}]"
    )


def first_token_s(bench: Bench, grammar: CompiledGrammar | None, prompt: list[int]) -> float:
    """CPU seconds (this process, all threads) from the request's arrival to its first token."""
    bench.outputs.clear()
    start = time.process_time()
    bench.engine.add_request(bench.request(prompt, grammar, 1))
    while not bench.outputs:
        bench.engine.step()
    elapsed = time.process_time() - start
    while bench.engine.has_unfinished_requests():
        bench.engine.step()
    return elapsed


def compile_times(bench: Bench, reps: int) -> list[float]:
    cold = GrammarCompiler(bench.tokenizer, cache_size=0)
    cold.compile(Constraint("json_object"))  # the tokenizer's one-time setup, not a schema's compile
    times = []
    for _ in range(reps):
        for path in sorted(SCHEMAS.glob("*.json")):
            constraint = Constraint("json_schema", path.read_text())
            start = time.perf_counter()
            cold.compile(constraint)
            times.append(time.perf_counter() - start)
    return times


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--suite-only", action="store_true", help="part 1 only")
    parser.add_argument(
        "--seeds", default="7", help="the sampled suite's seeds, comma-separated (greedy needs none)"
    )
    args = parser.parse_args()
    print(machine())
    bench = Bench()
    report: dict = {"max_tokens": args.max_tokens}
    report["suite_t0.0"] = suite(bench, args.max_tokens, 0.0)
    print("suite, greedy:", json.dumps(report["suite_t0.0"]))
    for seed in (int(s) for s in args.seeds.split(",")):
        report[f"suite_t0.7_seed{seed}"] = suite(bench, args.max_tokens, 0.7, seed)
        print(f"suite, temperature 0.7, seed {seed}:", json.dumps(report[f"suite_t0.7_seed{seed}"]))
    if args.suite_only:
        return

    for temperature in (0.0, 0.7):
        decode_side_by_side(bench, temperature, args.reps)

    schema = json.loads((SCHEMAS / "person.json").read_text())
    prompt = bench.prompt(schema)
    grammar = bench.compiler.compile(Constraint("json_schema", json.dumps(schema)))
    first_token_s(bench, None, prompt)  # the prompt's KV in the prefix cache
    pairs = [(first_token_s(bench, None, prompt), first_token_s(bench, grammar, prompt)) for _ in range(40)]
    extra_ms = [(c - u) * 1e3 for u, c in pairs]
    admit = []
    constraint = Constraint("json_schema", json.dumps(schema))
    for _ in range(200):
        start = time.perf_counter()
        cached = bench.compiler.cached(constraint)
        assert cached is not None
        cached.start(())
        admit.append((time.perf_counter() - start) * 1e6)
    print(
        f"first token, cached schema, prompt KV cached (ms of CPU): unconstrained "
        f"{statistics.median(u for u, _ in pairs) * 1e3:.2f}, constrained {statistics.median(c for _, c in pairs) * 1e3:.2f}; "
        f"extra per pair p50 {statistics.median(extra_ms):.2f} ms [{min(extra_ms):.2f}, {max(extra_ms):.2f}]; "
        f"service admission of a cached constraint p50 {statistics.median(admit):.1f} µs"
    )

    times = compile_times(bench, args.reps)
    print(
        f"compile, cold, {len(times)} compiles of the suite's schemas (ms): p50 {pct(times, 0.5) * 1e3:.2f}, "
        f"p99 {pct(times, 0.99) * 1e3:.2f}, max {max(times) * 1e3:.2f}"
    )


if __name__ == "__main__":
    main()
