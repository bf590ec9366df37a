"""The tensor-parallel runner (2 rank processes) on the real model, against the single-process runner.

Tolerance: a row-parallel matmul sums its input dimension in two halves added by the all-reduce instead of
one FMA chain, so logits move by float32 rounding only (measured ~1e-4 on logits of size ~25); the shared
``LOGIT_TOL`` of the parity tests (0.02) applies, and greedy tokens must be identical up to the first
near-tie (top two logits within LOGIT_TOL).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from chatmesh.model_files import bundled_model_path
from engine.model.cpu_runner import CpuModelRunner
from engine.model.kernels.native import load_library
from engine.model.runner import SequenceChunk
from engine.model.tp.collective import RankFailure
from engine.model.tp.runner import TensorParallelRunner
from tests.engine.paged_driver import PagedDriver
from tests.engine.test_model_parity import CHATS, assert_same_generation
from tests.fixtures.model import require_native

NEW_TOKENS = 6
DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def tp_prompts(chat_tokenizer) -> list[list[int]]:
    chats = [chat_tokenizer.encode_chat([{"role": "user", "content": text}]) for text in CHATS]
    # A prompt longer than the shared segment's first capacity (256 tokens), and more sequences needing
    # logits in one step than its first 16 rows: both make the segment grow mid-run.
    story = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(30))
    long = chat_tokenizer.encode_chat([{"role": "user", "content": f"Summarize: {story}"}])
    assert len(long) > 256
    return chats + [long] + [chats[0]] * 13


def own_segments() -> list[str]:
    """This process's mappings of, and descriptors on, the TP segment (a memfd: never in /dev/shm)."""
    maps = [line for line in Path("/proc/self/maps").read_text().splitlines() if "chatmesh-tp" in line]
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used
            continue
    return maps + [target for target in fds if "chatmesh-tp" in target]


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def tp_runner() -> Iterator[TensorParallelRunner]:
    """A fresh 2-rank runner with one kernel thread per rank, closed and checked for leaks afterwards."""
    require_native()
    library = load_library()
    threads = library.cm_get_threads()  # the kernel thread pool is per process: rank 0 resizes it
    runner = TensorParallelRunner(bundled_model_path(), 2, threads_per_rank=1)
    pids = runner.worker_pids
    assert own_segments(), "the segment should be mapped while the runner is open"
    try:
        yield runner
    finally:
        runner.close()
        library.cm_set_threads(threads)
    assert not any(pid_exists(pid) for pid in pids), "a worker rank outlived close()"
    assert own_segments() == [], "the shared segment is still mapped or open after close()"


def test_two_ranks_match_one_process_within_tolerance_and_greedy_up_to_a_near_tie(
    tp_runner: TensorParallelRunner, native_runner: CpuModelRunner, tp_prompts
):
    assert tp_runner.kv_bytes_per_block(16) == native_runner.kv_bytes_per_block(16)
    expected = PagedDriver(native_runner, 512, shuffle_seed=1).generate(
        tp_prompts, NEW_TOKENS, keep_logits=True
    )
    ours = PagedDriver(tp_runner, 512, shuffle_seed=2).generate(tp_prompts, NEW_TOKENS, keep_logits=True)
    for a, b in zip(expected, ours, strict=True):
        assert_same_generation(a, b, bit_exact=False)
    # Every rank sums the partials in the same order: the 13 copies of one prompt decode bit-identically.
    for copy in ours[5:]:
        np.testing.assert_array_equal(np.stack(copy.logits), np.stack(ours[0].logits))


def test_a_dead_rank_fails_the_runner_with_its_name_instead_of_hanging(tp_runner: TensorParallelRunner):
    reported = threading.Event()
    messages: list[str] = []
    tp_runner.on_failure = lambda message: (messages.append(message), reported.set())
    tp_runner.allocate_kv_cache(8, 16)
    chunk = SequenceChunk(np.arange(5, dtype=np.int32) + 100, 0, np.array([0], dtype=np.int32), True)
    assert tp_runner.execute([chunk]).shape == (1, tp_runner.spec.vocab_size)

    [worker] = tp_runner.worker_pids
    os.kill(worker, signal.SIGKILL)
    assert reported.wait(DEADLINE_S), "nobody noticed the dead rank between steps"
    assert "rank 1" in messages[0] and "exited" in messages[0]
    started = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1"):
        tp_runner.execute([chunk])
    assert time.monotonic() - started < DEADLINE_S
