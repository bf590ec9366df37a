"""llguidance against xgrammar on our tokenizer (SmolLM2's, 49,152 tokens) and our schema suite: the
measurement behind the choice in docs/structured-outputs.md.

Each library runs in a throwaway virtual environment of its own (neither is needed to run this with
the project's: the project's venv only exports the tokenizer):

    .venv/bin/python bench/bench_grammar_libraries.py export /tmp/smollm2-tokenizer
    python3 -m venv /tmp/lg && /tmp/lg/bin/pip install llguidance==1.9.1
    python3 -m venv /tmp/xg && /tmp/xg/bin/pip install xgrammar==0.2.8
    flock /tmp/chatmesh-bench.lock /tmp/lg/bin/python bench/bench_grammar_libraries.py measure llguidance /tmp/smollm2-tokenizer
    flock /tmp/chatmesh-bench.lock /tmp/xg/bin/python bench/bench_grammar_libraries.py measure xgrammar /tmp/smollm2-tokenizer

Per library: the tokenizer's one-time setup; each schema of tests/data/json_schemas compiled cold
(no cache) 5 times, then its first mask computed (work either library may leave for it), p50/p99 over
all compiles; and the per-token mask cost along a seeded
random walk through each schema's grammar (each step: compute the mask, pick an allowed token with a
fixed-seed generator, consume it; at most 96 tokens a walk), p50/p99 over all steps. JSON is compact
(", " and ": " separators, no other whitespace) in both.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

SCHEMAS = Path(__file__).resolve().parent.parent / "tests" / "data" / "json_schemas"
WALK_TOKENS = 96


def export(directory: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from chatmesh.tokenizer import load_tokenizer

    Path(directory).mkdir(parents=True, exist_ok=True)
    load_tokenizer().save_hf_files(directory)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Llguidance:
    def __init__(self, tokenizer_dir: str) -> None:
        import llguidance
        import llguidance.numpy as lgnp

        self.lg, self.lgnp = llguidance, lgnp
        spec = (Path(tokenizer_dir) / "tokenizer.json").read_text()
        self.tokenizer = llguidance.LLTokenizer(spec, eos_token=[2])
        self.vocab = self.tokenizer.vocab_size
        self.mask = lgnp.allocate_token_bitmask(1, self.vocab)

    def compile(self, schema: dict) -> object:
        grammar = self.lg.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        )
        matcher = self.lg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        self.lgnp.fill_next_token_bitmask(matcher, self.mask)  # the first mask: compile work done lazily
        return grammar

    def walk(self, grammar: object, rng: random.Random) -> list[float]:
        matcher = self.lg.LLMatcher(self.tokenizer, grammar)
        import numpy as np

        costs = []
        for _ in range(WALK_TOKENS):
            start = time.perf_counter()
            self.lgnp.fill_next_token_bitmask(matcher, self.mask)
            costs.append(time.perf_counter() - start)
            bits = np.unpackbits(self.mask[0].view(np.uint8), bitorder="little")[: self.vocab]
            allowed = np.flatnonzero(bits)
            if matcher.is_stopped() or len(allowed) == 0:
                break
            matcher.consume_token(int(allowed[rng.randrange(len(allowed))]))
        return costs


class Xgrammar:
    def __init__(self, tokenizer_dir: str) -> None:
        import transformers
        import xgrammar

        self.xgr = xgrammar
        hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        self.vocab = len(hf)
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, self.vocab)

    def compile(self, schema: dict) -> object:
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )
        self.xgr.GrammarMatcher(compiled).fill_next_token_bitmask(
            self.mask
        )  # as llguidance's: the first mask
        return compiled

    def walk(self, compiled: object, rng: random.Random) -> list[float]:
        import numpy as np

        matcher = self.xgr.GrammarMatcher(compiled)
        costs = []
        for _ in range(WALK_TOKENS):
            if matcher.is_terminated():
                break
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(self.mask)
            costs.append(time.perf_counter() - start)
            bits = np.unpackbits(self.mask[0].numpy().view(np.uint8), bitorder="little")[: self.vocab]
            allowed = np.flatnonzero(bits)
            if len(allowed) == 0:
                break
            matcher.accept_token(int(allowed[rng.randrange(len(allowed))]))
        return costs


def measure(library: str, tokenizer_dir: str, reps: int = 5) -> None:
    start = time.perf_counter()
    lib = (Llguidance if library == "llguidance" else Xgrammar)(tokenizer_dir)
    setup_s = time.perf_counter() - start
    schemas = {p.stem: json.loads(p.read_text()) for p in sorted(SCHEMAS.glob("*.json"))}
    compiles: list[float] = []
    failures = []
    compiled = {}
    for name, schema in schemas.items():
        for _ in range(reps):
            start = time.perf_counter()
            try:
                compiled[name] = lib.compile(schema)
            except Exception as exc:
                failures.append(f"{name}: {exc}")
                break
            compiles.append(time.perf_counter() - start)
    masks: list[float] = []
    for i, name in enumerate(sorted(compiled)):
        masks += lib.walk(compiled[name], random.Random(i))
    print(
        json.dumps(
            {
                "library": library,
                "vocab": lib.vocab,
                "tokenizer_setup_s": round(setup_s, 3),
                "schemas": len(schemas),
                "compile_failures": failures,
                "compile_ms_p50": round(pct(compiles, 0.5) * 1e3, 2),
                "compile_ms_p99": round(pct(compiles, 0.99) * 1e3, 2),
                "compile_ms_mean": round(statistics.fmean(compiles) * 1e3, 2),
                "mask_steps": len(masks),
                "mask_us_p50": round(pct(masks, 0.5) * 1e6, 1),
                "mask_us_p99": round(pct(masks, 0.99) * 1e6, 1),
                "mask_us_mean": round(statistics.fmean(masks) * 1e6, 1),
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "export":
        export(sys.argv[2])
    else:
        measure(sys.argv[2], sys.argv[3])
