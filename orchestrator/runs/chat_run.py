"""What the two kinds of run of a stored chat (send, regenerate) share: started once per idempotency
key, their run row and answer stored, their chat's summary kept fresh."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import enum
import hashlib
import time
import uuid
from collections.abc import Awaitable, Sequence
from datetime import datetime
from typing import TypeVar

from opentelemetry import trace

from chatmesh.chat.v1 import chat_pb2
from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import REFUSED_BEFORE_ANSWER, unavailable
from chatmesh.identity import Identity
from chatmesh.limits import Generation
from chatmesh.tokenizer import ChatMessage
from memory_store.errors import MemoryStoreError, NotFound
from memory_store.models import Chat, Claim, Message, NewRun, Run, RunStatus
from orchestrator.config import LEASE_SKEW_S
from orchestrator.prompting.models import ServedModel
from orchestrator.prompting.prompt import Prompt
from orchestrator.runs.answer_run import AnswerRun, key_reused
from orchestrator.runs.context import RunContext
from orchestrator.runs.held_run import RunInfo
from orchestrator.runs.relay import RunEnd
from orchestrator.runs.starts import Admission
from orchestrator.tools.toolbox import offered_grammar

tracer = trace.get_tracer("orchestrator")

T = TypeVar("T")
# The requests that start a stored chat's run.
ChatRequest = chat_pb2.SendMessageRequest | chat_pb2.RegenerateMessageRequest

# How often a retry looks for the run an earlier attempt is starting.
LEASE_POLL_S = 0.2


def ended_unanswered(run: Run) -> bool:
    """Whether ``run`` failed before its answer began, for a reason a retry may not meet: nothing of it
    was generated or charged, so its key's retry starts the answer again instead of joining it."""
    return (
        run.status is RunStatus.FAILED
        and run.error_code in REFUSED_BEFORE_ANSWER
        and run.usage is not None
        and run.usage.completion_tokens == 0
    )


class _KeyRun(enum.Enum):
    NONE = "none"
    GOING = "going"
    UNANSWERED = "unanswered"


