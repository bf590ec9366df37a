"""RegenerateMessage: a new answer to the question an earlier answer answered (a sibling of that answer)."""

from __future__ import annotations

import grpc

from chatmesh import limits
from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError, not_found
from chatmesh.identity import Identity
from memory_store.errors import NotFound
from memory_store.models import Role
from orchestrator.policy.refusals import checked
from orchestrator.runs.chat_run import ChatRun
from orchestrator.runs.context import RunContext


class RegenerateRun(ChatRun):
    kind = "regenerate"

    def __init__(
        self, ctx: RunContext, identity: Identity, request: chat_pb2.RegenerateMessageRequest
    ) -> None:
        checked(limits.check_id, request.chat_id, "chat_id")
        checked(limits.check_id, request.message_id, "message_id")
        self.model, options = ctx.models.resolve(request.options, ctx.config.limits, chat=True)
        checked(limits.check_idempotency_key, request.idempotency_key, ctx.config.limits)
        super().__init__(ctx, identity, request, request.idempotency_key, options)
        self.request = request

    async def execute(self) -> None:
        store, user, chat_id = self.ctx.store, self.identity.user_id, self.request.chat_id
        # 1. Claim the idempotency key: this run's ids (a retry joins the run an earlier attempt started,
        #    or answers anew if that one ended unanswered); meanwhile the answer to redo (the read checks
        #    the chat is the caller's).
        try:
            claimed = await self.claim_while(store.get_message(user, chat_id, self.request.message_id))
        except NotFound:
            raise not_found("message", self.request.message_id) from None
        if claimed is None:
            return
        claim, answer = claimed
        if answer.role is not Role.ASSISTANT or answer.parent_id is None:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"message {self.request.message_id} is not an answer; only assistant messages can be "
                "regenerated (to change a question, send the new text with its parent_message_id)",
            )
        # 2. The prompt: the branch up to the question, after the summary, fitted to the window.
        question_id = answer.parent_id
        history = await self.model.prompter.history(user, chat_id, question_id)
        self.answer_as_the_chat(history.chat, self.request.options)
        prompt = self.model.prompter.continue_branch(
            history, self.options, [], "message_id", system=self.system_turns()
        )
        await self.switch_chat(history.chat, self.request.options)
        info = self.run_info(claim, chat_id)
        # 3. Admission, then the run persisted (the question is stored already).
        async with self.ctx.runs.starts.admit(self.identity, info, prompt, self.options) as admission:
            stored_run = await self.create_run(admission, question_id)
        # 4. Live: `started`, then the answer streamed until it ends; the end is stored once.
        end = await self.ctx.runs.starts.generate(self, admission, stored_run)
        # 5. Upkeep: a long history gets a fresher summary.
        self.refresh_summary(chat_id, prompt, end)
