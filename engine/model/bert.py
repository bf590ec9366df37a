"""A BERT sentence encoder (all-MiniLM-L6-v2 and its kin): a sentence-transformers directory read into
memory, and its batched forward to one unit vector per input.

The directory is what sentence-transformers saves: ``config.json`` (``model_type`` bert, absolute
positions, GELU), ``model.safetensors``, ``modules.json`` (Transformer → Pooling → Normalize) with the
pooling's ``1_Pooling/config.json`` (mean of the token embeddings) and ``sentence_bert_config.json``
(``max_seq_length``: the longest input the model was trained on; longer inputs are refused upstream,
never cut). Anything else — CLS or max pooling, a Dense head, relative positions — is refused at load,
so a model we would compute wrongly never serves.

The forward packs the batch: the tokens of every input, unpadded, form one ``[T, hidden]`` activation,
so each weight matrix is read once per batch and applied with one GEMM on the engine's kernels (the
native float32 GEMM where it runs; bit-identical whatever rows share the call); attention is
bidirectional within each input, one input at a time, so an input's vector does not depend on the
batch it came in. Per layer (post-norm BERT): fused QKV GEMM + bias → softmax(q kᵀ / √d) v per head →
output GEMM + bias → LayerNorm(x + ·) → GEMM + bias → GELU (erf) → GEMM + bias → LayerNorm(x + ·).
Then the mean over each input's tokens and L2 normalisation, as sentence-transformers' Pooling and
Normalize modules do.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import load_file

from engine.model.checkpoint import WeightMatrix
from engine.model.kernels import Kernels

_MODULES = [
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",
]


@dataclass(frozen=True)
class BertConfig:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    vocab_size: int
    layer_norm_eps: float
    max_positions: int  # the position table's length
    max_tokens: int  # sentence-transformers' max_seq_length: the longest input taken, specials included

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(eq=False)
class BertLayer:
    qkv: WeightMatrix  # [3 * hidden, hidden]: q, k, v rows
    qkv_bias: np.ndarray
    wo: WeightMatrix
    wo_bias: np.ndarray
    attn_norm: tuple[np.ndarray, np.ndarray]  # LayerNorm weight, bias
    up: WeightMatrix  # [intermediate, hidden]
    up_bias: np.ndarray
    down: WeightMatrix  # [hidden, intermediate]
    down_bias: np.ndarray
    ffn_norm: tuple[np.ndarray, np.ndarray]


@dataclass(eq=False)
class BertCheckpoint:
    config: BertConfig
    word_embeddings: np.ndarray  # float32 [vocab, hidden]
    position_embeddings: np.ndarray  # [max_positions, hidden]
    token_type_embedding: np.ndarray  # [hidden]: type 0's, the only type a single sentence has
    embedding_norm: tuple[np.ndarray, np.ndarray]
    layers: list[BertLayer]


def is_sentence_encoder_dir(path: str | Path) -> bool:
    """True for a directory whose config.json declares a BERT model (an embedding model to serve)."""
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "bert"


def read_bert_config(path: str | Path) -> BertConfig:
    """The model's shape, checked against what ``BertEncoder`` computes."""
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    problems = []
    if hf.get("model_type") != "bert":
        problems.append(f"model_type {hf.get('model_type')!r} is not bert")
    if hf.get("hidden_act", "gelu") != "gelu":
        problems.append(f"hidden_act {hf['hidden_act']!r} is not gelu")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type {hf['position_embedding_type']!r} is not absolute")
    modules_file = path / "modules.json"
    modules = json.loads(modules_file.read_text()) if modules_file.is_file() else []
    if [m.get("type") for m in modules] != _MODULES:
        problems.append("modules.json is not Transformer → Pooling → Normalize")
    else:
        pooling = json.loads((path / modules[1]["path"] / "config.json").read_text())
        modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode") and v)
        if modes != ["pooling_mode_mean_tokens"]:
            problems.append(f"pooling {modes} is not the mean of the tokens")
    if problems:
        raise ValueError(f"{path}: not a sentence encoder this engine computes: {'; '.join(problems)}")
    st_config = path / "sentence_bert_config.json"
    positions = int(hf["max_position_embeddings"])
    max_tokens = json.loads(st_config.read_text()).get("max_seq_length") if st_config.is_file() else None
    return BertConfig(
        name=path.name,
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_heads=int(hf["num_attention_heads"]),
        vocab_size=int(hf["vocab_size"]),
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        max_positions=positions,
        max_tokens=min(int(max_tokens or positions), positions),
    )


