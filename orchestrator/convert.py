"""memory_store dataclasses to ChatService messages, and the enums between them and the router's."""

from __future__ import annotations

from datetime import datetime

from google.protobuf.timestamp_pb2 import Timestamp

from chatmesh.chat.v1 import chat_pb2
from chatmesh.engine.v1 import engine_pb2
from chatmesh.finish import FinishReason, Usage
from memory_store import models

FINISH_REASONS = {
    FinishReason.STOP: chat_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: chat_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: chat_pb2.FINISH_REASON_CANCELLED,
    FinishReason.CONTENT_FILTER: chat_pb2.FINISH_REASON_CONTENT_FILTER,
    FinishReason.ERROR: chat_pb2.FINISH_REASON_ERROR,
}
RUN_STATUSES = {
    models.RunStatus.IN_PROGRESS: chat_pb2.RUN_STATUS_IN_PROGRESS,
    models.RunStatus.COMPLETED: chat_pb2.RUN_STATUS_COMPLETED,
    models.RunStatus.CANCELLED: chat_pb2.RUN_STATUS_CANCELLED,
    models.RunStatus.FAILED: chat_pb2.RUN_STATUS_FAILED,
    models.RunStatus.INTERRUPTED: chat_pb2.RUN_STATUS_INTERRUPTED,
}
ROLES = {
    models.Role.USER: chat_pb2.ROLE_USER,
    models.Role.ASSISTANT: chat_pb2.ROLE_ASSISTANT,
    models.Role.TOOL: chat_pb2.ROLE_TOOL,
}
# Why the engine stopped -> why the answer ended.
ENGINE_FINISH = {
    engine_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    engine_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    engine_pb2.FINISH_REASON_CANCELLED: FinishReason.CANCELLED,
}


def finish_reason(reason: FinishReason | None) -> chat_pb2.FinishReason:
    return FINISH_REASONS[reason] if reason else chat_pb2.FINISH_REASON_UNSPECIFIED


def timestamp(at: datetime | float | None) -> Timestamp | None:
    if at is None:
        return None
    ts = Timestamp()
    if isinstance(at, datetime):
        ts.FromDatetime(at)
    else:
        ts.FromNanoseconds(int(at * 1e9))
    return ts


def chat(c: models.Chat) -> chat_pb2.Chat:
    return chat_pb2.Chat(
        chat_id=c.chat_id,
        title=c.title,
        create_time=timestamp(c.created_at),
        update_time=timestamp(c.updated_at),
        active_run_id=c.active_run_id or "",
        model=c.model,
        metadata=c.metadata,
    )


def search_hit(h: models.SearchHit) -> chat_pb2.SearchHit:
    return chat_pb2.SearchHit(
        chat_id=h.chat_id,
        chat_title=h.chat_title,
        message_id=h.message_id or "",
        role=ROLES.get(models.Role(h.role), chat_pb2.ROLE_UNSPECIFIED) if h.message_id else None,
        snippet=h.snippet,
        create_time=timestamp(h.created_at),
    )


def usage(u: Usage | None) -> chat_pb2.Usage | None:
    if u is None:
        return None
    return chat_pb2.Usage(
        prompt_tokens=u.prompt_tokens,
        cached_prompt_tokens=u.cached_prompt_tokens,
        completion_tokens=u.completion_tokens,
    )


def message(m: models.Message) -> chat_pb2.Message:
    return chat_pb2.Message(
        message_id=m.message_id,
        chat_id=m.chat_id,
        parent_id=m.parent_id or "",
        role=ROLES[m.role],
        content=m.content,
        token_count=m.token_count,
        model=m.model or "",
        finish_reason=finish_reason(m.finish_reason),
        create_time=timestamp(m.created_at),
        run_id=m.run_id or "",
        usage=usage(m.usage),
        tool_calls=[chat_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.tool_calls],
        tool_call_id=m.tool_call_id or "",
        tool_name=m.tool_name or "",
    )


def run(r: models.Run, last_seq: int | None = None) -> chat_pb2.Run:
    return chat_pb2.Run(
        run_id=r.run_id,
        chat_id=r.chat_id,
        status=RUN_STATUSES[r.status],
        last_seq=r.last_seq if last_seq is None else last_seq,
        assistant_message_id=r.assistant_message_id,
        create_time=timestamp(r.created_at),
    )
