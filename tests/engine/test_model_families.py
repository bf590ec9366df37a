"""The families that differ from LLaMA only in details, against llama.cpp on the same files: Llama 3 (RoPE
frequency factors), Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm, head size other than hidden /
heads) and Mistral (a sliding window on every layer). Each is a tiny random-weight GGUF written from a
seed (tests/fixtures/family_ggufs.py); tests/data/family_llamacpp.json holds llama.cpp's logits and each
file's SHA-256 (bench/make_family_fixtures.py), so the file compared is the one llama.cpp ran.

This proves each architecture's arithmetic, not the families' own tokenizers (the files carry SmolLM2's;
the prompts are token ids): those tokenizers are refused (test_model_refusals.py).

Tolerance: both sides hold float16 KV and read the same weights exactly; llama.cpp multiplies qwen2's
float16 weights by activations it rounds to float16 (we keep float32), sums in another order and computes
its RoPE tables in float32 (ours: float64, rounded once). Measured over the top 32 and 32 sampled ids of
four prompts per family, logits spread over ~±20: at most 0.0071 apart (qwen2), 0.0023 elsewhere, native
and numpy kernels alike. LOGIT_TOL allows 7x that; switching a family's detail off moves its longest
prompt's logits by 1.2 (qwen3's q/k norm) to 5.8 (qwen2's biases), measured below. Top-k: the same set
of the TOP likeliest ids where llama.cpp's TOP-th and next are more than NEAR_TIE apart (random weights
make near-ties).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.model.checkpoint import LlamaCheckpoint
from engine.model.cpu_runner import CpuModelRunner
from engine.model.gguf_loader import load_gguf
from engine.model.kernels import select_kernels
from engine.model.kernels.native import NativeKernels
from engine.model.tp.runner import TensorParallelRunner
from tests.engine.paged_driver import PagedDriver
from tests.fixtures.family_ggufs import FAMILIES, write_family_gguf
from tests.fixtures.model import require_native

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "family_llamacpp.json"
LOGIT_TOL = 0.05
TOP = 5
NEAR_TIE = 0.01


@pytest.fixture(scope="module")
def llamacpp() -> dict:
    return json.loads(FIXTURE.read_text())["families"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, LlamaCheckpoint]:
    directory = tmp_path_factory.mktemp("families")
    return {name: load_gguf(write_family_gguf(f, directory / f"{name}.gguf")) for name, f in FAMILIES.items()}


def last_logits(checkpoint: LlamaCheckpoint, prompts: list[list[int]], kernels: str | None = None) -> list:
    runner = CpuModelRunner(checkpoint, select_kernels(kernels, None, checkpoint.config))
    gens = PagedDriver(runner, num_blocks=64, shuffle_seed=5).generate(prompts, 1, keep_logits=True)
    return [gen.logits[0] for gen in gens]


def worst_difference(ours: np.ndarray, case: dict) -> float:
    ids = case["top_token_ids"] + case["sampled_token_ids"]
    theirs = np.array(case["top_logits"] + case["sampled_logits"])
    return float(np.abs(ours[ids] - theirs).max())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_file_is_the_one_llama_cpp_ran(tmp_path: Path, llamacpp, family: str) -> None:
    path = write_family_gguf(FAMILIES[family], tmp_path / "model.gguf")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == llamacpp[family]["gguf_sha256"]


@pytest.mark.parametrize("kernels", ["native", "numpy"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_next_token_logits_agree_with_llama_cpp(checkpoints, llamacpp, family: str, kernels: str) -> None:
    if kernels == "native":
        require_native()
    cases = llamacpp[family]["cases"]
    ours = last_logits(checkpoints[family], [c["prompt_token_ids"] for c in cases], kernels)
    for logits, case in zip(ours, cases, strict=True):
        assert worst_difference(logits, case) < LOGIT_TOL, (len(case["prompt_token_ids"]), family)
        top = np.array(case["top_logits"])
        if top[TOP - 1] - top[TOP] > NEAR_TIE:
            assert set(np.argsort(-logits)[:TOP].tolist()) == set(case["top_token_ids"][:TOP])


def test_mistral_windowed_prompts_are_compared_past_the_window(llamacpp) -> None:
    """llama.cpp ignores the key on `llama` (measured by the generator), so past the window the fixture
    holds llama.cpp's logits of the window's tokens alone."""
    entry, window = llamacpp["mistral"], FAMILIES["mistral"].sliding_window
    assert entry["window_ignored_by_llamacpp"] is True
    past = [c for c in entry["cases"] if len(c["prompt_token_ids"]) > window]
    assert past and all(c["llamacpp_token_ids"] == c["prompt_token_ids"][-window:] for c in past)


@pytest.mark.parametrize(
    ("family", "switched_off"),
    [
        ("llama3", lambda c: replace(c, config=replace(c.config, rope_freq_factors=()))),
        ("qwen2", lambda c: replace(c, layers=[replace(layer, qkv_bias=None) for layer in c.layers])),
        (
            "qwen3",
            lambda c: replace(c, layers=[replace(layer, q_norm=None, k_norm=None) for layer in c.layers]),
        ),
        ("mistral", lambda c: replace(c, config=replace(c.config, layer_windows=()))),
    ],
)
def test_each_detail_is_what_brings_the_logits_to_llama_cpps(
    checkpoints, llamacpp, family, switched_off
) -> None:
    """Without its detail a family's longest prompt parts from llama.cpp by far more than LOGIT_TOL."""
    case = llamacpp[family]["cases"][-1]
    (logits,) = last_logits(switched_off(checkpoints[family]), [case["prompt_token_ids"]], "numpy")
    assert worst_difference(logits, case) > 10 * LOGIT_TOL


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "llama3"])
def test_a_sequence_computes_the_same_alone_in_a_batch_and_chunked(checkpoints, llamacpp, family) -> None:
    """Batch invariance: bit for bit on the native kernels (the per-kernel loop for qwen2, qwen3 and
    mistral, the one-call layer stack for llama3)."""
    runner = CpuModelRunner(checkpoints[family], select_kernels(None, None, checkpoints[family].config))
    if not isinstance(runner.kernels, NativeKernels):
        pytest.skip("the numpy kernels are not batch-invariant")
    prompts = [c["prompt_token_ids"] for c in llamacpp[family]["cases"]]
    alone = PagedDriver(runner, num_blocks=64, shuffle_seed=1).generate([prompts[-1]], 4, keep_logits=True)
    runner = CpuModelRunner(checkpoints[family], runner.kernels)
    batch = PagedDriver(runner, num_blocks=128, shuffle_seed=2).generate(
        prompts, 4, prefill_chunk=13, keep_logits=True
    )
    assert batch[-1].tokens == alone[0].tokens
    for ours, theirs in zip(batch[-1].logits, alone[0].logits, strict=True):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_two_tensor_parallel_ranks_agree_with_llama_cpp(tmp_path: Path, llamacpp, family: str) -> None:
    """Each rank adds its own heads' share of the q/k/v biases (qwen2) and norms its own heads (qwen3)."""
    require_native()
    cases = llamacpp[family]["cases"]
    runner = TensorParallelRunner(write_family_gguf(FAMILIES[family], tmp_path / "model.gguf"), 2, 1)
    try:
        gens = PagedDriver(runner, num_blocks=64).generate(
            [c["prompt_token_ids"] for c in cases], 1, keep_logits=True
        )
    finally:
        runner.close()
    for gen, case in zip(gens, cases, strict=True):
        assert worst_difference(gen.logits[0], case) < LOGIT_TOL
