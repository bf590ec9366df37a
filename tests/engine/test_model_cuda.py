"""The CUDA runner: import-safe without torch, a clear refusal without it, and its tensor-parallel plan.

torch is not installed here (PyPI's Linux torch needs the CUDA libraries; there is no GPU), so the
runner's forward never ran in this project's CI. ``test_cuda_runner_matches_the_reference`` runs it
wherever torch is installed (on a CUDA device if there is one, else on the CPU in float32).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from engine.model.cuda_runner import shard_columns, shard_rows
from engine.model.paged_driver import PagedDriver
from tests.engine.test_model_parity import assert_greedy_matches_reference

HAS_TORCH = importlib.util.find_spec("torch") is not None


def test_the_module_imports_without_torch():
    code = "import sys, engine.model.cuda_runner, engine.model.loading; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "False"


@pytest.mark.skipif(HAS_TORCH, reason="torch is installed")
def test_engine_process_with_cuda_but_no_torch_exits_with_instructions():
    done = subprocess.run(
        [sys.executable, "-m", "engine", "--backend", "cuda", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "needs PyTorch" in done.stderr and "docs/gpu.md" in done.stderr


@pytest.mark.parametrize("world", [1, 3])
def test_tensor_parallel_shards_sum_to_the_unsharded_layer(model_checkpoint, world):
    # Column-parallel gate|up and row-parallel down: each rank computes its share of the FFN from the
    # full input; the all-reduce (a sum) of the shares is the unsharded FFN output.
    layer = model_checkpoint.layers[3]
    x = np.random.default_rng(0).standard_normal((4, model_checkpoint.config.hidden_size)).astype(np.float32)
    gate, up, down = layer.w_gate.dequantize(), layer.w_up.dequantize(), layer.w_down.dequantize()

    def ffn(g, u, d):
        a = x @ g.T
        return (a / (1 + np.exp(-a)) * (x @ u.T)) @ d.T

    shares = [
        ffn(shard_rows(gate, r, world), shard_rows(up, r, world), shard_columns(down, r, world))
        for r in range(world)
    ]
    np.testing.assert_allclose(sum(shares), ffn(gate, up, down), atol=2e-4, rtol=1e-4)
    # Query heads stay whole: rank r holds heads [r * heads / world, (r + 1) * heads / world).
    head_rows = model_checkpoint.config.head_dim * model_checkpoint.config.num_heads // world
    np.testing.assert_array_equal(
        shard_rows(layer.wq.dequantize(), world - 1, world), layer.wq.dequantize()[-head_rows:]
    )


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (it is an optional extra; docs/gpu.md)")
def test_cuda_runner_matches_the_reference(model_checkpoint, reference_model, chat_tokenizer):
    import torch

    from engine.model.cuda_runner import CudaModelRunner

    device, dtype = ("cuda", "float32") if torch.cuda.is_available() else ("cpu", "float32")
    runner = CudaModelRunner(model_checkpoint, device=device, dtype=dtype)
    driver = PagedDriver(runner, num_blocks=64, shuffle_seed=1)
    prompts = [
        chat_tokenizer.encode_chat([{"role": "user", "content": t}]) for t in ("Hi!", "Name a colour.")
    ]
    for gen in driver.generate(prompts, max_new_tokens=6, prefill_chunk=7, keep_logits=True):
        assert_greedy_matches_reference(gen, reference_model)
    runner.close()
