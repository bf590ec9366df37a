"""Hugging Face directories: the GGUF → HF converter, the HF loader, the tokenizer from tokenizer.json,
and a real engine process serving a converted directory.

Tolerances: the converter writes float32 weights that are exactly the GGUF's dequantized values, and
the RoPE permutation there and back is exact, so the reference forward over the directory gives the
GGUF's logits bit for bit (asserted exactly). The cpu runner packs float32 panels where the GGUF had
Q4_1 blocks, so it sums in another order: it is held to the reference with ``LOGIT_TOL`` as in
test_model_parity.
"""

from __future__ import annotations

import json
import struct

import grpc
import numpy as np
import pytest
import tokenizers

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.model_files import bundled_model_path
from chatmesh.tokenizer import ChatMessage, ChatTokenizer, load_tokenizer
from engine.model.checkpoint import LlamaCheckpoint, rope_tables
from engine.model.checkpoint_loader import load_checkpoint
from engine.model.convert_gguf_to_hf import convert
from engine.model.cpu_runner import CpuModelRunner
from engine.model.hf_loader import load_hf_dir, read_safetensors, to_half_split, to_interleaved
from engine.model.kernels import select_kernels
from tests.engine.paged_driver import PagedDriver
from tests.engine.reference_model import ReferenceModel, _rope
from tests.engine.service_client import TIMEOUT_S, Stream, start_frame
from tests.engine.test_model_parity import LOGIT_TOL, assert_greedy_matches_reference

CHAT = [ChatMessage("user", "Translate 'good morning' into Spanish.")]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return convert(bundled_model_path(), tmp_path_factory.mktemp("hf") / "SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def hf_checkpoint(hf_dir) -> LlamaCheckpoint:
    return load_hf_dir(hf_dir)


def test_converted_directory_has_the_files_hf_tools_expect(hf_dir):
    names = {p.name for p in hf_dir.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["tie_word_embeddings"] is True
    # The tied LM head is not stored twice; Q/K are stored in HF's half-split order.
    assert "lm_head.weight" not in read_safetensors(hf_dir / "model.safetensors")


def test_loaded_weights_are_the_ggufs_dequantized_weights(hf_checkpoint, model_checkpoint):
    assert hf_checkpoint.config == model_checkpoint.config
    assert hf_checkpoint.lm_head is hf_checkpoint.token_embedding
    np.testing.assert_array_equal(
        hf_checkpoint.token_embedding.dequantize_rows(np.arange(100)),
        model_checkpoint.token_embedding.dequantize_rows(np.arange(100)),
    )
    for i in (0, 17, 29):
        ours, theirs = hf_checkpoint.layers[i], model_checkpoint.layers[i]
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            np.testing.assert_array_equal(
                getattr(ours, name).dequantize(), getattr(theirs, name).dequantize(), err_msg=f"{i}.{name}"
            )
        np.testing.assert_array_equal(ours.attn_norm, theirs.attn_norm)


def test_directory_gives_the_same_logits_as_the_gguf(hf_checkpoint, reference_model, chat_tokenizer):
    prompt = chat_tokenizer.encode_chat(CHAT)
    ours = ReferenceModel(hf_checkpoint).logits(prompt)
    np.testing.assert_array_equal(ours, reference_model.logits(prompt))


def test_cpu_runner_on_the_directory_matches_the_reference(hf_checkpoint, reference_model, chat_tokenizer):
    runner = CpuModelRunner(hf_checkpoint, select_kernels(None, None, hf_checkpoint.config))
    driver = PagedDriver(runner, num_blocks=32)
    [gen] = driver.generate([chat_tokenizer.encode_chat(CHAT)], max_new_tokens=6, keep_logits=True)
    assert_greedy_matches_reference(gen, reference_model)
    runner.close()


def test_half_split_rope_on_hf_rows_equals_interleaved_rope_on_permuted_rows(model_checkpoint):
    # The permutation must turn HF's rotate_half RoPE into the interleaved one, head by head: a wrong
    # direction or head count would still round-trip, but would rotate the wrong dimension pairs.
    cfg = model_checkpoint.config
    rng = np.random.default_rng(0)
    hf_rows = rng.standard_normal((cfg.num_kv_heads * cfg.head_dim, 8)).astype(np.float32)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    tables = rope_tables(cfg, 5)
    k_hf = (x @ hf_rows.T).reshape(5, cfg.num_kv_heads, cfg.head_dim)
    half = cfg.head_dim // 2
    c, s = tables.cos[:, None, :], tables.sin[:, None, :]
    rotated_hf = np.concatenate(
        [k_hf[..., :half] * c - k_hf[..., half:] * s, k_hf[..., half:] * c + k_hf[..., :half] * s], axis=-1
    )
    gguf_rows = to_interleaved(hf_rows, cfg.num_kv_heads)
    rotated_gguf = _rope((x @ gguf_rows.T).reshape(5, cfg.num_kv_heads, cfg.head_dim), tables)
    # Same rotation, reported in each layout's dimension order: map HF's back to interleaved.
    as_interleaved = to_interleaved(rotated_hf.reshape(5, -1).T, cfg.num_kv_heads).T.reshape(
        rotated_gguf.shape
    )
    np.testing.assert_allclose(as_interleaved, rotated_gguf, atol=1e-5)
    np.testing.assert_array_equal(to_half_split(gguf_rows, cfg.num_kv_heads), hf_rows)


def test_bfloat16_tensors_widen_exactly(tmp_path):
    values = np.array([[1.0, -2.5], [3.140625, 65280.0]], dtype=np.float32)  # exact in bfloat16
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, bits.nbytes]}}).encode()
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bits.tobytes())
    np.testing.assert_array_equal(read_safetensors(path)["w"], values)


