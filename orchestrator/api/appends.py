"""Messages a caller stores in a chat without an answer being generated: a conversation's items
(the OpenAI Conversations API, edge/conversations_api.py), appended after the chat's newest message.

Each is checked and screened as a send's message is, and counted with the tokenizer of the model the
chat is answered with, so a later send's prompt reads them as any stored turn. They go one after the
other, each the parent of the next; not while a run of the chat is generating, whose answer would
land beside them on another branch.
"""

from __future__ import annotations

import grpc

from chatmesh import limits
from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError, invalid
from chatmesh.identity import Identity
from memory_store.ids import new_id
from memory_store.models import Message, Role
from orchestrator.policy.refusals import checked, refused
from orchestrator.runs.context import RunContext

# The roles a chat stores (a system prompt is the server's, or a send's instructions).
_ROLES = {chat_pb2.ROLE_USER: Role.USER, chat_pb2.ROLE_ASSISTANT: Role.ASSISTANT}


def _checked(ctx: RunContext, identity: Identity, request: chat_pb2.AppendMessagesRequest) -> None:
    most = ctx.config.limits.max_prompt_messages
    if not request.messages or len(request.messages) > most:
        raise refused(invalid("messages", f"append 1..{most} messages"))
    for i, message in enumerate(request.messages):
        if message.role not in _ROLES:
            raise refused(invalid(f"messages[{i}].role", "a chat stores user and assistant messages"))
        field = f"messages[{i}].content"
        checked(limits.check_content, message.content, ctx.config.limits, field)
        ctx.moderator.screen_input(message.content, field, f"user {identity.user_id}")


async def append_messages(
    ctx: RunContext, identity: Identity, request: chat_pb2.AppendMessagesRequest
) -> list[Message]:
    """Stores ``request.messages`` after the chat's newest message, oldest first; returns them."""
    limits.check_id(request.chat_id, "chat_id")
    _checked(ctx, identity, request)
    user = identity.user_id
    chat = await ctx.store.get_chat(user, request.chat_id)
    if chat.active_run_id:
        raise ServiceError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"chat {chat.chat_id} has an answer in progress (run {chat.active_run_id}); wait for it to end",
            field="chat_id",
        )
    model = ctx.models.for_chat(chat.model, field="chat_id")
    newest = await ctx.store.branch_page(user, chat.chat_id, None, None, 1)
    parent = newest.items[0].message_id if newest.items else None
    stored = []
    for item in request.messages:
        role = _ROLES[item.role]
        message = Message(
            message_id=str(new_id()),
            chat_id=chat.chat_id,
            role=role,
            content=item.content,
            parent_id=parent,
            token_count=len(model.tokenizer.encode(item.content)),
            model=model.name if role is Role.ASSISTANT else None,
            tokenizer_fingerprint=model.tokenizer.fingerprint,
        )
        stored.append(await ctx.store.append_message(user, message))
        parent = message.message_id
    return stored
