"""Every request's life from admission to its finish: the part our engine and hosted engines share.

``LLMEngine`` (our scheduler, KV cache and model runner) and ``HostedEngine`` (TensorRT-LLM, Triton:
engines that schedule and cache on their own) differ only in how tokens get computed. What happens
around that is the same, and happens here (vLLM splits its EngineCore from an OutputProcessor alike):

    admit          any thread: refused when the engine failed or is stopping, for a duplicate id, or
                   when the queue is full (with a retry hint from the recent finish rate)
    take_admitted  the engine's thread: the admitted requests start
    replay_resumed output an earlier engine delivered (failover) goes through the stop rule without
                   being sent again; it may end the request at once
    add_tokens     new tokens: the stop rule (``engine.stopping``), released text, the output to send
    finish / end   the finish (after a token / between tokens), with usage (context, prefix-cache
                   hits, new output) and metrics
    expire         a request that waited past its queue limit without starting is refused
    fail           every unfinished request ends with the engine's error

``admit`` and the queries under "any thread" may be called from any thread; everything else runs on
the engine's one thread (``LLMEngine``'s step thread, ``HostedEngine``'s io loop). The engine keeps
what is its own (the scheduler's ``Request``, a backend's stream) and frees it in ``release``, which
the tracker calls when a request ends, before the request stops counting as unfinished.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from chatmesh.errors import ServiceError
from chatmesh.finish import FinishReason, Usage
from chatmesh.tokenizer import ChatTokenizer
from engine.detokenizer import Detokenizer
from engine.logprobs import TokenLogprob
from engine.metrics import EngineMetrics
from engine.outputs import Finish, RequestOutput
from engine.request import EngineRequest
from engine.stopping import check_token

# Retry hint for a full queue when no request has finished yet to estimate the drain rate from.
DEFAULT_RETRY_AFTER_S = 1.0


class QueueFullError(ServiceError):
    def __init__(self, waiting: int, retry_after_s: float) -> None:
        message = f"the engine's waiting queue is full ({waiting} requests); retry later"
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_s)


class QueueLimitError(ServiceError):
    def __init__(self, waited_s: float, retry_after_s: float) -> None:
        message = f"the request waited {waited_s:.2f}s in the engine's queue without starting; retry later"
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_s)


class DuplicateRequestError(ServiceError):
    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.ALREADY_EXISTS, message)


class EngineUnavailableError(ServiceError):
    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


@dataclass(eq=False)
class TrackedRequest:
    """A request's output so far, as the client sees it."""

    request: EngineRequest
    arrival: float
    detokenizer: Detokenizer
    num_output_tokens: int  # output positions so far, resumed ones included: the index of the next token
    cached_prompt_tokens: int = 0  # of the context, served from the engine's prefix cache (the engine says)
    first_token_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_context_tokens(self) -> int:
        """Prompt plus resumed output: what ``Usage.prompt_tokens`` counts."""
        return len(self.request.prompt_token_ids) + len(self.request.resumed_output_token_ids)

    @property
    def num_new_output_tokens(self) -> int:
        """Output tokens this engine generated (``Usage.completion_tokens``)."""
        return self.num_output_tokens - len(self.request.resumed_output_token_ids)

    def usage(self) -> Usage:
        return Usage(self.num_context_tokens, self.cached_prompt_tokens, self.num_new_output_tokens)


