"""Hugging Face model directory → ``LlamaCheckpoint``: ``config.json`` plus ``*.safetensors`` shards.

The safetensors files are memory-mapped and read here rather than through the ``safetensors`` package:
its numpy API cannot represent bfloat16 (the dtype most HF checkpoints ship in), and a mapped view costs
no copy for float32/float16. The format is a little-endian u64 header length, a JSON header
``{name: {dtype, shape, data_offsets: [begin, end]}}`` and the raw tensor bytes after it.

Weights keep float32/float16 as stored (the runners pack or dequantize them like GGUF float tensors);
bfloat16 is widened to float32 once at load time, which is exact.

RoPE layout: HF's ``q_proj``/``k_proj`` rows are in *half-split* order (rotate_half pairs dim i with
i + head_dim/2); ``LlamaCheckpoint`` holds GGUF's *interleaved* order, so Q and K rows are permuted the
way llama.cpp's converter does (``to_interleaved``). ``to_half_split`` is the inverse, used by the
GGUF → HF converter.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType

from chatmesh.tokenizer import hf_model_name
from engine.model.checkpoint import LlamaCheckpoint, LlamaConfig, LlamaLayer, WeightMatrix

CONFIG_FILE = "config.json"

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def is_hf_dir(path: str | Path) -> bool:
    """True for a directory holding a ``config.json`` (a Hugging Face model directory)."""
    return Path(path).is_dir() and (Path(path) / CONFIG_FILE).is_file()


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Tensors of one ``.safetensors`` file as read-only views of the mapped file (BF16 as uint16 bits)."""
    path = Path(path)
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    buf = np.memmap(path, mode="r")
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}; supported: F32, F16, BF16")
        begin, end = info["data_offsets"]
        raw = buf[base + begin : base + end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
        tensors[name] = _bf16_to_f32(raw) if info["dtype"] == "BF16" else raw
    return tensors


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32: shifting the bits back is exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_interleaved(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """HF half-split Q/K rows → GGUF interleaved-pair order (llama.cpp's ``permute``)."""
    out, rest = rows.shape[0], rows.shape[1:]
    return rows.reshape(num_heads, 2, out // num_heads // 2, *rest).swapaxes(1, 2).reshape(rows.shape)


def to_half_split(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """GGUF interleaved-pair Q/K rows → HF half-split order (the inverse of ``to_interleaved``)."""
    out, rest = rows.shape[0], rows.shape[1:]
    return rows.reshape(num_heads, out // num_heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows.shape)


def read_hf_config(path: str | Path) -> dict:
    config = json.loads((Path(path) / CONFIG_FILE).read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{path}: model_type {config.get('model_type')!r} is not supported (only llama)")
    if config.get("rope_scaling"):
        raise ValueError(f"{path}: RoPE scaling is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {config['hidden_act']!r} is not supported (only silu)")
    return config


def hf_llama_config(path: str | Path) -> LlamaConfig:
    """The model's shape from ``config.json`` alone, checked against what our runners compute."""
    hf = read_hf_config(path)
    hidden, num_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    return LlamaConfig(
        name=hf_model_name(path, hf),
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        vocab_size=int(hf["vocab_size"]),
        context_length=int(hf["max_position_embeddings"]),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf["rms_norm_eps"]),
    )


def load_hf_dir(path: str | Path) -> LlamaCheckpoint:
    path = Path(path)
    config = hf_llama_config(path)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{path}: no .safetensors files (pytorch .bin checkpoints are not supported)")
    tensors: dict[str, np.ndarray] = {}
    for shard in shards:
        tensors.update(read_safetensors(shard))
    num_heads, num_kv_heads = config.num_heads, config.num_kv_heads

    def tensor(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name} is missing")
        return tensors[name]

    def matrix(name: str, rope_heads: int = 0) -> WeightMatrix:
        data = tensor(name)
        if rope_heads:
            data = to_interleaved(data, rope_heads)
        qtype = QType.F16 if data.dtype == np.float16 else QType.F32
        return WeightMatrix(name, qtype, data.shape, data)

    def vector(name: str) -> np.ndarray:
        return np.asarray(tensor(name), dtype=np.float32)

    def layer(i: int) -> LlamaLayer:
        p = f"model.layers.{i}."
        return LlamaLayer(
            attn_norm=vector(p + "input_layernorm.weight"),
            wq=matrix(p + "self_attn.q_proj.weight", rope_heads=num_heads),
            wk=matrix(p + "self_attn.k_proj.weight", rope_heads=num_kv_heads),
            wv=matrix(p + "self_attn.v_proj.weight"),
            wo=matrix(p + "self_attn.o_proj.weight"),
            ffn_norm=vector(p + "post_attention_layernorm.weight"),
            w_gate=matrix(p + "mlp.gate_proj.weight"),
            w_up=matrix(p + "mlp.up_proj.weight"),
            w_down=matrix(p + "mlp.down_proj.weight"),
        )

    embedding = matrix("model.embed_tokens.weight")
    tied = "lm_head.weight" not in tensors  # tie_word_embeddings: HF files then omit lm_head
    lm_head = embedding if tied else matrix("lm_head.weight")
    return LlamaCheckpoint(
        config, embedding, [layer(i) for i in range(config.num_layers)], vector("model.norm.weight"), lm_head
    )
