"""all-MiniLM-L6-v2 on our engine against an independent reference forward: llama.cpp's BERT graph on a
GGUF converted from the same safetensors (tests/data/minilm_llamacpp.json, written by
bench/make_embedding_fixture.py), on every kernel set this CPU runs."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np
import pytest

from chatmesh.model_files import minilm_model_path
from engine.embeddings.tokenizer import EmbeddingTokenizer, InputTooLong
from engine.model.bert import BertEncoder, erf, load_bert
from engine.model.kernels import select_kernels
from engine.model.kernels.native import NativeUnavailable

FIXTURE = json.loads((Path(__file__).parent.parent / "data" / "minilm_llamacpp.json").read_text())
MIN_COSINE = 0.999


@pytest.fixture(scope="module")
def checkpoint():
    return load_bert(minilm_model_path())


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return EmbeddingTokenizer(minilm_model_path(), checkpoint.config.max_tokens)


def _kernels(name: str):
    try:
        return select_kernels(name)
    except NativeUnavailable as exc:
        pytest.skip(str(exc))


def _reference(case: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(case["embedding_f32_b64"]), dtype="<f4")


def test_the_fixture_covers_at_least_twenty_sentences():
    assert len(FIXTURE["cases"]) >= 20


def test_tokenizer_matches_llamacpps_ids(tokenizer):
    texts = [case["text"] for case in FIXTURE["cases"]]
    assert tokenizer.encode_texts(texts) == [case["token_ids"] for case in FIXTURE["cases"]]


@pytest.mark.parametrize("kernels", ["native", "numpy"])
def test_embeddings_match_llamacpp(checkpoint, tokenizer, kernels):
    encoder = BertEncoder(checkpoint, _kernels(kernels))
    vectors = encoder.encode(tokenizer.encode_texts([case["text"] for case in FIXTURE["cases"]]))
    assert vectors.shape == (len(FIXTURE["cases"]), 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    cosines = [float(v @ _reference(case)) for v, case in zip(vectors, FIXTURE["cases"], strict=True)]
    assert min(cosines) >= MIN_COSINE, list(zip(cosines, [c["text"] for c in FIXTURE["cases"]], strict=True))


def test_a_vector_does_not_depend_on_its_batch(checkpoint, tokenizer):
    """Native GEMMs are batch-invariant and attention runs per input: bit-identical vectors."""
    encoder = BertEncoder(checkpoint, _kernels("native"))
    ids = tokenizer.encode_texts([case["text"] for case in FIXTURE["cases"]])
    together = encoder.encode(ids)
    for i in (0, 9, len(ids) - 1):
        assert np.array_equal(encoder.encode([ids[i]])[0], together[i])


def test_a_token_array_embeds_as_its_text(checkpoint, tokenizer):
    encoder = BertEncoder(checkpoint, _kernels("native"))
    text_ids = tokenizer.encode_texts(["hello world"])[0]
    assert tokenizer.wrap(text_ids[1:-1]) == text_ids
    assert np.array_equal(encoder.encode([tokenizer.wrap(text_ids[1:-1])]), encoder.encode([text_ids]))


def test_inputs_past_the_limit_are_refused_naming_it(tokenizer):
    ids = tokenizer.wrap([1000] * 255)
    with pytest.raises(InputTooLong, match="at most 256"):
        tokenizer.check(3, ids)
    tokenizer.check(0, ids[:256])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.check(0, tokenizer.wrap([30522]))


def test_erf_matches_the_library_one():
    xs = np.linspace(-6, 6, 2001, dtype=np.float32)
    assert max(abs(float(y) - math.erf(float(x))) for x, y in zip(xs, erf(xs), strict=True)) < 1e-6


def test_models_we_would_compute_wrongly_are_refused(tmp_path):
    from engine.model.bert import read_bert_config

    for name in ("config.json", "modules.json", "sentence_bert_config.json"):
        (tmp_path / name).write_bytes((minilm_model_path() / name).read_bytes())
    (tmp_path / "1_Pooling").mkdir()
    pooling = json.loads((minilm_model_path() / "1_Pooling" / "config.json").read_text())
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(ValueError, match="not the mean of the tokens"):
        read_bert_config(tmp_path)
