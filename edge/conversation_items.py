"""A conversation's items as the OpenAI Conversations API shows them, over a stored chat's messages.

A conversation is a chat (``conv_`` + the chat id, hex) and an item one of its messages (``msg_`` + the
message id, hex: the id a response's output message has), in the order of the chat's branch that ends
at its newest message. Items are message items with a user or an assistant role; other item types (a
tool call or its output, reasoning, ...) and system or developer messages are refused naming them.
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request

from chatmesh.chat.v1 import chat_pb2
from edge.chat_client.caller import Caller
from edge.chat_client.client import ChatClient
from edge.errors import ApiError
from edge.openai_fields import check_query
from edge.params import unsigned
from edge.response_record import MESSAGE_PREFIX

CONVERSATION_PREFIX = "conv_"
# Items one request may add (OpenAI's bound).
MAX_NEW_ITEMS = 20
# Items a list returns unless it says (OpenAI's default and bound).
DEFAULT_LIMIT = 20
MAX_LIMIT = 100
# A branch is read in pages of this many messages (ChatService's largest page).
_BRANCH_PAGE = 200
_ROLES = {"user": chat_pb2.ROLE_USER, "assistant": chat_pb2.ROLE_ASSISTANT}
_ROLE_NAMES = {chat_pb2.ROLE_USER: "user", chat_pb2.ROLE_ASSISTANT: "assistant"}
# The content part type each role's text takes in an item.
_TEXT_PARTS = {"user": ("input_text", "text"), "assistant": ("output_text", "text", "input_text")}


def conversation_id(chat_id: str) -> str:
    return CONVERSATION_PREFIX + uuid.UUID(chat_id).hex


def item_id(message_id: str) -> str:
    return MESSAGE_PREFIX + uuid.UUID(message_id).hex


def _uuid_of(value: str, prefix: str) -> str | None:
    if not value.startswith(prefix):
        return None
    try:
        return str(uuid.UUID(hex=value.removeprefix(prefix)))
    except ValueError:
        return None


def conversation_not_found(value: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"conversation {value!r} not found", code="not_found", param=param)


def chat_id_of(value: str, param: str | None = None) -> str:
    """The chat id a conversation id names; 404 (naming ``param``) for anything that is not one of ours."""
    chat_id = _uuid_of(value, CONVERSATION_PREFIX)
    if chat_id is None:
        raise conversation_not_found(value, param)
    return chat_id


def message_id_of(value: str) -> str | None:
    """The message id an item id names (None: not one of ours)."""
    return _uuid_of(value, MESSAGE_PREFIX)


def conversation_json(chat: chat_pb2.Chat) -> dict:
    return {
        "id": conversation_id(chat.chat_id),
        "object": "conversation",
        "created_at": chat.create_time.seconds,
        "metadata": dict(chat.metadata),
    }


def item_json(message: chat_pb2.Message) -> dict:
    role = _ROLE_NAMES.get(message.role, "user")
    part: dict[str, Any] = {"type": _TEXT_PARTS[role][0], "text": message.content}
    if role == "assistant":
        part["annotations"] = []
    # An answer cut short (length, cancel, error) is an incomplete item.
    ended = message.finish_reason in (chat_pb2.FINISH_REASON_UNSPECIFIED, chat_pb2.FINISH_REASON_STOP)
    return {
        "type": "message",
        "id": item_id(message.message_id),
        "status": "completed" if ended else "incomplete",
        "role": role,
        "content": [part],
    }


def list_json(items: list[dict], has_more: bool) -> dict:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }


def items_page(items: list[dict], request: Request) -> dict:
    """One page of ``items`` (oldest first) as the query asks: ``order`` (desc by default), items
    ``after`` the one it names, ``limit`` of them (1..100, 20 by default)."""
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be asc or desc", code="invalid_value", param="order")
    limit = unsigned(query.get("limit", str(DEFAULT_LIMIT)), "limit", MAX_LIMIT)
    if limit < 1:
        raise ApiError(400, f"limit must be in 1..{MAX_LIMIT}", code="invalid_value", param="limit")
    ordered = items if order == "asc" else items[::-1]
    if after := query.get("after"):
        at = next((i for i, item in enumerate(ordered) if item["id"] == after), None)
        if at is None:
            raise ApiError(400, f"item {after!r} is not in this list", code="invalid_value", param="after")
        ordered = ordered[at + 1 :]
    return list_json(ordered[:limit], has_more=len(ordered) > limit)


def check_items_query(request: Request, served: tuple[str, ...] = ()) -> None:
    """``include`` names extra data of items chatmesh does not store (image urls, logprobs, tool
    results): refused, naming it; any other unknown query parameter too."""
    for name in ("include", "include[]"):
        if name in request.query_params:
            raise ApiError(
                400,
                "include is not served: conversation items carry their text only",
                "invalid_request_error",
                code="unsupported_value",
                param="include",
            )
    check_query(request.query_params, served)


def _bad_item(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def prompt_messages(items: Any, param: str = "items") -> list[chat_pb2.PromptMessage]:
    """Message items (JSON) as the messages a chat stores; 400 naming the first that is not one."""
    if not isinstance(items, list):
        raise _bad_item(param, f"{param} must be a list of items")
    return [_message(item, f"{param}[{i}]") for i, item in enumerate(items)]


def _message(item: Any, param: str) -> chat_pb2.PromptMessage:
    if not isinstance(item, dict):
        raise _bad_item(param, "an item is an object")
    kind = item.get("type", "message")
    if kind != "message":
        raise _bad_item(
            f"{param}.type",
            f"item type {kind!r} is not served in conversations yet: only message items",
            "unsupported_value",
        )
    unknown = set(item) - {"type", "role", "content", "id", "status"}
    if unknown:
        raise _bad_item(f"{param}.{sorted(unknown)[0]}", f"unknown item field {sorted(unknown)[0]!r}")
    role = item.get("role")
    if role not in _ROLES:
        raise _bad_item(
            f"{param}.role",
            f"role {role!r} is not stored in a conversation: user or assistant (system and developer "
            "text goes in a response's instructions)",
            "unsupported_value",
        )
    return chat_pb2.PromptMessage(role=_ROLES[role], content=_text(item.get("content"), role, param))


def _text(content: Any, role: str, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise _bad_item(f"{param}.content", "content is a string or a list of text parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS[role]:
            kind = part.get("type") if isinstance(part, dict) else None
            raise _bad_item(
                f"{param}.content[{i}].type",
                f"content part {kind!r} is not served: a {role} item holds {', '.join(_TEXT_PARTS[role])} parts",
                "unsupported_value",
            )
        if not isinstance(part.get("text"), str):
            raise _bad_item(f"{param}.content[{i}].text", "a text part holds its text")
        texts.append(part["text"])
    return "".join(texts)


async def branch(orchestrator: ChatClient, caller: Caller, chat_id: str) -> list[chat_pb2.Message]:
    """The conversation's messages, oldest first: the chat's branch that ends at its newest message."""
    messages: list[chat_pb2.Message] = []
    token = ""
    while True:
        request = chat_pb2.GetBranchRequest(chat_id=chat_id, page_size=_BRANCH_PAGE, page_token=token)
        page = await orchestrator.unary("GetBranch", request, caller)
        messages += page.messages
        token = page.next_page_token
        if not token:
            return messages[::-1]


async def append(
    orchestrator: ChatClient, caller: Caller, chat_id: str, messages: list[chat_pb2.PromptMessage]
) -> list[chat_pb2.Message]:
    """Stores ``messages`` after the conversation's newest item; returns them as stored."""
    request = chat_pb2.AppendMessagesRequest(chat_id=chat_id, messages=messages)
    return list((await orchestrator.unary("AppendMessages", request, caller)).messages)