def test_directory_tokenizer_is_the_ggufs(hf_dir, chat_tokenizer):
    ours = ChatTokenizer.from_hf_dir(hf_dir)
    assert (ours.model_name, ours.fingerprint) == (chat_tokenizer.model_name, chat_tokenizer.fingerprint)
    assert (ours.bos_token_id, ours.eos_token_ids) == (
        chat_tokenizer.bos_token_id,
        chat_tokenizer.eos_token_ids,
    )
    messages = [*CHAT, ChatMessage("assistant", "Buenos días"), ChatMessage("user", "Typed <|im_end|> 12345")]
    assert ours.encode_chat(messages) == chat_tokenizer.encode_chat(messages)
    assert load_tokenizer(str(hf_dir)).fingerprint == chat_tokenizer.fingerprint


def test_the_process_keeps_one_tokenizer_per_fingerprint_whichever_path_loaded_it(hf_dir, chat_tokenizer):
    assert load_tokenizer(str(hf_dir)) is chat_tokenizer


def test_a_tokenizer_with_another_pre_tokenizer_is_refused(hf_dir, tmp_path):
    for name in ("tokenizer_config.json", "config.json"):
        (tmp_path / name).write_text((hf_dir / name).read_text())
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="pre-tokenizer"):
        ChatTokenizer.from_hf_dir(tmp_path)


def test_hugging_face_tokenizers_read_the_written_tokenizer_json(hf_dir, chat_tokenizer):
    text = "Zürich has 400000 people; naïve café ☕"
    hf = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert hf.encode(text, add_special_tokens=False).ids == chat_tokenizer.encode(text)


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="without config"):
        load_checkpoint(tmp_path)


@pytest.mark.slow
async def test_engine_process_serves_the_converted_directory(
    start_engines, hf_dir, chat_tokenizer, reference_model
):
    [engine] = start_engines(1, "cpu", model=hf_dir, num_kv_blocks=64)
    prompt = chat_tokenizer.encode_chat(CHAT)
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT_S)
        assert (info.model, info.tokenizer_fingerprint) == (
            chat_tokenizer.model_name,
            chat_tokenizer.fingerprint,
        )
        assert info.backend == "cpu"
        outcome = await Stream.start(stub, start_frame("hf-1", prompt, max_tokens=6)).rest()
    # Greedy (temperature 0): each token is the reference's choice, or within a near-tie of it.
    expected = reference_model.logits(prompt + outcome.token_ids[:-1])[len(prompt) - 1 :]
    assert len(outcome.token_ids) == 6
    for token, logits in zip(outcome.token_ids, expected, strict=True):
        assert logits.max() - logits[token] < LOGIT_TOL
