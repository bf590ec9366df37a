"""Writes tests/data/minilm_llamacpp.json: llama.cpp's sentence embeddings of all-MiniLM-L6-v2 for a
committed set of sentences, the independent reference forward the engine's encoder is checked against
(tests/engine/test_embeddings_parity.py), so tests never need llama.cpp.

The GGUF is converted from the same ``model.safetensors`` the engine loads, with the ``gguf``
package's own converter tables (``gguf.get_tensor_name_map`` for the tensor names, ``SpecialVocab``
for the special tokens) the way llama.cpp's ``convert_hf_to_gguf.py`` writes a ``BertModel``: float32
tensors, the WordPiece vocabulary in llama.cpp's phantom-space form (``##x`` → ``x``, any other token
→ ``▁token``), mean pooling. llama.cpp then tokenizes each sentence itself (its ids are recorded too, a
check of our tokenizer) and runs its own BERT graph. Regenerate (and commit the result) when the
sentences, the model package or llama-cpp-python change:

    .venv/bin/python -m bench.make_embedding_fixture
"""

from __future__ import annotations

import base64
import json
import tempfile
from pathlib import Path

import gguf
import numpy as np

from chatmesh.model_files import MINILM_PIN, minilm_model_path
from engine.model.bert import read_bert_config

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "minilm_llamacpp.json"

SENTENCES = [
    "Hello world",
    "The cat sat on the mat.",
    "A man is playing a guitar on stage.",
    "Someone plays an instrument in front of an audience.",
    "I moved from Lisbon to Berlin last spring.",
    "My favourite colour used to be green, now it is blue.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "Cassandra 5.0 adds vector search with storage-attached indexes.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "The quick brown fox jumps over the lazy dog!!!",
    "Café, naïve, résumé: accents are stripped by the lower-casing tokenizer.",
    "Numbers like 3.14159, 2,718 and 1e-12 split into pieces.",
    "東京は日本の首都です。",
    "Emoji 🙂 and symbols ∑ ≠ become unknown tokens.",
    "   leading and trailing spaces   ",
    "UPPER CASE AND lower case read the same",
    "a",
    "Bank: the river bank was muddy after the storm.",
    "Bank: I deposited my salary at the bank this morning.",
    "Remind me what my sister's dog is called.",
    "My sister adopted a beagle named Biscuit in 2019.",
    "The meeting moved from Tuesday to Thursday at 3 pm.",
    " ".join(
        [
            "Long inputs exercise every position of the table up to the model's limit:",
            "retrieval over a chat history embeds whole messages, and messages run long.",
        ]
        * 6
    ),
]


def write_gguf(model_dir: Path, path: Path) -> None:
    """The safetensors of ``model_dir`` as a llama.cpp BERT GGUF (float32)."""
    from safetensors.numpy import load_file

    config = read_bert_config(model_dir)
    hf = json.loads((model_dir / "config.json").read_text())
    arch = gguf.MODEL_ARCH.BERT
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(config.name)
    writer.add_context_length(config.max_positions)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_layers)
    writer.add_head_count(config.num_heads)
    writer.add_layer_norm_eps(config.layer_norm_eps)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_token_type_count(int(hf.get("type_vocab_size", 2)))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {t for t in tokens if t.startswith("[") and t.endswith("]")}

    def phantom(token: str) -> str:
        if token in special:
            return token
        return token[2:] if token.startswith("##") else "\u2581" + token

    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([phantom(t) for t in tokens])
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    gguf.SpecialVocab(model_dir, load_merges=False, n_vocab=len(tokens)).add_to_gguf(writer)

    names = gguf.get_tensor_name_map(arch, config.num_layers)
    for name, data in load_file(model_dir / "model.safetensors").items():
        if name.endswith("position_ids") or name.startswith("pooler."):
            continue  # not weights of the encoder llama.cpp runs (mean pooling, no pooler head)
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"no GGUF name for {name}")
        writer.add_tensor(new_name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    from llama_cpp import LLAMA_POOLING_TYPE_MEAN, Llama
    from llama_cpp import __version__ as llama_cpp_version

    model_dir = minilm_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "minilm-f32.gguf"
        write_gguf(model_dir, path)
        llm = Llama(
            model_path=str(path),
            embedding=True,
            pooling_type=LLAMA_POOLING_TYPE_MEAN,
            n_ctx=512,
            n_batch=512,
            n_ubatch=512,
            n_threads=2,
            verbose=False,
        )
        cases = []
        for text in SENTENCES:
            vector = np.asarray(llm.embed(text, normalize=True), dtype=np.float32)
            cases.append(
                {
                    "text": text,
                    "token_ids": llm.tokenize(text.encode(), add_bos=True, special=False),
                    "embedding_f32_b64": base64.b64encode(vector.astype("<f4").tobytes()).decode(),
                }
            )
        llm.close()
    OUT.write_text(
        json.dumps(
            {
                "model": MINILM_PIN,
                "reference": f"llama-cpp-python {llama_cpp_version}, F32 GGUF, mean pooling, L2-normalised",
                "cases": cases,
            },
            indent=1,
            ensure_ascii=False,
        )
        + "\n"
    )
    print(f"wrote {OUT}: {len(cases)} sentences")


if __name__ == "__main__":
    main()
