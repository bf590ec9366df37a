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

from engine.model.cuda_runner import head_rows
from engine.model.tp.plan import plan_tensor_parallel
from tests.engine.paged_driver import PagedDriver
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


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tensor_parallel_shares_sum_to_the_unsharded_layer(model_checkpoint, world):
    # The CUDA runner cuts the dequantized weights by the CPU engine's plan. Column-parallel gate|up and
    # row-parallel down: each rank computes its share of the FFN from the full input; the all-reduce (a
    # sum) of the shares is the unsharded FFN output. Same for attention's output projection per head.
    cfg = model_checkpoint.config
    layer = model_checkpoint.layers[3]
    x = np.random.default_rng(0).standard_normal((4, cfg.hidden_size)).astype(np.float32)
    gate, up, down = layer.w_gate.dequantize(), layer.w_up.dequantize(), layer.w_down.dequantize()
    wo = layer.wo.dequantize()
    attn = np.random.default_rng(1).standard_normal((4, cfg.num_heads * cfg.head_dim)).astype(np.float32)

    def ffn(g, u, d):
        a = x @ g.T
        return (a / (1 + np.exp(-a)) * (x @ u.T)) @ d.T

    shards = plan_tensor_parallel(cfg, world, quant_block=1).shards
    ffn_shares, out_shares = [], []
    for shard in shards:
        cols, q = shard.ffn_columns.as_slice(), head_rows(shard.q_heads, cfg.head_dim)
        ffn_shares.append(ffn(gate[cols], up[cols], down[:, cols]))
        out_shares.append(attn[:, q] @ wo[:, q].T)
    np.testing.assert_allclose(sum(ffn_shares), ffn(gate, up, down), atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(sum(out_shares), attn @ wo.T, atol=2e-4, rtol=1e-4)
    assert sum(s.q_heads.size for s in shards) == cfg.num_heads


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
