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
from chatmesh.tokenizer import ChatMessage
from memory_store.errors import NotFound
from memory_store.models import Message, Role, RunStatus
from orchestrator.policy.refusals import checked
from orchestrator.prompting.history import History
from orchestrator.runs.chat_run import ChatRun
from orchestrator.runs.context import RunContext


class SendRun(ChatRun):
    kind = "send"

    def __init__(self, ctx: RunContext, identity: Identity, request: chat_pb2.SendMessageRequest) -> None:
        checked(limits.check_id, request.chat_id, "chat_id")
        checked(limits.check_content, request.content, ctx.config.limits)
        self.model, options = ctx.models.resolve(request.options, ctx.config.limits, chat=True)
        checked(limits.check_idempotency_key, request.idempotency_key, ctx.config.limits)
        if request.branch_from_root and request.parent_message_id:
            raise invalid("parent_message_id", "parent_message_id must be empty with branch_from_root")
        if request.instructions:
            checked(limits.check_content, request.instructions, ctx.config.limits, "instructions")
        super().__init__(ctx, identity, request, request.idempotency_key, options)
        self.request = request
        ctx.moderator.screen_input(request.content, "content", f"user {identity.user_id}")
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
        if history.leaf_id == claim.user_message_id or await self._asked_without_its_run(history):
            # The chat's newest message is this send's own: an earlier attempt stored it and was lost
            # (or refused) before storing its run (a question too large to go in one batch with its run
            # is written first, and so is one whose batch failed). Answer that message, after the one
            # it follows; storing it again below rewrites the same row.
            own = history.messages[-1]
            claim = dataclasses.replace(claim, user_message_id=own.message_id)
            history = dataclasses.replace(history, messages=history.messages[:-1], leaf_id=own.parent_id)
        parent_id = history.leaf_id
        if parent_id is not None and uuid.UUID(parent_id).time >= uuid.UUID(claim.user_message_id).time:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the message this one would follow was written after this send began (another send "
                "to this chat at the same time, or a retry of an old idempotency key); send it again "
                "with a new idempotency key",
            )
        # 2. The prompt: the branch after the summary, then the new message, fitted to the window, in
        #    the template of the model answering (the request's, else the chat's).
        self.answer_as_the_chat(history.chat, self.request.options)
        prompt = self.model.prompter.continue_branch(
            history,
            self.options,
            [ChatMessage("user", self.request.content)],
            "content",
            system=self.system_turns(self.request.instructions),
        )
        await self.switch_chat(history.chat, self.request.options)
        info = self.run_info(claim, chat_id, claim.user_message_id)
        # 3. Admission (a run slot; the budget reserved while the router places the request), then the
        #    user message and the run persisted together, now that the answer will be generated.
        asked = Message(
            message_id=claim.user_message_id,
            chat_id=chat_id,
            role=Role.USER,
            content=self.request.content,
            parent_id=parent_id,
            token_count=len(self.model.tokenizer.encode(self.request.content)),
            run_id=claim.run_id,
            tokenizer_fingerprint=self.model.tokenizer.fingerprint,
        )
        async with self.ctx.runs.starts.admit(self.identity, info, prompt, self.options) as admission:
            stored_run = await self.create_run(admission, claim.user_message_id, (asked, history.chat))
        # 4. Live: `started`, then the answer streamed until it ends; the end is stored once.
        end = await self.ctx.runs.starts.generate(self, admission, stored_run)
        # 5. Upkeep: the first exchange of a chat (or of a new root branch) names it; a long history
        #    gets a fresher summary.
        if parent_id is None and end.status is RunStatus.COMPLETED:
            self.ctx.upkeep.name_chat(user, chat_id, self.request.content, end.live.text())
        self.refresh_summary(chat_id, prompt, end)

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
