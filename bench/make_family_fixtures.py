"""Writes tests/data/family_llamacpp.json: llama.cpp's next-token logits on tiny random-weight GGUFs of
Llama 3, Qwen2, Qwen3 and Mistral (tests/fixtures/family_ggufs.py writes them from a seed).

The parity test (tests/engine/test_model_families.py) rewrites each file from its seed, checks its
SHA-256 against the one recorded here (the file the test runs is the one llama.cpp ran), and compares
the engine's logits, so tests never need llama.cpp. Regenerate (and commit the result) when the
generator or llama-cpp-python changes:

    .venv/bin/python -m bench.make_family_fixtures

Prompts are token ids (the files carry SmolLM2's vocabulary; no tokenizer is under test). Per prompt:
llama.cpp's top TOP_K logits and the logits of SAMPLED other ids, so the comparison covers the whole
distribution, not only its head.

Mistral's sliding window: llama.cpp ignores ``llama.attention.sliding_window`` (``load_hparams`` in its
src/llama-model.cpp reads no window for LLM_ARCH_LLAMA; measured here: the same logits with and without
the key, recorded as ``window_ignored_by_llamacpp``). The Mistral file has one layer, so the last token's logits with a
window of W are those of the last W tokens alone (RoPE is relative): llama.cpp evaluates those for the
prompts longer than the window (``llamacpp_token_ids``).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from chatmesh.gguf_header import read_gguf_metadata
from tests.fixtures.family_ggufs import FAMILIES, Family, write_family_gguf

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "family_llamacpp.json"
TOP_K = 32
SAMPLED = 32
PROMPT_LENGTHS = (1, 7, 40, 90)
PROMPT_SEED = 57


def prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(PROMPT_SEED)
    return [rng.integers(100, vocab_size, n).tolist() for n in PROMPT_LENGTHS]


def last_logits(path: Path, token_ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path), n_ctx=256, n_batch=256, n_ubatch=256, n_threads=2, swa_full=True, verbose=False
    )
    llm.eval(token_ids)
    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).astype(np.float32)


def family_cases(family: Family, path: Path, vocab_size: int) -> list[dict]:
    rng = np.random.default_rng(family.seed)
    cases = []
    for ids in prompts(vocab_size):
        window = family.sliding_window
        evaluated = ids[-window:] if window and len(ids) > window else ids
        logits = last_logits(path, evaluated)
        top = np.argsort(-logits)[:TOP_K]
        others = rng.choice(np.setdiff1d(np.arange(vocab_size), top), SAMPLED, replace=False)
        case = {
            "prompt_token_ids": ids,
            "top_token_ids": top.tolist(),
            "top_logits": [round(float(logits[i]), 5) for i in top],
            "sampled_token_ids": others.tolist(),
            "sampled_logits": [round(float(logits[i]), 5) for i in others],
        }
        if evaluated is not ids:
            case["llamacpp_token_ids"] = evaluated
        cases.append(case)
        print(
            f"  {family.name}: {len(ids):3d} tokens, top {top[:3].tolist()} {logits[top[:3]].round(3).tolist()}"
        )
    return cases


def main() -> None:
    from llama_cpp import __version__

    print(f"llama-cpp-python {__version__}")
    families = {}
    with tempfile.TemporaryDirectory() as scratch:
        for family in FAMILIES.values():
            path = write_family_gguf(family, Path(scratch) / f"{family.name}.gguf")
            vocab_size = len(read_gguf_metadata(path)["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
            entry: dict = {
                "gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "cases": family_cases(family, path, vocab_size),
            }
            if family.sliding_window:
                # The longest prompt with and without the key, evaluated whole: llama.cpp's window or not.
                unwindowed = write_family_gguf(
                    replace(family, sliding_window=0), Path(scratch) / "nowindow.gguf"
                )
                longest = prompts(vocab_size)[-1]
                diff = np.abs(last_logits(path, longest) - last_logits(unwindowed, longest)).max()
                entry["window_ignored_by_llamacpp"] = bool(diff == 0.0)
                print(f"  {family.name}: llama.cpp with and without the window key: max |diff| {diff}")
            families[family.name] = entry
    fixture = {
        "generator": "bench/make_family_fixtures.py",
        "llama_cpp_python": __version__,
        "families": families,
    }
    OUT.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
