"""Which backends take tensor and pipeline parallelism, and how a cuda engine's ranks must be launched:
the engine's own parser and checks, and a real engine process refusing a launch that disagrees."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from engine.__main__ import parse_args
from engine.model.cuda_runner import torchrun_world_size


def _refusal(argv: list[str]) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    return err.getvalue()


@pytest.mark.parametrize("backend", ["cpu", "cuda", "trtllm"])
def test_tensor_parallelism_is_accepted_where_the_backend_shards(backend):
    _, config = parse_args(["--backend", backend, "--tensor-parallel-size", "4"])
    assert config.tensor_parallel_size == 4


def test_pipeline_parallelism_is_trtllms_only():
    _, config = parse_args(
        ["--backend", "trtllm", "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2"]
    )
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (4, 2)
    assert "pipeline parallelism is trtllm's only" in _refusal(
        ["--backend", "cuda", "--pipeline-parallel-size", "2"]
    )


@pytest.mark.parametrize(
    ("backend", "why"), [("triton", "the Triton server shards the model"), ("null", "it computes no model")]
)
def test_tensor_parallelism_is_refused_where_the_engine_cannot_shard_saying_why(backend, why):
    message = _refusal(["--backend", backend, "--tensor-parallel-size", "2"])
    assert f"--backend {backend} runs no tensor parallelism ({why}" in message


def test_sizes_below_one_are_refused():
    assert "must be >= 1, got 0 and 1" in _refusal(["--tensor-parallel-size", "0"])


def test_a_cuda_engine_runs_as_many_torchrun_ranks_as_its_tensor_parallel_size():
    assert torchrun_world_size(4, {"WORLD_SIZE": "4", "RANK": "3"}) == 4
    assert torchrun_world_size(1, {}) == 1
    with pytest.raises(ValueError, match=r"torchrun --nproc-per-node 4 --module engine .*one of 1"):
        torchrun_world_size(4, {})
    with pytest.raises(ValueError, match="one of 2"):
        torchrun_world_size(4, {"WORLD_SIZE": "2"})


def test_a_cuda_engine_started_without_torchrun_exits_before_loading_anything():
    """No torch here either: the launch check comes first, so the reason given is the launch's."""
    done = subprocess.run(
        [sys.executable, "-m", "engine", "--backend", "cuda", "--tensor-parallel-size", "2", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "torchrun --nproc-per-node 2" in done.stderr
