"""SendMessage: a new user message in a chat, and the answer to it.

Every step is idempotent, so a retry with the same key resumes where an earlier attempt stopped; nothing
is persisted before the router has placed the request, so a refusal (limits, moderation, budget, no
capacity) leaves no message behind. A refusal after that (the engine's queue limit) leaves the question
stored, and its retry answers it with a new run instead of storing it again.
"""

from __future__ import annotations

import dataclasses
import uuid

import grpc

from chatmesh import limits
from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError, invalid, not_found
from chatmesh.identity import Identity
from chatmesh.tool_format import ToolCall, result_text
from memory_store.errors import NotFound
from memory_store.ids import id_before
from memory_store.models import Claim, Message, Role, RunStatus
from orchestrator.policy.refusals import checked
from orchestrator.prompting.history import History, turns
from orchestrator.runs.chat_run import ChatRun
from orchestrator.runs.context import RunContext


class SendRun(ChatRun):
    kind = "send"

    def __init__(self, ctx: RunContext, identity: Identity, request: chat_pb2.SendMessageRequest) -> None:
        checked(limits.check_id, request.chat_id, "chat_id")
        if request.tool_results:
            _check_tool_results(request, ctx.config.limits)
        else:
            checked(limits.check_content, request.content, ctx.config.limits)
        self.model, options = ctx.models.resolve(request.options, ctx.config.limits, chat=True)
        checked(limits.check_idempotency_key, request.idempotency_key, ctx.config.limits)
        if request.branch_from_root and request.parent_message_id:
            raise invalid("parent_message_id", "parent_message_id must be empty with branch_from_root")
        if request.instructions:
            checked(limits.check_content, request.instructions, ctx.config.limits, "instructions")
        super().__init__(ctx, identity, request, request.idempotency_key, options)
        self.request = request
        for field, text in self._asked_texts():
            ctx.moderator.screen_input(text, field, f"user {identity.user_id}")
        if request.instructions:
            ctx.moderator.screen_input(request.instructions, "instructions", f"user {identity.user_id}")

    async def execute(self) -> None:
        user, chat_id = self.identity.user_id, self.request.chat_id
        # 1. Claim the idempotency key: this run's ids (a retry joins the run an earlier attempt started,
        #    or answers anew if that one ended unanswered); meanwhile the branch the message follows and
        #    the chat's summary (the reads check the chat is the caller's).
        claimed = await self.claim_while(self._history())
        if claimed is None:
            return
        claim, history = claimed
        if history.leaf_id in self._own_ids(claim) or await self._asked_without_its_run(history):
            # The chat's newest message is this send's own: an earlier attempt stored it (and the tool
            # results before it) and was lost (or refused) before storing its run (a question too large
            # to go in one batch with its run is written first, and so is one whose batch failed).
            # Answer that message, after the one it follows; storing it again below rewrites the same
            # rows.
            claim = dataclasses.replace(claim, user_message_id=history.messages[-1].message_id)
            own, kept, leaf = self._own_ids(claim), list(history.messages), history.leaf_id
            while kept and kept[-1].message_id in own:
                leaf = kept.pop().parent_id
            history = dataclasses.replace(history, messages=kept, leaf_id=leaf)
        parent_id = history.leaf_id
        first_id = self._own_ids(claim)[0]
        if parent_id is not None and uuid.UUID(parent_id).time >= uuid.UUID(first_id).time:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the message this one would follow was written after this send began (another send "
                "to this chat at the same time, or a retry of an old idempotency key); send it again "
                "with a new idempotency key",
            )
        # 2. The prompt: the branch after the summary, then the new message (or tool results), fitted
        #    to the window, in the template of the model answering (the request's, else the chat's).
        self.answer_as_the_chat(history.chat, self.request.options)
        asked, before = self._asked(claim, history)  # counted with the answering model's tokenizer
        prompt = self.model.prompter.continue_branch(
            history,
            self.options,
            turns([*before, asked]),
            "tool_results" if before or asked.role is Role.TOOL else "content",
            system=self.system_turns(self.request.instructions),
        )
        await self.switch_chat(history.chat, self.request.options)
        info = self.run_info(claim, chat_id, claim.user_message_id)
        # 3. Admission (a run slot; the budget reserved while the router places the request), then the
        #    user message (or tool results) and the run persisted together, now that the answer will
        #    be generated.
        async with self.ctx.runs.starts.admit(self.identity, info, prompt, self.options) as admission:
            stored_run = await self.create_run(
                admission, claim.user_message_id, (asked, history.chat), before
            )
        # 4. Live: `started`, then the answer streamed until it ends; the end is stored once.
        end = await self.ctx.runs.starts.generate(self, admission, stored_run)
        # 5. Upkeep: the first exchange of a chat (or of a new root branch) names it; a long history
        #    gets a fresher summary.
        if parent_id is None and end.status is RunStatus.COMPLETED:
            self.ctx.upkeep.name_chat(user, chat_id, self.request.content, end.live.text())
        self.refresh_summary(chat_id, prompt, end)

    def _asked_texts(self) -> list[tuple[str, str]]:
        """What the send asks, as (field, text): its content, or its tool results."""
        if not self.request.tool_results:
            return [("content", self.request.content)]
        return [(f"tool_results[{i}].content", r.content) for i, r in enumerate(self.request.tool_results)]

    def _own_ids(self, claim: Claim) -> list[str]:
        """The ids of the messages this send stores: its tool results' (derived from the claimed id, so
        a retry stores the same rows), ending with the claimed one (the message the run answers)."""
        last, count = uuid.UUID(claim.user_message_id), max(len(self.request.tool_results), 1)
        return [str(id_before(last, count - 1 - i)) for i in range(count)]

    def _asked(self, claim: Claim, history: History) -> tuple[Message, list[Message]]:
        """The message the run answers, and the tool results stored before it (each the parent of the
        next): the send's user message, or one tool message per result, each naming a call of the
        message the send follows; INVALID_ARGUMENT for a result that names none, or a call left
        without its result."""
        request, tokenizer = self.request, self.model.tokenizer
        ids, parent_id = self._own_ids(claim), history.leaf_id
        chat_id, fingerprint = request.chat_id, tokenizer.fingerprint
        if not request.tool_results:
            content = request.content
            count = len(tokenizer.encode(content))
            user = Message(
                ids[-1],
                chat_id,
                role=Role.USER,
                content=content,
                parent_id=parent_id,
                token_count=count,
                run_id=claim.run_id,
                tokenizer_fingerprint=fingerprint,
            )
            return user, []
        calls = {call.id: call for call in pending_calls(history)}
        answered: set[str] = set()
        messages = []
        for i, (result, message_id) in enumerate(zip(request.tool_results, ids, strict=True)):
            field = f"tool_results[{i}].tool_call_id"
            call = calls.get(result.tool_call_id)
            if call is None:
                known = ", ".join(sorted(calls)) or "none"
                raise invalid(
                    field,
                    f"{result.tool_call_id!r} is not a call of the message this send follows (its calls: "
                    f"{known})",
                )
            if call.id in answered:
                raise invalid(field, f"call {call.id!r} has two results")
            answered.add(call.id)
            count = len(tokenizer.encode(result_text(result.content)))
            messages.append(
                Message(
                    message_id,
                    chat_id,
                    role=Role.TOOL,
                    content=result.content,
                    parent_id=parent_id,
                    token_count=count,
                    tool_call_id=call.id,
                    tool_name=call.name,
                    run_id=claim.run_id if message_id == ids[-1] else None,
                    tokenizer_fingerprint=fingerprint,
                )
            )
            parent_id = message_id
        if missing := [call_id for call_id in calls if call_id not in answered]:
            raise invalid("tool_results", f"call {missing[0]!r} has no result: give one for each call")
        return messages[-1], messages[:-1]

    async def _asked_without_its_run(self, history: History) -> bool:
        """Whether the branch ends at this keyless send's question, stored by an earlier attempt of it
        without its run. A send without a key has no claim to name its question by: its retry knows it
        by its place (the newest message, where the send continues), its content and a run that never
        came to be, and answers it rather than asking it twice. (Any other retry of a keyless send is
        a new message: nothing tells it from one sent again on purpose.)"""
        if self.request.idempotency_key or not history.messages:
            return False
        last = history.messages[-1]
        if last.role is not Role.USER or last.content != self.request.content or not last.run_id:
            return False
        try:
            await self.ctx.store.get_run(self.identity.user_id, last.run_id)
        except NotFound:
            return True
        return False

    async def _history(self) -> History:
        """The branch the new message follows: the one ending at the message named, at the chat's
        newest, or none (a new root)."""
        request, user = self.request, self.identity.user_id
        if request.branch_from_root:
            return History([], None, None, await self.ctx.store.get_chat(user, request.chat_id))
        try:
            return await self.model.prompter.history(user, request.chat_id, request.parent_message_id or None)
        except NotFound:
            if not request.parent_message_id:
                raise
            await self.ctx.store.get_chat(user, request.chat_id)  # a missing chat is the chat's NOT_FOUND
            raise not_found("message", request.parent_message_id) from None


def pending_calls(history: History) -> tuple[ToolCall, ...]:
    """The calls of the message a send of tool results follows: the branch's last, an answer."""
    last = history.messages[-1] if history.messages else None
    if last is None or last.message_id != history.leaf_id:
        return ()
    return last.tool_calls


def _check_tool_results(request: chat_pb2.SendMessageRequest, config: limits.Limits) -> None:
    """A send of tool results: no content beside them, each within the content's limits."""
    if request.content:
        raise invalid("content", "give content or tool_results, not both")
    if request.branch_from_root:
        raise invalid("tool_results", "tool results follow the message whose calls they answer")
    for i, result in enumerate(request.tool_results):
        checked(limits.check_id, result.tool_call_id, f"tool_results[{i}].tool_call_id")
        checked(limits.check_content, result.content, config, f"tool_results[{i}].content", True)
