"""``python -m engine.model.convert_gguf_to_hf MODEL.gguf OUTDIR``: a GGUF LLaMA as a Hugging Face directory.

Writes ``config.json``, ``model.safetensors`` (dequantized weights, float32 by default or float16),
``tokenizer.json``, ``tokenizer_config.json`` (with the chat template) and ``generation_config.json``.
Q and K rows go back to HF's half-split RoPE order (the inverse of llama.cpp's permutation), so the
directory loads in Hugging Face transformers, TensorRT-LLM and vLLM as well as in our engine.

In float32 the weights are exactly the GGUF's dequantized values: our engine loading the directory
computes the same logits as loading the GGUF (tests/engine/test_model_hf_dir.py holds it to that).
Quantization is not undone — the directory is as accurate as the GGUF, no more.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from chatmesh.tokenizer import ChatTokenizer
from engine.model.checkpoint import LlamaCheckpoint
from engine.model.gguf_loader import load_gguf
from engine.model.hf_loader import to_half_split

log = logging.getLogger(__name__)

DTYPES: dict[str, type[np.floating]] = {"float32": np.float32, "float16": np.float16}


def hf_tensors(checkpoint: LlamaCheckpoint, dtype: type[np.floating] = np.float32) -> dict[str, np.ndarray]:
    """The checkpoint's weights under HF LLaMA names, ``[out, in]``, Q/K rows in half-split order."""
    cfg = checkpoint.config
    tensors = {"model.embed_tokens.weight": checkpoint.token_embedding.dequantize()}
    for i, layer in enumerate(checkpoint.layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": layer.attn_norm,
            p + "self_attn.q_proj.weight": to_half_split(layer.wq.dequantize(), cfg.num_heads),
            p + "self_attn.k_proj.weight": to_half_split(layer.wk.dequantize(), cfg.num_kv_heads),
            p + "self_attn.v_proj.weight": layer.wv.dequantize(),
            p + "self_attn.o_proj.weight": layer.wo.dequantize(),
            p + "post_attention_layernorm.weight": layer.ffn_norm,
            p + "mlp.gate_proj.weight": layer.w_gate.dequantize(),
            p + "mlp.up_proj.weight": layer.w_up.dequantize(),
            p + "mlp.down_proj.weight": layer.w_down.dequantize(),
        }
    tensors["model.norm.weight"] = checkpoint.output_norm
    if checkpoint.lm_head is not checkpoint.token_embedding:
        tensors["lm_head.weight"] = checkpoint.lm_head.dequantize()
    return {name: np.ascontiguousarray(t, dtype=dtype) for name, t in tensors.items()}


def hf_config(checkpoint: LlamaCheckpoint, tokenizer: ChatTokenizer, dtype: str) -> dict:
    cfg = checkpoint.config
    return {
        "_name_or_path": cfg.name,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.context_length,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": checkpoint.lm_head is checkpoint.token_embedding,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_ids[0],
        "torch_dtype": dtype,
    }


def convert(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Writes the HF directory for ``gguf_path`` into ``out_dir`` (created if needed); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log.info("reading %s", gguf_path)
    checkpoint = load_gguf(gguf_path)
    cfg = checkpoint.config
    # The directory would be a plain LlamaForCausalLM: without the architecture's own layers and norms,
    # its window or its RoPE frequency factors.
    if cfg.architecture != "llama":
        raise ValueError(f"{gguf_path}: only the llama architecture converts, not {cfg.architecture!r}")
    if cfg.layer_windows or cfg.rope_freq_factors:
        what = "a sliding window" if cfg.layer_windows else "RoPE frequency factors (rope_freqs.weight)"
        raise ValueError(
            f"{gguf_path}: a llama with {what} does not convert (a plain LlamaForCausalLM has none)"
        )
    tokenizer = ChatTokenizer.from_gguf(gguf_path)
    log.info("dequantizing %d layers to %s", checkpoint.config.num_layers, dtype)
    save_file(hf_tensors(checkpoint, DTYPES[dtype]), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(checkpoint, tokenizer, dtype), indent=2))
    generation = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": list(tokenizer.eos_token_ids),
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer.save_hf_files(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", help="the GGUF file (a LLaMA with a byte-level BPE tokenizer)")
    parser.add_argument("out_dir", help="directory to write (created if missing; files are overwritten)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.monotonic()
    out = convert(args.gguf, args.out_dir, args.dtype)
    log.info("wrote %s in %.1f s", out, time.monotonic() - started)


if __name__ == "__main__":
    main()
