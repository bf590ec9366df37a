"""Starting answers: SendMessage, RegenerateMessage and Complete, up to the point where a run streams.

A send, step by step (each step is idempotent, so a retry with the same key resumes where an
earlier attempt stopped):

    limits, input moderation
    ─► claim the idempotency key (same key + same request → same ids; + other request → ALREADY_EXISTS)
    ─► a run for the key exists? join it
    ─► parent (explicit, the newest message, or none for a new root branch) ∥ the chat's summary
       (both reads check the chat is the caller's)
    ─► history (the branch after the summary) ─► prompt fitted to window - max_tokens
    ─► runs.start: run slot, budget reservation ∥ router placement, then persist the user message
       and the run, then `started` and the generation task

Nothing is persisted before the router has placed the request, so a refusal (limits, moderation,
budget, no capacity) leaves no message behind. Concurrent duplicates on this replica share one
pipeline (they wait for the same task); the task is the replica's, so a client that goes away while
it runs does not stop it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.protobuf.message import Message as ProtoMessage
from opentelemetry import trace

from chatmesh import limits
from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError, invalid, not_found
from chatmesh.identity import Identity
from chatmesh.tokenizer import ChatMessage, ChatTokenizer
from memory_store.errors import NotFound
from memory_store.ids import new_id
from memory_store.models import ChatSummary, Claim, Message, Role, Run, RunStatus
from memory_store.store import MemoryStore
from orchestrator.background import BackgroundJobs
from orchestrator.config import OrchestratorConfig
from orchestrator.generation import RunEnd
from orchestrator.history import load_history, turns
from orchestrator.live_run import LiveRun, RunInfo
from orchestrator.metrics import METRICS
from orchestrator.moderation import Moderator
from orchestrator.prompt import Prompt, PromptTooLong, fit_prompt
from orchestrator.runs import RunRequest, Runs
from orchestrator.summaries import Summarizer, needs_refresh
from orchestrator.titles import Titler

tracer = trace.get_tracer("orchestrator")
T = TypeVar("T")

_PROMPT_ROLES = {
    chat_pb2.ROLE_SYSTEM: "system",
    chat_pb2.ROLE_USER: "user",
    chat_pb2.ROLE_ASSISTANT: "assistant",
}


def fingerprint(kind: str, request: ProtoMessage) -> bytes:
    """What makes two requests "the same" for an idempotency key: everything but the key itself."""
    copy = type(request)()
    copy.CopyFrom(request)
    if hasattr(copy, "idempotency_key"):
        copy.idempotency_key = ""
    return hashlib.sha256(kind.encode() + b"\x00" + copy.SerializeToString(deterministic=True)).digest()


@dataclass(frozen=True)
class Upkeep:
    """Background work after a run: titles and summaries (either may be switched off)."""

    jobs: BackgroundJobs
    titler: Titler | None
    summarizer: Summarizer | None


class Answers:
    def __init__(
        self,
        config: OrchestratorConfig,
        store: MemoryStore,
        runs: Runs,
        tokenizer: ChatTokenizer,
        moderator: Moderator,
        context_window: int,
        upkeep: Upkeep,
    ) -> None:
        self.config = config
        self.limits = config.limits
        self.store = store
        self.runs = runs
        self.tokenizer = tokenizer
        self.moderator = moderator
        self.context_window = context_window
        self.default_model = config.default_model or tokenizer.model_name
        self.upkeep = upkeep
        self._inflight: dict[tuple[str, str], asyncio.Task[str]] = {}

    # -- SendMessage ----------------------------------------------------------------------------

    async def send(self, identity: Identity, request: chat_pb2.SendMessageRequest) -> str:
        """Starts (or joins) the answer to a new user message; returns its run id."""
        arrived_at = time.monotonic()
        _checked(limits.check_id, request.chat_id, "chat_id")
        _checked(limits.check_content, request.content, self.limits)
        options = _checked(limits.generation, request.options, self.limits, self.default_model)
        _checked(limits.check_idempotency_key, request.idempotency_key, self.limits)
        if request.branch_from_root and request.parent_message_id:
            raise invalid("parent_message_id", "parent_message_id must be empty with branch_from_root")
        self._moderate(identity, request.content, "content")
        return await self._once(
            identity,
            request.idempotency_key,
            fingerprint("send", request),
            lambda claim: self._send(identity, request, options, claim, arrived_at),
        )

    async def _send(
        self,
        identity: Identity,
        request: chat_pb2.SendMessageRequest,
        options: limits.Generation,
        claim: Claim,
        arrived_at: float,
    ) -> str:
        user, chat_id = identity.user_id, request.chat_id
        # Both reads check that the chat is the caller's (NOT_FOUND otherwise).
        parent_id, summary = await asyncio.gather(
            self._parent(identity, request), self.store.get_summary(user, chat_id)
        )
        if parent_id is not None and uuid.UUID(parent_id).time >= uuid.UUID(claim.user_message_id).time:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the message this one would follow was written after this send began (another send "
                "to this chat at the same time, or a retry of an old idempotency key); send it again "
                "with a new idempotency key",
            )
        prompt = await self._branch_prompt(
            user, chat_id, parent_id, summary, options, [ChatMessage("user", request.content)], "content"
        )
        info = _chat_run(identity, claim, "send", options, chat_id, claim.user_message_id)

        async def persist() -> Run:
            await self.store.append_message(
                user,
                Message(
                    message_id=claim.user_message_id,
                    chat_id=chat_id,
                    role=Role.USER,
                    content=request.content,
                    parent_id=parent_id,
                    token_count=len(self.tokenizer.encode(request.content)),
                    run_id=claim.run_id,
                ),
            )
            return await self._create_run(info, claim.user_message_id, claim.user_message_id)

        async def on_end(end: RunEnd) -> None:
            # A first exchange (of the chat, or of a new root branch): the job keeps a title already set.
            if parent_id is None and end.status is RunStatus.COMPLETED and self.upkeep.titler is not None:
                titler = self.upkeep.titler
                self.upkeep.jobs.submit(
                    "title",
                    chat_id,
                    lambda: titler.name_chat(user, chat_id, request.content, end.live.text()),
                )
            self._maybe_summarize(user, chat_id, prompt, end)

        await self._start(identity, info, prompt, options, arrived_at, persist, on_end)
        return claim.run_id

    async def _parent(self, identity: Identity, request: chat_pb2.SendMessageRequest) -> str | None:
        if request.branch_from_root:
            return None
        if request.parent_message_id:
            try:
                message = await self.store.get_message(
                    identity.user_id, request.chat_id, request.parent_message_id
                )
            except NotFound:
                raise not_found("message", request.parent_message_id) from None
            return message.message_id
        latest = await self.store.get_latest_message(identity.user_id, request.chat_id)
        return latest.message_id if latest else None

    # -- RegenerateMessage ----------------------------------------------------------------------

    async def regenerate(self, identity: Identity, request: chat_pb2.RegenerateMessageRequest) -> str:
        """Starts (or joins) a new answer to the question an earlier answer answered."""
        arrived_at = time.monotonic()
        _checked(limits.check_id, request.chat_id, "chat_id")
        _checked(limits.check_id, request.message_id, "message_id")
        options = _checked(limits.generation, request.options, self.limits, self.default_model)
        _checked(limits.check_idempotency_key, request.idempotency_key, self.limits)
        return await self._once(
            identity,
            request.idempotency_key,
            fingerprint("regenerate", request),
            lambda claim: self._regenerate(identity, request, options, claim, arrived_at),
        )

    async def _regenerate(
        self,
        identity: Identity,
        request: chat_pb2.RegenerateMessageRequest,
        options: limits.Generation,
        claim: Claim,
        arrived_at: float,
    ) -> str:
        user, chat_id = identity.user_id, request.chat_id
        try:
            answer, summary = await asyncio.gather(
                self.store.get_message(user, chat_id, request.message_id),
                self.store.get_summary(user, chat_id),
            )
        except NotFound:
            raise not_found("message", request.message_id) from None
        if answer.role is not Role.ASSISTANT or answer.parent_id is None:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"message {request.message_id} is not an answer; only assistant messages can be regenerated "
                "(to change a question, send the new text with its parent_message_id)",
            )
        question_id = answer.parent_id
        prompt = await self._branch_prompt(user, chat_id, question_id, summary, options, [], "message_id")
        info = _chat_run(identity, claim, "regenerate", options, chat_id)

        async def on_end(end: RunEnd) -> None:
            self._maybe_summarize(user, chat_id, prompt, end)

        await self._start(
            identity,
            info,
            prompt,
            options,
            arrived_at,
            lambda: self._create_run(info, question_id, None),
            on_end,
        )
        return claim.run_id

    # -- Complete -------------------------------------------------------------------------------

    async def complete(self, identity: Identity, request: chat_pb2.CompleteRequest) -> LiveRun:
        """Starts an answer to a caller-supplied conversation; nothing is stored but its token usage."""
        arrived_at = time.monotonic()
        options = _checked(limits.generation, request.options, self.limits, self.default_model)
        messages = self._conversation(identity, request)
        system = []
        while messages and messages[0].role == "system":
            system.append(messages.pop(0))
        if not messages:
            raise invalid("messages", "the conversation needs a message after the system messages")
        prompt = self._fit(messages, options, None, "messages", system=system or None)
        if prompt.history == "truncated":
            raise invalid(
                "messages",
                f"the conversation needs {prompt.full_tokens} tokens; {prompt.budget} fit in the "
                f"{self.context_window}-token context window with max_tokens={options.max_tokens}",
            )
        info = RunInfo(
            run_id=str(new_id()),
            user_id=identity.user_id,
            tier=identity.tier,
            kind="complete",
            model=options.model,
            max_tokens=options.max_tokens,
        )

        async def persist() -> None:
            return None

        async def on_end(end: RunEnd) -> None:
            # The reservation becomes the actual count (Complete runs have no stored finish to do it).
            await self.store.record_usage(identity.user_id, info.run_id, end.usage)

        # Unlike a send, a Complete whose client leaves before `started` is abandoned: nothing could
        # ever attach to it (the client never learnt its run id) and nothing of it is stored.
        return await self._start(identity, info, prompt, options, arrived_at, persist, on_end)

    def _conversation(self, identity: Identity, request: chat_pb2.CompleteRequest) -> list[ChatMessage]:
        if not request.messages:
            raise _limit(invalid("messages", "messages must not be empty"))
        if len(request.messages) > self.limits.max_prompt_messages:
            raise _limit(invalid("messages", f"at most {self.limits.max_prompt_messages} messages"))
        out = []
        for i, message in enumerate(request.messages):
            field = f"messages[{i}].content"
            role = _PROMPT_ROLES.get(message.role)
            if role is None:
                raise _limit(invalid(f"messages[{i}].role", "role must be system, user or assistant"))
            # Only the last message must say something; every one is bounded in size.
            last = i == len(request.messages) - 1
            if last or len(message.content.encode()) > self.limits.max_message_bytes:
                _checked(limits.check_content, message.content, self.limits, field)
            if role == "user":
                self._moderate(identity, message.content, field)
            out.append(ChatMessage(role, message.content))
        return out

    # -- shared steps ---------------------------------------------------------------------------

    def _moderate(self, identity: Identity, text: str, field: str) -> None:
        """Input moderation: a blocked text is refused before anything is read or written."""
        decision = self.moderator.check_input(text, f"user {identity.user_id}")
        if decision.blocked:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the message was refused by the content policy ({decision.category})",
                field=field,
                reason="CONTENT_FILTER",
            )

    async def _once(
        self,
        identity: Identity,
        key: str,
        request_fingerprint: bytes,
        pipeline: Callable[[Claim], Awaitable[str]],
    ) -> str:
        """Runs the pipeline once per idempotency key: duplicates here wait for the same task, retries
        after it ended join its run, and a run started for the key on another replica is joined too."""
        key = key or f"auto:{uuid.uuid4().hex}"
        slot = (identity.user_id, key)
        task = self._inflight.get(slot)
        if task is None:
            task = asyncio.create_task(self._claimed(identity, key, request_fingerprint, pipeline))
            self._inflight[slot] = task

            def forget(done: asyncio.Task[str]) -> None:
                self._inflight.pop(slot, None)
                if not done.cancelled():
                    done.exception()  # seen here too: callers that went away must not leave it unread

            task.add_done_callback(forget)
        return await asyncio.shield(task)

    async def _claimed(
        self,
        identity: Identity,
        key: str,
        request_fingerprint: bytes,
        pipeline: Callable[[Claim], Awaitable[str]],
    ) -> str:
        with tracer.start_as_current_span("claim idempotency key"):
            claim = await self.store.claim_idempotency_key(identity.user_id, key, request_fingerprint)
        if not claim.fingerprint_matches:
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS,
                "this idempotency key was already used for a different request; "
                "use a new key for a new message",
            )
        if not claim.created and await self._run_exists(identity.user_id, claim.run_id):
            return claim.run_id
        return await pipeline(claim)

    async def _run_exists(self, user_id: str, run_id: str) -> bool:
        """Whether an earlier attempt with this key started its run. An attempt on another replica may
        still be on its way to starting it, so look for a moment before concluding it never will."""
        if self.runs.is_live(run_id):
            return True
        deadline = time.monotonic() + self.config.runs.claim_wait_s
        while True:
            with contextlib.suppress(NotFound):
                await self.store.get_run(user_id, run_id)
                return True
            if time.monotonic() > deadline or self.runs.is_live(run_id):
                return self.runs.is_live(run_id)
            await asyncio.sleep(0.1)

    async def _branch_prompt(
        self,
        user_id: str,
        chat_id: str,
        leaf_id: str | None,
        summary: ChatSummary | None,
        options: limits.Generation,
        new: list[ChatMessage],
        field: str,
    ) -> Prompt:
        """The prompt continuing the branch that ends at ``leaf_id`` with the ``new`` turns."""
        history = await load_history(
            self.store, user_id, chat_id, leaf_id, self.config.prompt.max_history_messages, summary
        )
        summary_text = history.summary.text if history.summary else None
        return self._fit([*turns(history.messages), *new], options, summary_text, field)

    def _fit(
        self,
        conversation: list[ChatMessage],
        options: limits.Generation,
        summary: str | None,
        field: str,
        system: list[ChatMessage] | None = None,
    ) -> Prompt:
        budget = self.context_window - options.max_tokens
        if budget <= 0:
            raise _limit(
                invalid(
                    "options.max_tokens",
                    f"max_tokens={options.max_tokens} leaves no room for a prompt in the "
                    f"{self.context_window}-token context window",
                )
            )
        started = time.monotonic()
        with tracer.start_as_current_span("assemble prompt") as span:
            try:
                prompt = fit_prompt(
                    self.tokenizer,
                    system or [ChatMessage("system", self.config.prompt.system_prompt)],
                    conversation,
                    budget,
                    summary,
                )
            except PromptTooLong as exc:
                raise _limit(
                    invalid(
                        field,
                        f"the prompt needs {exc.needed} tokens but {exc.budget} fit in the "
                        f"{self.context_window}-token context window with max_tokens={options.max_tokens}; "
                        "shorten the message or lower max_tokens",
                    )
                ) from None
            span.set_attribute("chatmesh.prompt.tokens", len(prompt.token_ids))
            span.set_attribute("chatmesh.prompt.budget", budget)
            span.set_attribute("chatmesh.prompt.turns_kept", prompt.turns_kept)
            span.set_attribute("chatmesh.prompt.turns_available", prompt.turns_available)
            span.set_attribute("chatmesh.prompt.history", prompt.history)
        METRICS.prompt_assembly.observe(time.monotonic() - started)
        METRICS.prompt_history.labels(prompt.history).inc()
        return prompt

    async def _create_run(self, info: RunInfo, parent_id: str, user_message_id: str | None) -> Run:
        return await self.store.create_run(
            info.user_id,
            info.chat_id,
            run_id=info.run_id,
            parent_message_id=parent_id,
            assistant_message_id=info.assistant_message_id,
            model=info.model,
            owner_id=self.config.replica_id,
            user_message_id=user_message_id,
        )

    async def _start(
        self,
        identity: Identity,
        info: RunInfo,
        prompt: Prompt,
        options: limits.Generation,
        arrived_at: float,
        persist: Callable[[], Awaitable[Run | None]],
        on_end: Callable[[RunEnd], Awaitable[None]],
    ) -> LiveRun:
        with tracer.start_as_current_span("start run") as span:
            span.set_attribute("chatmesh.run_id", info.run_id)
            return await self.runs.start(
                RunRequest(identity, info, prompt, options, arrived_at, persist, on_end)
            )

    def _maybe_summarize(self, user_id: str, chat_id: str, prompt: Prompt, end: RunEnd) -> None:
        summarizer = self.upkeep.summarizer
        if summarizer is None or not end.assistant_message_id or not needs_refresh(prompt, summarizer.config):
            return
        leaf = end.assistant_message_id
        self.upkeep.jobs.submit(
            "summary", chat_id, lambda: summarizer.refresh(user_id, chat_id, leaf, prompt.budget)
        )


def _chat_run(
    identity: Identity,
    claim: Claim,
    kind: str,
    options: limits.Generation,
    chat_id: str,
    user_message_id: str = "",
) -> RunInfo:
    return RunInfo(
        run_id=claim.run_id,
        user_id=identity.user_id,
        tier=identity.tier,
        kind=kind,
        model=options.model,
        max_tokens=options.max_tokens,
        chat_id=chat_id,
        user_message_id=user_message_id,
        assistant_message_id=claim.assistant_message_id,
    )


def _limit(error: ServiceError) -> ServiceError:
    METRICS.limit_rejections.labels(error.field or "request").inc()
    return error


def _checked(check: Callable[..., T], *args: object) -> T:
    """Runs a limits check, counting what it refuses."""
    try:
        return check(*args)
    except ServiceError as error:
        raise _limit(error) from None
