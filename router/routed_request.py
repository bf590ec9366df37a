"""One request through the router (``RoutedRequest``): place it, stream from the engine, and fail over when
the engine fails.

    place ──► routed ──► engine request: start ─► accepted ─► tokens … ─► finished ──► done
                 ▲                                    │ error, timeout, or the stream just ends
                 └──── place elsewhere (attempt + 1), resuming with the tokens already sent ◄┘

Each attempt sends the original prompt plus every token the client already has (the ones its caller
resumed with, then the ones relayed here) as ``resumed_output_token_ids``: the engine treats them as
context, counts them toward max_tokens, does not send them again, and draws position i's sample from
(seed, i), so a greedy or seeded stream goes on exactly as it would have. It also replays them through
its detokenizer and stop rule, so text the failed engine held back (a stop string's start, an unfinished
character) is released, or the stop string matched, by the next one: released text is a function of the
tokens (``engine/detokenizer.py``), and nothing else of the first engine's state needs to travel. Token
``index`` values continue across attempts; ``routed`` is sent for each placement. An error that is the
request's fault (INVALID_ARGUMENT, FAILED_PRECONDITION, ...) is returned as is; a full engine queue
(RESOURCE_EXHAUSTED) or a failing engine means another attempt, up to ``max_attempts``, then UNAVAILABLE
naming what each engine said.

Under the wait rule every attempt of a request whose client has no token yet also tells the engine how
long it may queue: what is left of its tier's TTFT objective less the engine's own time to a first
token (``max_queue_ms``). Admission predicted a wait that fits; when the prediction was wrong (higher
tiers kept arriving, the engine drained slower than it had), the engine drops the request unstarted at
that limit and the request ends RESOURCE_EXHAUSTED with a retry delay: not served after its objective
is lost, and not moved to another engine (its objective is spent there too).

Attempts go to the engine over the router's one stream to it (``meshkit.links``), shared with the
router's other requests there. The request has a deadline (the client's, or ``max_request_s``): once
it passes, the request ends DEADLINE_EXCEEDED, with no further attempt. Every read has a timeout:
``accept_timeout_s`` for the engine's `accepted`, ``first_token_timeout_s`` for the first token
(queueing included), ``idle_timeout_s`` between later frames. Every frame for the
client goes to the ``emit`` its caller gives ``run``. Once the first token is in, the engine's token
frames are relayed where they arrive, on the link's reading task (``RequestFeed.on_tokens``): the
request's own task wakes only for the engine's `finished`, a failure, or a timeout. The caller merges
the token frames a slow client has not taken yet into one, each token's text end kept
(``chatmesh/token_text.py``), so a client that falls behind gets fewer, bigger frames, and the relay
pays gRPC's per-message cost once for them (what waits is bounded by the request's output). Each
attempt is traced as a client span of its own, whose context goes to the engine with the request.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from functools import partial

import grpc
from opentelemetry import trace

from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2
from chatmesh.tiers import tier_of_proto
from chatmesh.token_text import coalesced, tokens_after
from meshkit.deadline import Deadline
from meshkit.links import Link, RequestFeed
from meshkit.telemetry import request_span, trace_context
from router.admission import RETRY_MIN_S
from router.config import RouterConfig
from router.engines import EngineState
from router.metrics import RouterMetrics
from router.placement import Placement, Placer, RequestPlan

# The shortest queue limit a request held to an objective gets: an idle engine's next step or two, so a
# request whose own prefill exceeds its objective is still served where nothing waits (as admission
# promises it).
MIN_QUEUE_LIMIT_S = 0.05

# Where a relay sends each frame for its client, as it has it.
Emit = Callable[[router_pb2.ResponseFrame], None]

# Engine answers that are the request's fault: another engine would say the same.
_CALLER_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)


class AttemptFailed(ServiceError):
    """This engine did not finish the request; another one may. RESOURCE_EXHAUSTED with the engine's
    retry delay when its queue was full, UNAVAILABLE otherwise."""

    def __init__(self, failure: str, detail: str, retry_after_s: float | None = None) -> None:
        code = grpc.StatusCode.UNAVAILABLE if retry_after_s is None else grpc.StatusCode.RESOURCE_EXHAUSTED
        super().__init__(code, detail, retry_after_s)
        self.failure = failure  # metric label: unavailable, timeout, exhausted, error, ...


class RoutedRequest:
    def __init__(
        self,
        start: router_pb2.GenerateStart,
        plan: RequestPlan,
        placer: Placer,
        config: RouterConfig,
        metrics: RouterMetrics,
        deadline_s: float | None = None,
    ) -> None:
        self.start = start
        self.plan = plan
        self.placer = placer
        self.config = config
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.deadline_s = deadline_s  # seconds the client allows, from arrival
        # Every output token the client has, the caller's resumed ones first: each attempt resumes them.
        self.output = array("I", start.resumed_output_token_ids)
        self.cancelled = False
        self.degraded = False  # placed in a cheaper model's pool (free tier under load)
        self._attempt: tuple[Link, str] | None = None  # the engine attempt in progress, by its id
        self._first_token_at: float | None = None
        # What the attempt waits for now: its timeout, its name, and whether the request's deadline
        # comes first.
        self._expecting: tuple[float, str, bool] = (0.0, "", False)

    def cancel(self) -> None:
        """The client sent `cancel`: forward it to the engine now; no further attempts."""
        self.cancelled = True
        if self._attempt is not None:
            link, attempt_id = self._attempt
            link.cancel(attempt_id)

    def close(self) -> None:
        """The client is gone: cancel the attempt in progress (the engine frees the request's blocks)."""
        if self._attempt is not None:
            link, attempt_id = self._attempt
            link.release(attempt_id)

    async def run(self, emit: Emit) -> None:
        """Relays the request: each frame for the client goes to ``emit`` (token frames from the engine
        link's reading task), `finished` last; raises ServiceError if the request fails."""
        failures: list[tuple[str, AttemptFailed]] = []  # (engine id, what went wrong there)
        for attempt in range(1, self.config.max_attempts + 1):
            if self.cancelled:
                emit(self._cancelled_here())
                return
            if self._time_left() <= 0:
                raise _deadline_passed("another engine")
            try:
                placement = self.placer.place(
                    self.plan, {engine_id for engine_id, _ in failures}, attempt == 1
                )
            except ServiceError as exc:
                if not failures:
                    raise
                raise self._give_up(failures, exc) from None
            if failures:
                self.metrics.failovers.labels(failures[-1][1].failure).inc()
            if placement.degraded:
                # Failovers stay in the cheaper pool: the output so far continues on the same weights.
                self.plan.model, self.degraded = placement.model, True
            engine = placement.engine
            attempt_id = self.start.request_id if attempt == 1 else f"{self.start.request_id}#{attempt}"
            # Counted on the engine before anything awaits, so the next placement already sees it.
            context = len(self.plan.prompt) + len(self.output)
            rank = tier_of_proto(self.plan.tier).rank
            engine.dispatched(attempt_id, context, rank, placement.predicted_cached_tokens)
            try:
                emit(
                    router_pb2.ResponseFrame(
                        routed=router_pb2.GenerateRouted(
                            engine_id=engine.engine_id,
                            predicted_cached_tokens=placement.predicted_cached_tokens,
                            attempt=attempt,
                            model=placement.model,
                            degraded=self.degraded,
                        )
                    )
                )
                queue_limit_s = self._queue_limit_s(engine, context - placement.predicted_cached_tokens)
                await self._stream(placement, attempt_id, queue_limit_s, emit)
                return
            except AttemptFailed as exc:
                failures.append((engine.engine_id, exc))
            finally:
                engine.ended(attempt_id, completed=False)  # no-op when the attempt finished
        if self.cancelled:
            emit(self._cancelled_here())
            return
        raise self._give_up(failures)

    @staticmethod
    def _give_up(failures: list[tuple[str, AttemptFailed]], last: ServiceError | None = None) -> ServiceError:
        said = "; ".join(f"{engine_id}: {exc.message}" for engine_id, exc in failures)
        delays = [exc.retry_after_s for _, exc in failures if exc.retry_after_s is not None]
        if failures and len(delays) == len(failures):  # every engine tried had a full queue
            return ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"every engine tried is full ({said})", min(delays)
            )
        then = f"; then: {last.message}" if last is not None else ""
        return ServiceError(
            grpc.StatusCode.UNAVAILABLE, f"the request failed on {len(failures)} engine(s): {said}{then}"
        )

    # -- one attempt ---------------------------------------------------------------------------------

    def _queue_limit_s(self, engine: EngineState, prefill_tokens: int) -> float:
        """How long ``engine`` may keep this attempt queued before its first step: what is left of the
        tier's TTFT objective less the engine's time from that step to a first token (its prefill of
        ``prefill_tokens`` at its current step time, or its measured head-of-queue TTFT) (on a failover
        too: an engine that refused it as full, or died, spent part of it). 0 (no limit) for a request
        held to no objective: under the count rule, or once its client has output (a continuation, a
        failover mid-answer)."""
        objective = self.config.objective_s(tier_of_proto(self.plan.tier).name, admit=True)
        if objective is None or self.output:
            return 0.0
        left = objective - (time.monotonic() - self.arrival) - engine.start_to_first_token_s(prefill_tokens)
        return max(MIN_QUEUE_LIMIT_S, left)

    async def _stream(self, placement: Placement, attempt_id: str, queue_limit_s: float, emit: Emit) -> None:
        engine = placement.engine
        link = engine.link
        span = request_span(link.messages.span_name, trace.SpanKind.CLIENT)
        span.set_attribute("chatmesh.engine_id", engine.engine_id)
        # A client's `cancel` goes out the moment it arrives (``cancel``); so does one that came before.
        feed = link.open(self._engine_start(engine, attempt_id, queue_limit_s), trace_context(span))
        self._attempt = (link, attempt_id)
        if self.cancelled:
            link.cancel(attempt_id)
        idle = Deadline()  # each wait for the engine's next frames has its own time
        try:
            self._expect(idle, self.config.accept_timeout_s, "`accepted`")
            batch = await self._take(feed, idle)
            if (kind := batch[0].WhichOneof("kind")) != "accepted":
                raise AttemptFailed("protocol", f"the engine sent {kind} before `accepted`")
            batch = batch[1:]
            self._expect(idle, self.config.first_token_timeout_s, "the first token")
            if queue_limit_s:
                batch = await self._first_tokens(feed, idle, batch)
            relay_tokens = partial(self._relay_tokens, engine, attempt_id, idle, emit)
            # From here on the engine's tokens are relayed as they arrive, this task woken only for the
            # rest: nothing awaits between a take and the handling of what it took, so the order holds.
            feed.on_tokens = relay_tokens
            while True:
                for frame in batch:
                    kind = frame.WhichOneof("kind")
                    if kind == "tokens":
                        relay_tokens(frame.tokens)
                    elif kind == "finished":
                        engine.ended(attempt_id, completed=True)
                        self.placer.remember(self.plan, engine, self.output)
                        emit(router_pb2.ResponseFrame(finished=self._finished(frame.finished, placement)))
                        return
                    else:
                        raise AttemptFailed("protocol", f"the engine sent an unexpected {kind} frame")
                batch = await self._take(feed, idle)
        except ServiceError as exc:
            span.set_status(trace.StatusCode.ERROR, exc.message)
            raise
        finally:
            idle.close()
            self._attempt = None
            link.release(attempt_id)
            span.end()

    def _relay_tokens(
        self,
        engine: EngineState,
        attempt_id: str,
        idle: Deadline,
        emit: Emit,
        tokens: engine_pb2.GenerateTokens,
    ) -> None:
        """One token frame from the engine, to the client; the wait for the next one starts over."""
        new = self._new_tokens(tokens)
        engine.progressed(attempt_id, len(self.plan.prompt) + len(self.output))
        self._expect(idle, self.config.idle_timeout_s, "the next token")
        if new is not None:
            emit(router_pb2.ResponseFrame(tokens=new))

    async def _first_tokens(
        self, feed: RequestFeed, idle: Deadline, batch: list[engine_pb2.ResponseFrame]
    ) -> list[engine_pb2.ResponseFrame]:
        """The first frames after `accepted`, for an attempt with a queue limit: the engine's
        RESOURCE_EXHAUSTED now means it dropped the request unstarted at that limit, which
        ends the request (its objective is spent on any engine) rather than the attempt."""
        if batch:
            return batch
        try:
            return await self._take(feed, idle)
        except AttemptFailed as exc:
            if exc.failure != "exhausted":
                raise
            tier = tier_of_proto(self.plan.tier).name
            self.metrics.queue_expired.labels(tier).inc()
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no engine could start the request within the {tier} tier's time-to-first-token "
                "objective; retry later",
                max(RETRY_MIN_S, exc.retry_after_s or RETRY_MIN_S),
            ) from None

    def _engine_start(
        self, engine: EngineState, attempt_id: str, queue_limit_s: float
    ) -> engine_pb2.GenerateStart:
        start, info = self.start, engine.info
        return engine_pb2.GenerateStart(
            request_id=attempt_id,
            prompt_token_ids=self.plan.prompt,
            resumed_output_token_ids=self.output,
            sampling=start.sampling,
            priority=tier_of_proto(start.tier).priority,
            model=info.model if info is not None else "",
            tokenizer_fingerprint=start.tokenizer_fingerprint,
            max_queue_ms=round(queue_limit_s * 1000),
        )

    def _expect(self, idle: Deadline, timeout_s: float, waiting_for: str) -> None:
        """The attempt waits for ``waiting_for`` next: ``idle`` ends that wait after ``timeout_s``, or at
        the request's deadline if that comes first."""
        left = self._time_left()
        self._expecting = (timeout_s, waiting_for, left <= timeout_s)
        idle.reschedule_in(min(timeout_s, left))

    async def _take(self, feed: RequestFeed, idle: Deadline) -> list[engine_pb2.ResponseFrame]:
        """The engine's frames that arrived since the last take (at least one), token frames in a row
        merged into one, within the wait that ``_expect`` set on ``idle``."""
        try:
            batch = await idle.wait(feed.take())
        except TimeoutError:
            timeout_s, waiting_for, deadline = self._expecting
            if deadline:  # the client's time is up: no other engine would do better
                raise _deadline_passed(waiting_for) from None
            raise AttemptFailed(
                "timeout", f"nothing within {timeout_s:g}s (waiting for {waiting_for})"
            ) from None
        except AttemptFailed:  # raised relaying a token frame as it arrived
            raise
        except ServiceError as error:  # the engine refused or failed the request, or its stream ended
            code = error.code
            if code in _CALLER_ERRORS:
                raise ServiceError(code, error.message or code.name) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise AttemptFailed(
                    "exhausted", error.message or "queue full", error.retry_after_s or 1.0
                ) from None
            raise AttemptFailed(code.name.lower(), f"{code.name}: {error.message}") from None
        return coalesced(batch)

    def _new_tokens(self, tokens: engine_pb2.GenerateTokens) -> engine_pb2.GenerateTokens | None:
        """Appends a frame's tokens to the output; drops any the client already has (never expected)."""
        have = len(self.output)
        if tokens.index > have:
            raise AttemptFailed("protocol", f"the engine skipped output positions {have}..{tokens.index - 1}")
        if tokens.index < have:
            skip = have - tokens.index
            if skip >= len(tokens.token_ids):
                return None
            # The text of the tokens dropped went out with them; a frame without per-token ends keeps all.
            tokens = tokens_after(tokens, skip)
        self.output.extend(tokens.token_ids)
        if self._first_token_at is None:
            self._first_token_at = time.monotonic()
            self.metrics.time_to_first_token.observe(self._first_token_at - self.arrival)
        return tokens

    def _finished(
        self, finished: engine_pb2.GenerateFinished, placement: Placement
    ) -> engine_pb2.GenerateFinished:
        """The engine's `finished`, with usage for the whole request: the original prompt, all output."""
        usage = finished.usage
        metrics = self.metrics
        metrics.prompt_tokens.inc(usage.prompt_tokens)
        metrics.predicted_cached_tokens.inc(placement.predicted_cached_tokens)
        metrics.cached_tokens.inc(usage.cached_prompt_tokens)
        reason = engine_pb2.FinishReason.Name(finished.finish_reason).removeprefix("FINISH_REASON_").lower()
        metrics.request_duration.labels(reason).observe(time.monotonic() - self.arrival)
        return engine_pb2.GenerateFinished(
            finish_reason=finished.finish_reason,
            text=finished.text,
            matched_stop=finished.matched_stop,
            usage=engine_pb2.Usage(
                prompt_tokens=len(self.plan.prompt),
                cached_prompt_tokens=min(usage.cached_prompt_tokens, len(self.plan.prompt)),
                completion_tokens=len(self.output),
            ),
        )

    def _cancelled_here(self) -> router_pb2.ResponseFrame:
        """Cancelled between attempts: no engine holds the request, so the router says `finished` itself."""
        return router_pb2.ResponseFrame(
            finished=engine_pb2.GenerateFinished(
                finish_reason=engine_pb2.FINISH_REASON_CANCELLED,
                usage=engine_pb2.Usage(
                    prompt_tokens=len(self.plan.prompt), completion_tokens=len(self.output)
                ),
            )
        )

    def _time_left(self) -> float:
        """Seconds left of the request's deadline (the client's, capped at ``max_request_s``); 0 once
        it has passed."""
        allowed = (
            self.config.max_request_s
            if self.deadline_s is None
            else min(self.config.max_request_s, self.deadline_s)
        )
        return max(0.0, allowed - (time.monotonic() - self.arrival))


def _deadline_passed(waiting_for: str) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.DEADLINE_EXCEEDED, f"the request's deadline passed (waiting for {waiting_for})"
    )