def load_bert(path: str | Path) -> BertCheckpoint:
    path = Path(path)
    config = read_bert_config(path)
    tensors = load_file(path / "model.safetensors")

    def tensor(name: str) -> np.ndarray:
        for key in (name, "bert." + name):  # saved from BertModel, or from a model that wraps one
            if key in tensors:
                return np.ascontiguousarray(tensors[key], dtype=np.float32)
        raise ValueError(f"{path}: tensor {name} is missing")

    def matrix(name: str, *parts: str) -> WeightMatrix:
        data = np.concatenate([tensor(p + ".weight") for p in parts]) if parts else tensor(name + ".weight")
        return WeightMatrix(name, QType.F32, (data.shape[0], data.shape[1]), data)

    def norm(name: str) -> tuple[np.ndarray, np.ndarray]:
        return tensor(name + ".weight"), tensor(name + ".bias")

    def layer(i: int) -> BertLayer:
        p = f"encoder.layer.{i}."
        qkv = [p + "attention.self." + n for n in ("query", "key", "value")]
        return BertLayer(
            qkv=matrix(p + "qkv", *qkv),
            qkv_bias=np.concatenate([tensor(n + ".bias") for n in qkv]),
            wo=matrix(p + "attention.output.dense"),
            wo_bias=tensor(p + "attention.output.dense.bias"),
            attn_norm=norm(p + "attention.output.LayerNorm"),
            up=matrix(p + "intermediate.dense"),
            up_bias=tensor(p + "intermediate.dense.bias"),
            down=matrix(p + "output.dense"),
            down_bias=tensor(p + "output.dense.bias"),
            ffn_norm=norm(p + "output.LayerNorm"),
        )

    return BertCheckpoint(
        config=config,
        word_embeddings=tensor("embeddings.word_embeddings.weight"),
        position_embeddings=tensor("embeddings.position_embeddings.weight"),
        token_type_embedding=tensor("embeddings.token_type_embeddings.weight")[0],
        embedding_norm=norm("embeddings.LayerNorm"),
        layers=[layer(i) for i in range(config.num_layers)],
    )


@dataclass(eq=False)
class _PackedLayer:
    """A layer as the forward reads it: its matrices in the kernels' layout (the checkpoint's float32
    copies are not kept: they would double the engine's memory), its biases and norms."""

    qkv: object
    qkv_bias: np.ndarray
    wo: object
    wo_bias: np.ndarray
    attn_norm: tuple[np.ndarray, np.ndarray]
    up: object
    up_bias: np.ndarray
    down: object
    down_bias: np.ndarray
    ffn_norm: tuple[np.ndarray, np.ndarray]