class ChatRun(AnswerRun):
    """A run of a stored chat: started once per idempotency key, its run row and answer stored."""

    outlives_caller = True
    # The model answering: the one the request names, else the chat's (``answer_as_the_chat``).
    model: ServedModel

    def __init__(
        self, ctx: RunContext, identity: Identity, request: ChatRequest, key: str, options: Generation
    ) -> None:
        super().__init__(identity)
        self.ctx = ctx
        # The orchestrator's own tools this answer is offered (docs/tools.md): not with a constraint of
        # the caller's, which the tools' grammar would replace, nor to a caller asking for logprobs,
        # which cover the answer's text (a call's tokens are a step's, no text's).
        toolbox = ctx.runs.deps.toolbox
        offered = toolbox is not None and options.structured is None and not options.logprobs
        self.tools = toolbox.tools_for(identity.tier, 0) if toolbox and offered else None
        self.options = self._offering_tools(options)
        # A request without a key is its own run: only retries that carry a key can join.
        self._key = key or f"auto:{uuid.uuid4().hex}"
        self._retryable = bool(key)
        # What a retry with the key is compared by (a request without one is never compared).
        self._fingerprint = _fingerprint(self.kind, request) if key else b""
        # The key's start lease while this attempt holds it (``claim``), and when it was taken.
        self._lease: datetime | None = None
        self._leased_at = 0.0

    @property
    def idempotency_key(self) -> str:
        return self._key

    @property
    def fingerprint(self) -> bytes:
        return self._fingerprint

    async def claim(self) -> Claim | None:
        """Claims the idempotency key: the ids of this run. None when an attempt with the key started
        its run, or is starting it (here or on another replica): this one joins that run, live at once.
        A request without a key claims nothing: its ids are its own (``unkeyed_claim``).

        Only the attempt holding the key's start lease starts its run (the first one, or a retry once
        an earlier attempt was refused or lost), so a retry never generates the answer a second time.
        A run that ended unanswered (``ended_unanswered``) is not joined: the retry renews the key
        with a new run that answers the same question.
        """
        store, user = self.ctx.store, self.identity.user_id
        lease_s = self.ctx.config.runs.start_lease_s
        if not self._retryable:  # nothing can join it: no claim to store
            self._leased_at = time.monotonic()
            claim = store.unkeyed_claim(lease_s)
            self._lease = claim.start_lease
            return claim
        # A lease runs from before the call that took it was sent (its expiry is reckoned then).
        sent = time.monotonic()
        with tracer.start_as_current_span("claim idempotency key"):
            claim = await store.claim_idempotency_key(user, self._key, self._fingerprint, lease_s)
        if not claim.fingerprint_matches:
            raise key_reused()
        self._lease, leased_at = claim.start_lease, sent
        deadline = time.monotonic() + lease_s
        while self._lease is None:
            found = await self._key_run(claim.run_id)
            if found is _KeyRun.UNANSWERED:
                sent = time.monotonic()
                renewed = await store.renew_claim(user, self._key, claim, lease_s)
                if renewed is None:  # another retry renewed it first: wait for its run
                    renewed = await store.claim_idempotency_key(user, self._key, self._fingerprint, lease_s)
                claim, self._lease, leased_at = renewed, renewed.start_lease, sent
                continue
            if found is _KeyRun.GOING:
                self.started.set_result(claim.run_id)
                return None
            sent = time.monotonic()
            self._lease, leased_at = await store.take_start_lease(user, self._key, lease_s), sent
            if self._lease is None:
                if time.monotonic() > deadline:
                    raise unavailable(
                        "an earlier attempt of this request is still starting its answer; retry", 1.0
                    )
                await asyncio.sleep(LEASE_POLL_S)
            elif await self._key_run(claim.run_id) is not _KeyRun.NONE:
                # The earlier attempt started the run just before its lease ran out: join it (or, had
                # it ended unanswered already, renew it).
                self._lease = None
        self._leased_at = leased_at
        return claim

    async def claim_while(self, reads: Awaitable[T]) -> tuple[Claim, T] | None:
        """``claim`` with the run's first reads going on meanwhile (they do not need its ids), which
        saves the claim's round trip on the way to the first token. Both are waited for before either's
        failure is raised, the claim's first, so a lease taken is always known to ``abandoned``. None
        when the key's run already exists (or is starting): this attempt joined it."""
        claiming, reading = asyncio.ensure_future(self.claim()), asyncio.ensure_future(reads)
        try:
            await asyncio.wait([claiming, reading])
        except asyncio.CancelledError:
            claiming.cancel()
            reading.cancel()
            raise
        claim = claiming.result() if claiming.exception() is None else None
        if claim is None:
            if not reading.cancelled():
                reading.exception()  # whatever the reads found no longer matters
            claiming.result()  # raises the claim's failure, if that is why
            return None
        return claim, reading.result()

    async def _key_run(self, run_id: str) -> _KeyRun:
        """What became of the run a key names: none yet, ended unanswered, or anything else to join
        (live here, stored in progress, or ended any other way)."""
        if self.ctx.runs.held.is_running(run_id):
            return _KeyRun.GOING
        try:
            run = await self.ctx.store.get_run(self.identity.user_id, run_id)
        except NotFound:
            return _KeyRun.NONE
        return _KeyRun.UNANSWERED if ended_unanswered(run) else _KeyRun.GOING

    async def abandoned(self) -> None:
        """Refused before going live: a retry with the key may start the run at once (a key of our own
        making is never retried: nothing to release)."""
        if self._lease is not None and self._retryable:
            with contextlib.suppress(MemoryStoreError, TimeoutError):
                await self.ctx.store.release_start_lease(self.identity.user_id, self._key, self._lease)

    def system_turns(self, instructions: str = "") -> list[ChatMessage] | None:
        """The prompt's system turn: ``instructions`` or the configured system prompt (None), with the
        tools offered described after it."""
        if self.tools is None:
            return [ChatMessage("system", instructions)] if instructions else None
        base = instructions or self.ctx.config.prompt.system_prompt
        return [ChatMessage("system", f"{base}\n\n{self.tools.system_text()}")]

    def run_info(self, claim: Claim, chat_id: str, user_message_id: str = "") -> RunInfo:
        return RunInfo(
            run_id=claim.run_id,
            user_id=self.identity.user_id,
            tier=self.identity.tier,
            kind=self.kind,
            model=self.options.model,
            max_tokens=self.options.max_tokens,
            max_tool_steps=self.ctx.config.tools.max_steps if self.tools is not None else 0,
            chat_id=chat_id,
            user_message_id=user_message_id,
            assistant_message_id=claim.assistant_message_id,
        )

    async def create_run(
        self,
        admission: Admission,
        parent_id: str,
        asked: tuple[Message, Chat] | None = None,
        before: Sequence[Message] = (),
    ) -> Run:
        """The run's row, owned by this replica: from here on the answer is stored, once (and if this
        replica dies, another one adopts it and continues it from its stored generation). ``asked`` is
        the message it answers when the run stores it too (a send), in the same round trips, with the
        chat as read with the branch it continues (nothing is read again); ``before``, the tool results
        the send stores before it."""
        runs = self.ctx.config.runs
        if time.monotonic() - self._leased_at > runs.start_lease_s - runs.create_run_s - LEASE_SKEW_S:
            # Its writes could land after the lease passed to a retry elsewhere, which would start the
            # run too (the same answer, from the same seed: router_client.request_seed, but twice).
            raise unavailable("starting the answer took too long; retry", 1.0)
        info = admission.info
        new = NewRun(
            user_id=info.user_id,
            chat_id=info.chat_id,
            run_id=info.run_id,
            parent_message_id=parent_id,
            assistant_message_id=info.assistant_message_id,
            model=info.model,
            owner_id=self.ctx.config.replica_id,
            user_message_id=asked[0].message_id if asked else None,
            prompt_tokens=len(admission.prompt.token_ids),
            generation=admission.start.SerializeToString(),
            charge_id=admission.charge_id,
            tokenizer_fingerprint=admission.prompt.fingerprint,
        )
        # No write of it goes out past its share of the lease.
        async with asyncio.timeout(runs.create_run_s):
            if asked is None:
                return await self.ctx.store.create_run(new)
            return await self.ctx.store.create_run_with_question(new, *asked, before=before)

    def answer_as_the_chat(self, chat: Chat, named: chat_pb2.GenerationOptions) -> None:
        """A request naming no model is answered by the chat's own (recorded at its creation or by its
        last switch): the options are checked again for that model."""
        if named.model or not chat.model or chat.model == self.model.name:
            return
        options = chat_pb2.GenerationOptions()
        options.CopyFrom(named)
        options.model = chat.model
        self.model, resolved = self.ctx.models.resolve(options, self.ctx.config.limits, chat=True)
        self.options = self._offering_tools(resolved)

    def _offering_tools(self, options: Generation) -> Generation:
        """``options`` constrained to the offered tools' grammar (text, or a call), if any are."""
        if self.tools is None:
            return options
        grammar = offered_grammar(self.tools)
        return dataclasses.replace(options, structured=engine_pb2.StructuredOutput(grammar=grammar))

    async def switch_chat(self, chat: Chat, named: chat_pb2.GenerationOptions) -> None:
        """A request naming another model than the chat's switches the chat to it, before the run is
        admitted: its next requests that name none are answered by it too. Nothing else changes: every
        prompt renders the stored history anew with the answering model's template and counts it with
        its tokenizer."""
        if named.model and self.model.name != (chat.model or self.ctx.models.default):
            async with asyncio.timeout(self.ctx.config.runs.store_deadline_s):
                await self.ctx.store.set_chat_model(self.identity.user_id, chat.chat_id, self.model.name)

    def refresh_summary(self, chat_id: str, prompt: Prompt, end: RunEnd) -> None:
        """A history that outgrows its share of the prompt gets a new rolling summary (background)."""
        self.ctx.upkeep.refresh_summary(
            self.identity.user_id, chat_id, prompt, end.assistant_message_id, self.model.tokenizer
        )


def _fingerprint(kind: str, request: ChatRequest) -> bytes:
    """What makes two requests "the same" for an idempotency key: everything but the key itself and how
    the stream delivers the answer."""
    compared = copy.deepcopy(request)
    compared.idempotency_key = ""
    compared.merge_deltas = False
    return hashlib.sha256(kind.encode() + b"\x00" + compared.SerializeToString(deterministic=True)).digest()
