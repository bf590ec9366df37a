"""The families that differ from LLaMA only in details, against llama.cpp on the same files: Llama 3 (RoPE
frequency factors), Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm, head size other than hidden /
heads) and Mistral (a sliding window on every layer). Each is a tiny random-weight GGUF written from a
seed (tests/fixtures/family_ggufs.py); tests/data/family_llamacpp.json holds llama.cpp's logits and each
file's SHA-256 (bench/make_family_fixtures.py), so the file compared is the one llama.cpp ran.

This proves each architecture's arithmetic, not the families' own tokenizers (the files carry SmolLM2's;
the prompts are token ids): those tokenizers are refused (test_model_refusals.py).

Tolerance: both sides hold float16 KV and read the same weights exactly. Float weights (llama3 and qwen3
float32, mistral float16): logits differ by summation order, llama.cpp's float16 rounding of the
activations that meet float16 weights, and RoPE tables computed in float32 there (float64, rounded once,
here); measured over the top 32 and 32 sampled ids of four prompts per family, logits spread over ~±20:
at most 0.0069 apart, native-int8, native and numpy kernels alike; LOGIT_TOL allows 7x that. qwen2's
Q8_0 weights: llama.cpp multiplies them by activations rounded to 8 bits, ours by float32 activations
(native, numpy) or activations rounded by our own int8 path (native-int8), measured at most 0.15 apart
either way; Q8_0_LOGIT_TOL allows 2x. Switching a family's detail off moves its longest prompt's logits
by 1.17 (qwen3's q/k norm) to 5.8 (qwen2's biases), measured below against DETAIL_MOVES. Top-k: the TOP
likeliest ids are llama.cpp's, up to ids within twice the tolerance of its TOP-th (random weights make
near-ties).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import gguf
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
Q8_0_LOGIT_TOL = 0.3
DETAIL_MOVES = 1.0
TOP = 5


def tolerance(family: str) -> float:
    return Q8_0_LOGIT_TOL if FAMILIES[family].qtype == gguf.GGMLQuantizationType.Q8_0 else LOGIT_TOL


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


@pytest.mark.parametrize("kernels", ["native-int8", "native", "numpy"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_next_token_logits_agree_with_llama_cpp(checkpoints, llamacpp, family: str, kernels: str) -> None:
    if kernels != "numpy":
        require_native(int8=kernels == "native-int8")
    cases, tol = llamacpp[family]["cases"], tolerance(family)
    ours = last_logits(checkpoints[family], [c["prompt_token_ids"] for c in cases], kernels)
    for logits, case in zip(ours, cases, strict=True):
        assert worst_difference(logits, case) < tol, (len(case["prompt_token_ids"]), family)
        assert_same_top(logits, case, tol)


def assert_same_top(logits: np.ndarray, case: dict, tol: float) -> None:
    """Our TOP likeliest ids are llama.cpp's, up to ids within 2 tol of its TOP-th logit (near-ties may
    swap across that edge)."""
    theirs = dict(zip(case["top_token_ids"], case["top_logits"], strict=True))
    edge = case["top_logits"][TOP - 1]
    ours = np.argsort(-logits)[:TOP].tolist()
    assert all(theirs.get(i, -np.inf) >= edge - 2 * tol for i in ours), (ours, case["top_token_ids"][:TOP])
    assert {i for i, v in theirs.items() if v > edge + 2 * tol} <= set(ours)


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
    """Without its detail a family's longest prompt parts from llama.cpp by far more than its tolerance."""
    case = llamacpp[family]["cases"][-1]
    (logits,) = last_logits(switched_off(checkpoints[family]), [case["prompt_token_ids"]], "numpy")
    assert worst_difference(logits, case) > DETAIL_MOVES > 3 * tolerance(family)


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
        assert worst_difference(gen.logits[0], case) < tolerance(family)
