"""Complete: an answer to a caller-supplied conversation (the OpenAI-compatible route); nothing is stored
but its token usage.

Unlike a stored run, a Complete whose caller leaves is cancelled, whenever it leaves: an OpenAI client
cannot resume a stream and nothing of it is stored, so generating on would only spend the engine, the
caller's budget and one of their run slots. It is charged what was generated until then.
"""

from __future__ import annotations

from chatmesh import limits
from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import invalid
from chatmesh.identity import Identity
from chatmesh.tokenizer import ChatMessage
from memory_store.ids import new_id
from orchestrator.policy.refusals import checked, refused
from orchestrator.runs.answer_run import AnswerRun
from orchestrator.runs.context import RunContext
from orchestrator.runs.held_run import RunInfo

_PROMPT_ROLES = {
    chat_pb2.ROLE_SYSTEM: "system",
    chat_pb2.ROLE_USER: "user",
    chat_pb2.ROLE_ASSISTANT: "assistant",
}


class CompleteRun(AnswerRun):
    kind = "complete"
    outlives_caller = False

    def __init__(self, ctx: RunContext, identity: Identity, request: chat_pb2.CompleteRequest) -> None:
        super().__init__(identity)
        self.ctx = ctx
        # A prompt is continued as it is (any model); a conversation is rendered with the model's chat
        # template, which a completion model does not have.
        if request.prompt and request.messages:
            raise refused(invalid("prompt", "give a prompt or messages, not both"))
        self.model, self.options = ctx.models.resolve(
            request.options, ctx.config.limits, chat=not request.prompt
        )
        self.system: list[ChatMessage] = []
        self.messages: list[ChatMessage] = []
        self.prompt = request.prompt
        if request.prompt:
            checked(limits.check_content, request.prompt, ctx.config.limits, "prompt")
            ctx.moderator.screen_input(request.prompt, "prompt", f"user {identity.user_id}")
            return
        messages = self._conversation(request)
        while messages and messages[0].role == "system":
            self.system.append(messages.pop(0))
        if not messages:
            raise invalid("messages", "the conversation needs a message after the system messages")
        self.messages = messages

    def _conversation(self, request: chat_pb2.CompleteRequest) -> list[ChatMessage]:
        limits_ = self.ctx.config.limits
        if not request.messages:
            raise refused(invalid("messages", "messages must not be empty"))
        if len(request.messages) > limits_.max_prompt_messages:
            raise refused(invalid("messages", f"at most {limits_.max_prompt_messages} messages"))
        out = []
        for i, message in enumerate(request.messages):
            field = f"messages[{i}].content"
            role = _PROMPT_ROLES.get(message.role)
            if role is None:
                raise refused(invalid(f"messages[{i}].role", "role must be system, user or assistant"))
            # Only the last message must say something; every one is bounded in size.
            last = i == len(request.messages) - 1
            if last or len(message.content.encode()) > limits_.max_message_bytes:
                checked(limits.check_content, message.content, limits_, field)
            # Every role is screened: a caller writes the system and assistant turns here too, and a
            # refused request is otherwise one role name away from passing.
            self.ctx.moderator.screen_input(message.content, field, f"user {self.identity.user_id}")
            out.append(ChatMessage(role, message.content))
        return out

    async def execute(self) -> None:
        # 1. The prompt: the text or the conversation as given, which must fit the window whole.
        prompter = self.model.prompter
        prompt = (
            prompter.completion(self.prompt, self.options)
            if self.prompt
            else prompter.conversation(self.system, self.messages, self.options)
        )
        info = RunInfo(
            run_id=str(new_id()),
            user_id=self.identity.user_id,
            tier=self.identity.tier,
            kind=self.kind,
            model=self.options.model,
            max_tokens=self.options.max_tokens,
        )
        # 2. Admission (a run slot; the budget reserved while the router places the request).
        async with self.ctx.runs.starts.admit(self.identity, info, prompt, self.options) as admission:
            pass  # nothing to persist
        # 3. Live: `started`, then the answer streamed until it ends.
        end = await self.ctx.runs.starts.generate(self, admission, None)
        # 4. The reservation becomes the actual count (no stored finish does it for an unstored run).
        await self.ctx.store.record_usage(self.identity.user_id, admission.charge_id, end.usage)