class RequestTracker:
    def __init__(
        self,
        tokenizer: ChatTokenizer,
        release: Callable[[str], None],
        metrics: EngineMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokenizer = tokenizer
        self._release = release  # frees what the engine holds for a request that ended
        self._metrics = metrics
        self._clock = clock
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._lock = threading.Lock()
        self._unfinished: set[str] = set()  # lock: every request admitted and not finished
        self._admitted: dict[str, TrackedRequest] = {}  # lock: admitted, not taken by the engine yet
        self._stopping = False  # lock
        self.failure = ""  # why the engine stopped serving, if it did
        self.requests: dict[str, TrackedRequest] = {}  # the engine's thread: taken and not finished
        self.generated_tokens = 0  # the engine's thread
        self._finish_times: deque[float] = deque(maxlen=32)  # to estimate retry hints

    # -- any thread ----------------------------------------------------------------------------------

    def admit(self, request: EngineRequest, limit: int, queued: int | None = None) -> None:
        """Takes ``request`` unless ``queued`` requests (default: every unfinished one) reach ``limit``;
        raises a ``ServiceError`` (full, duplicate, unavailable) otherwise."""
        with self._lock:
            if self.failure or self._stopping:
                raise EngineUnavailableError(self.failure or "the engine is stopping")
            if request.request_id in self._unfinished:
                raise DuplicateRequestError(f"request id {request.request_id!r} is already in use")
            queued = len(self._unfinished) if queued is None else queued
            if queued >= limit:
                raise QueueFullError(queued, self._retry_after_s())
            self._unfinished.add(request.request_id)
            self._admitted[request.request_id] = TrackedRequest(
                request,
                self._clock(),
                Detokenizer(self.tokenizer, request.sampling.stop),
                num_output_tokens=len(request.resumed_output_token_ids),
            )

    @property
    def num_admitted(self) -> int:
        """Requests admitted and not taken by the engine yet."""
        return len(self._admitted)

    def is_unfinished(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._unfinished

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._unfinished)

    def stop_admitting(self) -> None:
        with self._lock:
            self._stopping = True

    @property
    def stopping(self) -> bool:
        return self._stopping

    # -- the engine's thread -------------------------------------------------------------------------

    def take_admitted(self) -> list[TrackedRequest]:
        """The requests admitted since the last call, in admission order; they are the engine's now."""
        with self._lock:
            taken, self._admitted = list(self._admitted.values()), {}
        for tracked in taken:
            self.requests[tracked.request_id] = tracked
        return taken

    def replay_resumed(self, tracked: TrackedRequest) -> RequestOutput | None:
        """Feeds output an earlier engine delivered through the detokenizer and stop rule without sending
        it again; the request's end if that output already ends it."""
        for position, token in enumerate(tracked.request.resumed_output_token_ids, start=1):
            reason, matched_stop, _ = self._check(tracked, token, position)
            if reason is not None:
                return self.end(tracked, reason, matched_stop)
        return None

    def add_tokens(
        self,
        tracked: TrackedRequest,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> RequestOutput:
        """New output tokens, in order (with ``logprobs``, one per token): what they release, and the
        finish if one of them ends the request (tokens after it are dropped)."""
        now = self._clock()
        output = RequestOutput(tracked.request_id, tracked.num_output_tokens, [], "")
        texts, released = [], 0
        for i, token in enumerate(token_ids):
            if logprobs is not None:
                output.logprobs.append(logprobs[i])
            if tracked.first_token_at is None:
                tracked.first_token_at = now
                if self._metrics is not None:
                    self._metrics.time_to_first_token.observe(now - tracked.arrival)
            tracked.num_output_tokens += 1
            self.generated_tokens += 1
            output.token_ids.append(token)
            reason, matched_stop, text = self._check(tracked, token, tracked.num_output_tokens)
            texts.append(text)
            released += len(text)
            output.text_ends.append(released)
            if reason is not None:
                output.finish = self.finish(tracked, reason, matched_stop)
                break
        output.text = "".join(texts)
        return output

    def finish(self, tracked: TrackedRequest, reason: FinishReason, matched_stop: str = "") -> Finish:
        """Ends a request: the engine releases it, then it no longer counts as unfinished."""
        now = self._close(tracked)
        self._finish_times.append(now)
        if self._metrics is not None:
            self._metrics.observe_finish(
                tracked.arrival, tracked.first_token_at, now, tracked.num_new_output_tokens, reason.value
            )
        return Finish(reason, tracked.usage(), tracked.detokenizer.flush(), matched_stop)

    def expire(self, tracked: TrackedRequest) -> RequestOutput:
        """Refuses a request that waited past its queue limit without starting (RESOURCE_EXHAUSTED with
        a retry delay). It finished nothing, so it does not count toward the drain rate."""
        now = self._close(tracked)
        if self._metrics is not None:
            self._metrics.queue_expired.inc()
        refusal = QueueLimitError(now - tracked.arrival, self._retry_after_s())
        finish = Finish(FinishReason.CANCELLED, tracked.usage(), refusal=refusal)
        return RequestOutput(tracked.request_id, tracked.num_output_tokens, [], "", finish)

    def end(self, tracked: TrackedRequest, reason: FinishReason, matched_stop: str = "") -> RequestOutput:
        """Ends a request between tokens (cancelled, its resumed output complete, the backend's own end)."""
        finish = self.finish(tracked, reason, matched_stop)
        return RequestOutput(tracked.request_id, tracked.num_output_tokens, [], "", finish)

    def fail(self, message: str) -> list[RequestOutput]:
        """Stops serving: every unfinished request, taken or not, ends with ``message`` as its error.
        Nothing is released (what failed may be what holds it); later calls return nothing."""
        with self._lock:
            if self.failure:
                return []
            self.failure = message
            admitted, self._admitted = list(self._admitted.values()), {}
            self._unfinished.clear()
        outputs = []
        for tracked in [*admitted, *self.requests.values()]:
            finish = Finish(FinishReason.CANCELLED, tracked.usage(), error=message)
            outputs.append(RequestOutput(tracked.request_id, tracked.num_output_tokens, [], "", finish))
        self.requests.clear()
        return outputs

    def _close(self, tracked: TrackedRequest) -> float:
        """The engine releases the request, then it no longer counts as unfinished; returns when."""
        self._release(tracked.request_id)
        del self.requests[tracked.request_id]
        with self._lock:
            self._unfinished.discard(tracked.request_id)
        return self._clock()

    def _check(
        self, tracked: TrackedRequest, token: int, num_output: int
    ) -> tuple[FinishReason | None, str, str]:
        params = tracked.request.sampling
        return check_token(params, self._eos, self.tokenizer, tracked.detokenizer, token, num_output)

    def _retry_after_s(self) -> float:
        """About when a queue slot frees up: the mean time between recent finishes."""
        times = self._finish_times
        if len(times) < 2 or times[-1] <= times[0]:
            return DEFAULT_RETRY_AFTER_S
        return min(30.0, max(0.1, (times[-1] - times[0]) / (len(times) - 1)))
