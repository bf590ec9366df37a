"""The engine: requests in, one scheduler step at a time, token outputs out.

``add_request`` and ``cancel`` may be called from any thread (the gRPC event loop): they only put work
in an inbox. The step loop runs in its own thread, so the model never blocks the event loop:

    take the inbox (new requests, cancels: their blocks are freed here, before scheduling)
    → draft tokens to verify (engine.speculation, when on) → refuse the waiting requests past their
    queue limit → schedule → run the model → mask the logits of constrained requests (engine.structured)
    → sample (and verify drafts: round by round, the same pick at each drafted position, while they
    agree) → cache the computed blocks → detokenize and check stops → free finished requests → publish
    the step's KV events as one batch → publish the load → hand all outputs over in one call.

A request's life around the step (admission, replay of resumed output, the stop rule, its finish,
usage and metrics) is ``engine.request_tracker``'s, shared with hosted engines; the engine keeps the
scheduler's side of each request (``engine.request.Request``). Tests call ``step()`` directly
instead of starting the thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

from chatmesh.finish import FinishReason
from chatmesh.tokenizer import ChatTokenizer
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager, size_kv_pool
from engine.kv_events import KvEventLog
from engine.logprobs import TokenLogprob, token_logprob
from engine.metrics import EngineMetrics
from engine.model.runner import ModelRunner, ModelSpec, SequenceChunk
from engine.outputs import EngineStats, RequestOutput
from engine.request import EngineRequest, Request
from engine.request_tracker import RequestTracker, TrackedRequest
from engine.sampler import sample
from engine.scheduler import Scheduler, SchedulerOutput
from engine.step_cost import StepCost
from engine.structured import constrained_logits

log = logging.getLogger(__name__)


class LLMEngine:
    serves_extra_knobs = True  # engine.sampler and engine.logprobs apply them all

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: ChatTokenizer,
        on_outputs: Callable[[list[RequestOutput]], None] | None = None,
        metrics: EngineMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.instance_id = uuid.uuid4().hex
        self.constrained_decoding = True  # its step masks the logits of constrained requests
        spec = runner.spec
        bytes_per_block = runner.kv_bytes_per_block(config.block_size)
        num_blocks = size_kv_pool(config, spec.context_length, bytes_per_block)
        log.info(
            "sizing KV cache: %d blocks of %d tokens (%d tokens, %.0f MiB)",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            num_blocks * bytes_per_block / 2**20,
        )
        runner.allocate_kv_cache(num_blocks, config.block_size)
        self.events = KvEventLog(config.kv_events_buffer)
        self.kv = KVCacheManager(
            num_blocks, config.block_size, self.events, config.enable_prefix_caching, config.block_hash_seed
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_batched_tokens,
            config.max_running_requests,
            watermark_blocks=num_blocks // 100,
        )
        # A request must fit in the pool on its own, or it could never finish.
        self.context_length = min(spec.context_length, num_blocks * config.block_size)
        if self.context_length < spec.context_length:
            log.warning(
                "the KV pool holds %d tokens, less than the model's context of %d: requests are limited to it",
                self.context_length,
                spec.context_length,
            )
        # Receives each step's outputs, in the step thread (the service routes them to their streams).
        self.on_outputs = on_outputs or (lambda outputs: None)
        # Called once, in the step thread, when the engine stops serving (even with no request open).
        self.on_failure: Callable[[str], None] = lambda message: None
        self.tracker = RequestTracker(tokenizer, self._release, metrics, clock)
        self._clock = clock
        self.metrics = metrics
        self.step_cost = StepCost()  # step thread only
        # Speculation (step thread only): draft tokens verified and accepted since start, and whether
        # the latest step verified any.
        self._eos_ids = frozenset(tokenizer.eos_token_ids)
        self.draft_tokens = 0
        self.accepted_draft_tokens = 0
        self.speculating = False
        self._requests: dict[str, Request] = {}  # step thread only: the scheduler's side of each request
        # The inbox (with the tracker's admitted requests), shared with other threads.
        self._wakeup = threading.Condition()
        self._cancels: list[str] = []
        self._thread: threading.Thread | None = None
        self._failing = ""  # a failure reported from another thread, for the step thread to act on
        if hasattr(runner, "on_failure"):  # a runner whose workers can die between steps tells us
            runner.on_failure = self.fail
        self.stats = self._current_stats()

    @property
    def spec(self) -> ModelSpec:
        return self.runner.spec

    @property
    def backend(self) -> str:
        return self.runner.backend

    @property
    def tensor_parallel_size(self) -> int:
        return self.runner.tensor_parallel_size

    @property
    def failure(self) -> str:
        """Why the engine stopped serving, if it did."""
        return self.tracker.failure

    # -- any thread ----------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queues a validated request; raises a ``ServiceError`` (full, duplicate, unavailable) if the
        engine does not take it."""
        with self._wakeup:
            # Read under the lock that also guards moving admitted requests into the scheduler, so the
            # count is never short.
            waiting = self.scheduler.num_waiting + self.tracker.num_admitted
            self.tracker.admit(request, self.config.max_waiting_requests, waiting)
            self._wakeup.notify()

    def cancel(self, request_id: str) -> None:
        """Stops a request; its blocks are freed at the start of the next step."""
        with self._wakeup:
            if self.tracker.is_unfinished(request_id):
                self._cancels.append(request_id)
                self._wakeup.notify()

    def fail(self, message: str) -> None:
        """Stops serving, from any thread: the step loop ends every request with ``message``."""
        with self._wakeup:
            self._failing = self._failing or message
            self._wakeup.notify()

    def has_unfinished_requests(self) -> bool:
        return self.tracker.has_unfinished_requests()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the step loop after the step in progress."""
        with self._wakeup:
            self.tracker.stop_admitting()
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("the step thread did not stop within %.0fs", timeout_s)

    def close(self) -> None:
        """Releases the runner (its workers and memory); after ``stop``."""
        self.runner.close()

    # -- the step thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        idle = False
        while True:
            with self._wakeup:
                while not (
                    self.tracker.stopping or self._failing or self.tracker.num_admitted or self._cancels
                ):
                    if not self.scheduler.has_work():
                        self._wakeup.wait()
                    elif idle:  # the last step could run nothing: look again soon, without spinning
                        self._wakeup.wait(timeout=0.05)
                        break
                    else:
                        break
                if self.tracker.stopping:
                    return
                failing = self._failing
            outputs: list[RequestOutput] = []
            if failing:
                self._fail(failing, outputs)
                self.on_outputs(outputs)
            else:
                try:
                    idle = not self.step()
                except Exception as exc:
                    log.exception("engine step failed; the engine stops serving")
                    self._fail(f"engine step failed: {exc}", outputs)
                    self.on_outputs(outputs)
            if self.failure:
                log.error("the step loop stopped: %s", self.failure)
                return

    def step(self) -> bool:
        """Runs one step; False if there was nothing to do (or the engine failed)."""
        if self.failure:
            return False
        outputs: list[RequestOutput] = []
        began = self._clock()
        self._take_inbox(outputs)
        self._draft()
        batch = self.scheduler.schedule()
        # Only what this step had no room to start expires: a request whose limit passed while the step
        # before ran (slow steps: big batches on a CPU) but that fits now is started, not refused.
        for req in self.scheduler.expire(self._clock()):
            outputs.append(self.tracker.expire(self._tracked(req)))
        self.speculating = False
        if batch.scheduled:
            self._execute(batch, outputs)
            self.step_cost.observe(sum(batch.scheduled.values()), self._clock() - began)
        self.events.flush()
        self.stats = self._current_stats()
        if self.metrics is not None:
            self.metrics.observe_step(self.stats)
        if outputs:
            self.on_outputs(outputs)
        return bool(batch.scheduled or outputs)

    def _take_inbox(self, outputs: list[RequestOutput]) -> None:
        with self._wakeup:
            new = self.tracker.take_admitted()
            cancels, self._cancels = self._cancels, []
            # Into the scheduler under the lock, so the waiting count admission reads is never short.
            for tracked in new:
                scheduled = Request(tracked.request, tracked.arrival, self.config.priority_aging_s)
                if (grammar := tracked.request.grammar) is not None:
                    scheduled.grammar = grammar.start(tracked.request.resumed_output_token_ids)
                self._requests[scheduled.request_id] = scheduled
                self.scheduler.add(scheduled)
        for tracked in new:
            if (ended := self.tracker.replay_resumed(tracked)) is not None:
                outputs.append(ended)
        for request_id in cancels:
            if (req := self._requests.get(request_id)) is not None:
                outputs.append(self.tracker.end(self._tracked(req), FinishReason.CANCELLED))

    def _draft(self) -> None:
        """Before scheduling: draft tokens for the decoding requests, in a step small enough to verify
        them cheaply (the waiting requests count: they may join it), each request gated on its
        acceptance (engine.speculation)."""
        running = self.scheduler.running
        if not self.config.speculative_tokens or not running:
            return
        if len(running) + self.scheduler.num_waiting > self.config.speculative_max_batch:
            for req in running:  # drafted for a step that had no budget left for them
                req.draft_token_ids = []
            return
        # Every decoding request's draft fits in the step's budget beside the others.
        k = min(self.config.speculative_tokens, self.config.max_batched_tokens // len(running) - 1)
        for req in running:
            if req.num_uncomputed_tokens != 1:
                continue  # still prefilling
            p = req.request.sampling
            # No draft past what the request may still emit, nor past the context.
            room = min(k, p.max_tokens - req.num_output_tokens - 1, self.context_length - req.num_tokens)
            drafts = req.drafter.draft(req.token_ids, room)
            # A draft ends before a token that would end the output: nothing is verified past an end.
            for i, token in enumerate(drafts):
                if token in p.stop_token_ids or (token in self._eos_ids and not p.ignore_eos):
                    del drafts[i:]
                    break
            req.draft_token_ids = drafts

    def _execute(self, batch: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        chunks = []
        for req, num_new in batch.scheduled.items():
            start = req.num_computed_tokens
            drafts = req.draft_token_ids
            end = start + num_new - len(drafts)  # drafts come only after a request's newest token
            chunks.append(
                SequenceChunk(
                    token_ids=np.asarray(req.token_ids[start:end] + drafts, dtype=np.int32),
                    start_position=start,
                    block_table=req.block_table,
                    needs_logits=end == req.num_tokens,
                    num_draft_tokens=len(drafts),
                )
            )
        try:
            logits = self.runner.execute(chunks)
        except Exception as exc:
            log.exception("the model runner failed; the engine stops serving")
            self._fail(f"model runner failed: {exc}", outputs)
            return
        known_argmax = getattr(self.runner, "argmax", None)
        argmax = known_argmax() if known_argmax is not None else None
        # Each sampled request and its first logits row; a request with drafts has one row more per draft.
        sampled, row = [], 0
        for req, chunk in zip(batch.scheduled, chunks, strict=True):
            if chunk.needs_logits:
                sampled.append((req, row))
                row += 1 + chunk.num_draft_tokens
        picked: dict[Request, list[int]] = {req: [] for req, _ in sampled}
        logprobs: dict[Request, list[TokenLogprob]] = {req: [] for req, _ in sampled}
        # Verification: round i picks the token at every still-agreeing request's i-th row, exactly as a
        # step without speculation would from the same logits (same output position, output so far and
        # grammar state); a draft token is accepted iff it is that token. Round 0 is every request's
        # ordinary pick.
        verifying = sampled
        for i in itertools.count():
            rows = [r + i for _, r in verifying]
            tokens = self._pick(logits, argmax, rows, [req for req, _ in verifying])
            agreeing = []
            for (req, r), token in zip(verifying, tokens, strict=True):
                req.token_ids.append(token)
                if req.grammar is not None:
                    req.grammar.advance(token)
                picked[req].append(token)
                p = req.request.sampling
                if (
                    p.logprobs
                ):  # the model's own distribution: constraints and the sampler only steer the pick
                    logprobs[req].append(token_logprob(logits[r + i], token, p.top_logprobs))
                if i < len(req.draft_token_ids) and token == req.draft_token_ids[i]:
                    agreeing.append((req, r))
            if not agreeing:
                break
            verifying = agreeing
        rejected = {}
        for req, tokens in picked.items():
            if proposed := len(req.draft_token_ids):
                accepted = len(tokens) - 1
                req.drafter.verified(proposed, accepted)
                rejected[req] = proposed - accepted
                self.draft_tokens += proposed
                self.accepted_draft_tokens += accepted
        self.speculating = bool(rejected)
        self.scheduler.update(batch, rejected)
        for req, tokens in picked.items():
            lp = logprobs[req] if req.request.sampling.logprobs else None
            outputs.append(self.tracker.add_tokens(self._tracked(req), tokens, lp))

    def _pick(
        self, logits: np.ndarray, argmax: np.ndarray | None, rows: list[int], reqs: list[Request]
    ) -> list[int]:
        """The token each request picks from its row of ``logits``: its grammar's mask, then the
        sampler, at its next output position."""
        if rows != list(range(len(logits))):  # a step with drafts: only some rows, copied out
            logits = logits[rows]
            argmax = argmax[rows] if argmax is not None else None
        params = [req.request.sampling for req in reqs]
        constrained = [r for r, req in enumerate(reqs) if req.grammar is not None]
        if constrained:
            logits, argmax = constrained_logits(
                logits,
                argmax,
                constrained,
                [reqs[r].grammar for r in constrained],  # type: ignore[misc]
                # The runner's argmax is the pick only where the sampler changes no logit.
                [params[r].temperature == 0.0 and not params[r].adjusts_logits for r in constrained],
            )
        return sample(
            logits,
            params,
            [req.num_output_tokens for req in reqs],
            # A request's output so far, copied only for those that penalize what they said.
            outputs=[
                req.token_ids[req.num_prompt_tokens :] if p.penalizes else ()
                for req, p in zip(reqs, params, strict=True)
            ],
            argmax=argmax,
        )

    def _tracked(self, req: Request) -> TrackedRequest:
        """The tracker's side of ``req``, told the prefix-cache hit the scheduler found for it (usage
        reports it)."""
        tracked = self.tracker.requests[req.request_id]
        tracked.cached_prompt_tokens = req.num_prefix_hit_tokens or 0
        return tracked

    def _release(self, request_id: str) -> None:
        """A request ended (the tracker calls this): its blocks go back to the pool now."""
        self.scheduler.finish(self._requests.pop(request_id))

    def _fail(self, message: str, outputs: list[RequestOutput]) -> None:
        """Stops serving: every request ends with ``message`` as its error. The scheduler is not
        consulted (it may be what failed); a failed engine neither steps nor frees blocks again."""
        for req in self._requests.values():
            self._tracked(req)  # so the failed requests' usage reports their prefix-cache hits
        outputs += self.tracker.fail(message)
        self._requests.clear()
        self.on_failure(message)

    def _current_stats(self) -> EngineStats:
        step_fixed_s, step_token_s = self.step_cost.line()
        return EngineStats(
            waiting_requests=self.scheduler.num_waiting + self.tracker.num_admitted,
            blocked_requests=self.scheduler.num_waiting,
            running_requests=len(self.scheduler.running),
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_used=self.kv.num_used_blocks,
            prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
            prefix_queried_tokens=self.scheduler.prefix_queried_tokens,
            generated_tokens=self.tracker.generated_tokens,
            preemptions=self.scheduler.num_preemptions,
            prefill_tokens=self.scheduler.prefill_tokens,
            step_fixed_s=step_fixed_s,
            step_token_s=step_token_s,
            draft_tokens=self.draft_tokens,
            accepted_draft_tokens=self.accepted_draft_tokens,
            speculating=self.speculating,
        )
