"""The tensor-parallel CPU runner: rank 0 in the engine process drives ranks 1..N-1 in worker processes.

The engine core sees one ``ModelRunner``; nothing above this module knows about ranks (rank 0 drives,
as in nano-vllm). Each step rank 0 builds the step's index arrays once, sends them to every worker over
its pipe, and then all ranks run the same forward on their own shard (``CpuModelRunner`` with a
``RankShard`` and a ``ShmCollective``), meeting at two all-reduces per layer and one logits gather.

Failure: a worker that dies (killed, out of memory, a bug) is noticed by rank 0 within
``PEER_CHECK_INTERVAL_MS`` of waiting on it — in a barrier, waiting for a reply, or, between steps, by a
watcher thread on the workers' process sentinels — and every later ``execute`` raises ``RankFailure``
naming the rank. The engine then stops serving (health NOT_SERVING, open streams end UNAVAILABLE).
Workers exit by themselves when rank 0 goes away (their pipe closes or their parent changes).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path

import numpy as np

from engine.model.checkpoint_loader import load_checkpoint
from engine.model.cpu_runner import KV_DTYPE, CpuModelRunner
from engine.model.kernels import select_kernels
from engine.model.kernels.native import NativeUnavailable, load_library
from engine.model.runner import SequenceChunk
from engine.model.tp.collective import (
    PEER_CHECK_INTERVAL_MS,
    Capacity,
    RankFailure,
    ShmCollective,
    create_segment,
    segment_bytes,
)
from engine.model.tp.plan import TpPlan, plan_tensor_parallel

log = logging.getLogger(__name__)

# Rows the shared segment holds at first; it grows (to powers of two) when a step needs more.
_INITIAL_CAPACITY = Capacity(tokens=256, logit_rows=16)
WORKER_START_TIMEOUT_S = 300.0  # loading and packing a shard of a small model takes seconds


class TensorParallelRunner:
    backend = "cpu"

    def __init__(self, path: Path, world_size: int, threads_per_rank: int = 1) -> None:
        """Loads ``path`` (a GGUF file or a Hugging Face directory) over ``world_size`` ranks, each running ``threads_per_rank`` kernel threads.

        Needs the native kernels (the barrier is part of their library)."""
        try:
            library = load_library()
        except NativeUnavailable as exc:
            raise NativeUnavailable(f"tensor parallelism needs the native kernels: {exc}") from exc
        started = time.monotonic()
        self.tensor_parallel_size = world_size
        checkpoint = load_checkpoint(path)
        self.config = checkpoint.config
        self.spec = self.config.spec()
        self.plan: TpPlan = plan_tensor_parallel(self.config, world_size)
        self.failure = ""  # why the group cannot compute any more, once it cannot
        self.on_failure: Callable[[str], None] | None = None  # called (from a watcher thread) on failure
        self._failure_lock = threading.Lock()  # the step thread and the watcher may both see a death
        self._workers: list[_Worker] = []
        self._collective = ShmCollective(
            library,
            world_size,
            0,
            self.config.hidden_size,
            self.config.vocab_size,
            self._check_workers,
        )
        context = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        try:
            for rank in range(1, world_size):
                self._workers.append(_Worker.start(context, rank, path, world_size, threads_per_rank))
            self._attach_segment(_INITIAL_CAPACITY)
            # Rank 0 loads its shard while the workers load theirs.
            kernels_0 = select_kernels("native", threads_per_rank, self.config)
            self._rank0 = CpuModelRunner(checkpoint, kernels_0, self.plan.shards[0], self._collective)
            for worker in self._workers:
                self._expect(worker, "ready", WORKER_START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self._stop_watch_r, self._stop_watch_w = os.pipe()
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()
        log.info(
            "loaded %s over %d tensor-parallel ranks (%d kernel thread(s) each) in %.1f s: %s",
            self.spec.name,
            world_size,
            threads_per_rank,
            time.monotonic() - started,
            "; ".join(
                f"rank {s.rank}: KV heads {s.kv_heads.start}-{s.kv_heads.stop - 1}, "
                f"FFN columns {s.ffn_columns.size}, vocab rows {s.vocab.size}"
                for s in self.plan.shards
            ),
        )

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [worker.process.pid for worker in self._workers if worker.process.pid is not None]

    # -- ModelRunner ---------------------------------------------------------------------------------

    def kv_bytes_per_block(self, block_size: int) -> int:
        cfg = self.config
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * KV_DTYPE.itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._rank0.allocate_kv_cache(num_blocks, block_size)
        for worker in self._workers:
            worker.conn.send(("allocate", num_blocks, block_size))
        for worker in self._workers:
            self._expect(worker, "allocated", 60.0)

    def execute(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        if self.failure:
            raise RankFailure(self.failure)
        batch = self._rank0.step_batch(chunks)  # validates the chunks before any rank starts
        try:
            if not self._collective.capacity.covers(batch.num_tokens, len(batch.logit_rows)):
                self._attach_segment(
                    self._collective.capacity.grown_to(batch.num_tokens, len(batch.logit_rows))
                )
            for worker in self._workers:
                worker.conn.send(("step", batch))
            logits = self._rank0.forward(batch)
        except Exception as exc:
            # The ranks may now be out of step with each other: this group never computes again. A dead
            # worker is the likeliest cause of any error here (a broken pipe, say): name it if so.
            with contextlib.suppress(RankFailure):
                self._check_workers()
            message = f"tensor-parallel rank 0 failed: {exc}"
            self._set_failure(lambda: message)  # unless a dead rank was found first
            raise RankFailure(self.failure) from exc
        assert logits is not None
        return logits

    def close(self) -> None:
        if hasattr(self, "_stop_watch_w"):
            os.write(self._stop_watch_w, b"x")
            self._watcher.join(5.0)
            os.close(self._stop_watch_r)
            os.close(self._stop_watch_w)
            del self._stop_watch_w
        for worker in self._workers:
            worker.stop()
        self._workers = []
        self._collective.close()

    # -- internals -----------------------------------------------------------------------------------

    def _attach_segment(self, capacity: Capacity) -> None:
        cfg = self.config
        fd = create_segment(
            segment_bytes(self.tensor_parallel_size, cfg.hidden_size, cfg.vocab_size, capacity)
        )
        for worker in self._workers:
            worker.conn.send(("segment", capacity))
            send_handle(worker.conn, fd, worker.process.pid)
        self._collective.attach(fd, capacity)

    def _expect(self, worker: _Worker, reply: str, timeout_s: float) -> None:
        """Waits for ``reply`` from a worker, checking on every worker meanwhile."""
        deadline = time.monotonic() + timeout_s
        while not worker.conn.poll(PEER_CHECK_INTERVAL_MS / 1000):
            self._check_workers()
            if time.monotonic() > deadline:
                raise RankFailure(
                    f"tensor-parallel rank {worker.rank} did not answer {reply!r} in {timeout_s:.0f} s"
                )
        message = worker.conn.recv()
        if message[0] != reply:
            raise RankFailure(f"tensor-parallel rank {worker.rank} failed: {message[-1]}")

    def _check_workers(self) -> None:
        for worker in self._workers:
            if not worker.process.is_alive():
                self._set_failure(worker.death_notice)
                raise RankFailure(self.failure)

    def _watch(self) -> None:
        """Between steps nobody waits on the workers: this thread notices one dying anyway."""
        sentinels = {worker.process.sentinel: worker for worker in self._workers}
        ready = wait([*sentinels, self._stop_watch_r])
        dead = [sentinels[s] for s in ready if s in sentinels]
        if dead:
            self._set_failure(dead[0].death_notice)

    def _set_failure(self, reason: Callable[[], str]) -> None:
        """Records and reports the first failure only; ``reason`` is asked once (it may read a pipe)."""
        with self._failure_lock:
            if self.failure:
                return
            self.failure = reason()
        log.error("tensor parallelism failed: %s", self.failure)
        if self.on_failure is not None:
            self.on_failure(self.failure)


class _Worker:
    """Rank 0's handle on one worker process."""

    def __init__(self, rank: int, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        self.rank, self.process, self.conn = rank, process, conn

    @classmethod
    def start(cls, context, rank: int, path: Path, world_size: int, threads: int) -> _Worker:
        conn, child_conn = context.Pipe()  # a socket pair: it carries the segment's descriptor too
        process = context.Process(
            target=_worker_main,
            args=(child_conn, str(path), world_size, rank, threads, os.getpid()),
            name=f"chatmesh-tp-rank{rank}",
            daemon=True,
        )
        process.start()
        child_conn.close()
        return cls(rank, process, conn)

    def death_notice(self) -> str:
        reason = ""
        if self.conn.poll():  # it may have said why before it went
            try:
                message = self.conn.recv()
                reason = f": {message[-1]}" if message[0] == "error" else ""
            except (EOFError, OSError):
                pass
        return f"tensor-parallel rank {self.rank} (pid {self.process.pid}) exited with code {self.process.exitcode}{reason}"

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # already gone
            self.conn.send(("stop",))
        self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        self.conn.close()


def _worker_main(
    conn: Connection, path: str, world_size: int, rank: int, threads: int, parent_pid: int
) -> None:
    """A worker rank: loads its shard, then runs the steps rank 0 sends until told to stop."""

    # Rank 0 decides when ranks stop: a Ctrl-C or SIGTERM sent to the whole process group must not
    # kill a rank while the engine drains its open streams. Rank 0 exiting closes our pipe instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def check_parent() -> None:
        if os.getppid() != parent_pid:
            raise SystemExit(f"rank {rank}: rank 0 (pid {parent_pid}) is gone")

    try:
        checkpoint = load_checkpoint(Path(path))
        config = checkpoint.config
        collective = ShmCollective(
            load_library(), world_size, rank, config.hidden_size, config.vocab_size, check_parent
        )
        shard = plan_tensor_parallel(config, world_size).shards[rank]
        runner = CpuModelRunner(checkpoint, select_kernels("native", threads, config), shard, collective)
        conn.send(("ready",))
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return  # rank 0 closed its end: the engine is gone
            kind = message[0]
            if kind == "step":
                runner.forward(message[1])
            elif kind == "segment":
                collective.attach(recv_handle(conn), message[1])
            elif kind == "allocate":
                runner.allocate_kv_cache(message[1], message[2])
                conn.send(("allocated",))
            elif kind == "stop":
                return
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