class BertEncoder:
    """The forward of one checkpoint on one set of kernels. Not thread-safe: one batch at a time."""

    def __init__(self, checkpoint: BertCheckpoint, kernels: Kernels) -> None:
        self.config = checkpoint.config
        self.kernels = kernels
        self._word_embeddings = checkpoint.word_embeddings
        self._position_embeddings = checkpoint.position_embeddings
        self._token_type_embedding = checkpoint.token_type_embedding
        self._embedding_norm = checkpoint.embedding_norm
        pack = kernels.pack
        self._layers = [
            _PackedLayer(
                pack(layer.qkv),
                layer.qkv_bias,
                pack(layer.wo),
                layer.wo_bias,
                layer.attn_norm,
                pack(layer.up),
                layer.up_bias,
                pack(layer.down),
                layer.down_bias,
                layer.ffn_norm,
            )
            for layer in checkpoint.layers
        ]

    def encode(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """Unit vectors float32 ``[len(inputs), hidden]`` of token-id inputs (each with its [CLS] and
        [SEP], 1 to ``max_tokens`` ids below the vocabulary size: the caller checked)."""
        cfg, ops = self.config, self.kernels
        lengths = [len(ids) for ids in inputs]
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        token_ids = np.fromiter((t for ids in inputs for t in ids), dtype=np.int64, count=int(starts[-1]))
        positions = np.concatenate([np.arange(n) for n in lengths])
        x = (
            self._word_embeddings[token_ids]
            + self._position_embeddings[positions]
            + self._token_type_embedding
        )
        x = _layer_norm(x, self._embedding_norm, cfg.layer_norm_eps)
        hidden = cfg.hidden_size
        for layer in self._layers:
            qkv = ops.linear(x, layer.qkv)
            qkv += layer.qkv_bias
            attn = ops.linear(self._attention(qkv, starts), layer.wo)
            attn += layer.wo_bias
            attn += x
            x = _layer_norm(attn, layer.attn_norm, cfg.layer_norm_eps)
            h = ops.linear(x, layer.up)
            h += layer.up_bias
            out = ops.linear(_gelu(h), layer.down)
            out += layer.down_bias
            out += x
            x = _layer_norm(out, layer.ffn_norm, cfg.layer_norm_eps)
        pooled = np.add.reduceat(x, starts[:-1], axis=0) / np.asarray(lengths, np.float32)[:, None]
        assert pooled.dtype == np.float32 and pooled.shape[1] == hidden
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

    def _attention(self, qkv: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Bidirectional attention of each input's tokens over that input's tokens only."""
        heads, hd = self.config.num_heads, self.config.head_dim
        width = heads * hd
        scale = np.float32(1.0 / np.sqrt(hd))
        out = np.empty((len(qkv), width), dtype=np.float32)
        for r0, r1 in itertools.pairwise(starts.tolist()):
            per_head = qkv[r0:r1].reshape(r1 - r0, 3, heads, hd).transpose(1, 2, 0, 3)  # [3, H, L, d]
            q, k, v = per_head[0], per_head[1], per_head[2]
            scores = np.matmul(q, k.transpose(0, 2, 1))
            scores *= scale
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores, out=scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            out[r0:r1] = np.matmul(probs, v).transpose(1, 0, 2).reshape(r1 - r0, width)
        return out


def _layer_norm(x: np.ndarray, norm: tuple[np.ndarray, np.ndarray], eps: float) -> np.ndarray:
    centred = x - x.mean(axis=-1, keepdims=True)
    variance = np.mean(centred * centred, axis=-1, keepdims=True)
    centred *= 1.0 / np.sqrt(variance + np.float32(eps))
    centred *= norm[0]
    centred += norm[1]
    return centred


# erf(x) = x P(x²) / Q(x²) on [-4, 4] (±1 outside), float32 to about 1e-7: Eigen's rational form, as
# PyTorch's CPU GELU computes it. numpy has no erf, and BERT's GELU is the erf one, not the tanh one.
_ERF_P = np.array(
    [
        -2.72614225801306e-10,
        2.77068142495902e-08,
        -2.10102402082508e-06,
        -5.69250639462346e-05,
        -7.34990630326855e-04,
        -2.95459980854025e-03,
        -1.60960333262415e-02,
    ],
    dtype=np.float32,
)
_ERF_Q = np.array(
    [
        -1.45660718464996e-05,
        -2.13374055278905e-04,
        -1.68282697438203e-03,
        -7.37332916720468e-03,
        -1.42647390514189e-02,
    ],
    dtype=np.float32,
)


def erf(x: np.ndarray) -> np.ndarray:
    x = np.clip(x, np.float32(-4.0), np.float32(4.0))
    x2 = x * x
    p = np.full_like(x, _ERF_P[0])
    for c in _ERF_P[1:]:
        p *= x2
        p += c
    q = np.full_like(x, _ERF_Q[0])
    for c in _ERF_Q[1:]:
        q *= x2
        q += c
    return x * p / q


def _gelu(x: np.ndarray) -> np.ndarray:
    """x Φ(x) = x (1 + erf(x / √2)) / 2."""
    return x * (np.float32(0.5) + np.float32(0.5) * erf(x * np.float32(0.7071067811865476)))
