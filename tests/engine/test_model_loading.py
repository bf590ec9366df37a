"""Loading the bundled GGUF: metadata, tensors, the ModelSpec the engine core sizes its cache from."""

from __future__ import annotations

import gguf
import numpy as np

from chatmesh.model_files import bundled_model_path
from engine.model.cpu_runner import CpuModelRunner
from engine.model.gguf_loader import read_gguf
from engine.model.runner import ModelSpec


def test_spec_describes_smollm2(native_runner: CpuModelRunner, chat_tokenizer):
    assert native_runner.spec == ModelSpec(
        name="SmolLM2-135M-Instruct",
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=49152,
        context_length=8192,
    )
    assert native_runner.spec.name == chat_tokenizer.model_name
    assert (native_runner.backend, native_runner.tensor_parallel_size) == ("cpu", 1)
    # K and V, 30 layers, 16 positions, 3 kv heads of 64 float16 values
    assert native_runner.kv_bytes_per_block(16) == 2 * 30 * 16 * 3 * 64 * 2


def test_header_reader_agrees_with_ggufs_reader():
    path = bundled_model_path()
    fields, tensors = read_gguf(path)
    reference = gguf.GGUFReader(str(path))
    for key, field in reference.fields.items():
        if key.startswith("GGUF.") or fields[key] is None:  # pseudo-fields; skipped string arrays
            continue
        assert fields[key] == field.contents(), key
    assert len(tensors) == len(reference.tensors)
    for tensor in reference.tensors:
        qtype, (rows, row_length), data = tensors[tensor.name]
        assert qtype == tensor.tensor_type
        assert (row_length, rows) == tuple(int(d) for d in tensor.shape) + (1,) * (2 - len(tensor.shape))
        assert np.asarray(data).tobytes() == np.asarray(tensor.data).tobytes(), tensor.name


def test_quantized_model_weights_reach_the_kernels_unchanged(native_runner: CpuModelRunner, model_checkpoint):
    # The fused q|k|v and gate|up matrices, packed into panels, expand to gguf's dequantized rows exactly.
    layer, packed = model_checkpoint.layers[7], native_runner._layers[7]
    qkv = np.concatenate([layer.wq.dequantize(), layer.wk.dequantize(), layer.wv.dequantize()])
    np.testing.assert_array_equal(native_runner.kernels.unpack(packed.qkv), qkv)
    gate_up = np.concatenate([layer.w_gate.dequantize(), layer.w_up.dequantize()])
    np.testing.assert_array_equal(native_runner.kernels.unpack(packed.gate_up), gate_up)
