"""Writes tests/data/llamacpp_logits.json: llama.cpp's next-token logits on the bundled GGUF.

The runner's parity test compares against this file, so tests never need llama.cpp. Regenerate it (and
commit the result) when the model or llama-cpp-python changes:

    .venv/bin/pip install -e '.[bench]' && .venv/bin/python bench/make_llamacpp_fixture.py
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from chatmesh.model_files import bundled_model_path
from chatmesh.tokenizer import load_tokenizer

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "llamacpp_logits.json"
TOP_K = 20
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three prime numbers."},
        {"role": "assistant", "content": "2, 3, 5."},
        {"role": "user", "content": "And their sum?"},
    ],
]
TEXTS = ["The quick brown fox jumps over the lazy", "def fibonacci(n):\n    "]


def main() -> None:
    from llama_cpp import Llama, __version__

    path = bundled_model_path()
    tokenizer = load_tokenizer()
    prompts = [tokenizer.encode_chat(chat) for chat in CHATS] + [tokenizer.encode(text) for text in TEXTS]
    print(f"llama-cpp-python {__version__}: next-token logits for {len(prompts)} prompts of {path.name}")
    llm = Llama(model_path=str(path), n_ctx=512, n_threads=2, n_batch=512, logits_all=True, verbose=False)
    cases = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        top = np.argsort(-logits)[:TOP_K]
        cases.append(
            {
                "prompt_token_ids": ids,
                "top_token_ids": [int(i) for i in top],
                "top_logits": [round(float(logits[i]), 4) for i in top],
            }
        )
        print(f"  {len(ids):3d} tokens → {tokenizer.decode(top[:5].tolist(), skip_control=False)!r}")
    OUT.write_text(
        json.dumps(
            {
                "generator": "bench/make_llamacpp_fixture.py",
                "llama_cpp_python": __version__,
                "model_file": path.name,
                "model_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "cases": cases,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
