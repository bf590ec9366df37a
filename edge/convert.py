"""ChatService messages to and from the JSON the page's API speaks (snake_case fields, lower-case enums)."""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.timestamp_pb2 import Timestamp

from chatmesh.chat.v1 import chat_pb2
from edge.schemas import GenerationOptionsIn

FINISH_REASONS = {
    chat_pb2.FINISH_REASON_UNSPECIFIED: None,
    chat_pb2.FINISH_REASON_STOP: "stop",
    chat_pb2.FINISH_REASON_LENGTH: "length",
    chat_pb2.FINISH_REASON_CANCELLED: "cancelled",
    chat_pb2.FINISH_REASON_CONTENT_FILTER: "content_filter",
    chat_pb2.FINISH_REASON_ERROR: "error",
}
ROLES = {
    chat_pb2.ROLE_USER: "user",
    chat_pb2.ROLE_ASSISTANT: "assistant",
    chat_pb2.ROLE_SYSTEM: "system",
    chat_pb2.ROLE_TOOL: "tool",
}
RUN_STATUSES = {
    chat_pb2.RUN_STATUS_UNSPECIFIED: "unspecified",
    chat_pb2.RUN_STATUS_IN_PROGRESS: "in_progress",
    chat_pb2.RUN_STATUS_COMPLETED: "completed",
    chat_pb2.RUN_STATUS_CANCELLED: "cancelled",
    chat_pb2.RUN_STATUS_FAILED: "failed",
    chat_pb2.RUN_STATUS_INTERRUPTED: "interrupted",
    chat_pb2.RUN_STATUS_CANCELLING: "cancelling",
}


def timestamp(ts: Timestamp) -> str | None:
    return ts.ToJsonString() if ts.seconds or ts.nanos else None


def options_proto(
    options: GenerationOptionsIn | None = None,
    *,
    model: str = "",
    max_tokens: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
) -> chat_pb2.GenerationOptions:
    """GenerationOptions from the page's options object, or from OpenAI-style keyword values."""
    if options is not None:
        model, max_tokens = options.model, options.max_tokens
        temperature, top_p, seed, stop = options.temperature, options.top_p, options.seed, options.stop
    proto = chat_pb2.GenerationOptions(model=model, max_tokens=max_tokens, stop=stop or [])
    if options is not None:
        proto.logprobs, proto.top_logprobs = options.logprobs, options.top_logprobs
    # Unset optional fields mean "server default": only set what the caller chose.
    if temperature is not None:
        proto.temperature = temperature
    if top_p is not None:
        proto.top_p = top_p
    if seed is not None:
        proto.seed = seed
    return proto


def logprobs_json(logprobs: Sequence[chat_pb2.TokenLogprob]) -> list[dict]:
    """OpenAI's ``logprobs.content`` (the page's delta events carry the same): per token its text,
    logprob, bytes and likeliest alternatives."""
    return [{**_token_json(lp), "top_logprobs": [_token_json(top) for top in lp.top]} for lp in logprobs]


def _token_json(logprob: chat_pb2.TokenLogprob) -> dict:
    # A token holding part of a UTF-8 character has no text of its own: its bytes say what it is.
    return {
        "token": logprob.token_bytes.decode("utf-8", errors="backslashreplace"),
        "logprob": logprob.logprob,
        "bytes": list(logprob.token_bytes),
    }


def usage_json(usage: chat_pb2.Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "cached_prompt_tokens": usage.cached_prompt_tokens,
        "completion_tokens": usage.completion_tokens,
    }


def chat_json(chat: chat_pb2.Chat) -> dict:
    return {
        "chat_id": chat.chat_id,
        "title": chat.title,
        "create_time": timestamp(chat.create_time),
        "update_time": timestamp(chat.update_time),
        "active_run_id": chat.active_run_id or None,
        # The model its answers come from when a send names none (null: the server's default).
        "model": chat.model or None,
    }


def message_json(message: chat_pb2.Message) -> dict:
    return {
        "message_id": message.message_id,
        "chat_id": message.chat_id,
        "parent_id": message.parent_id or None,
        "role": ROLES.get(message.role, "unspecified"),
        "content": message.content,
        "token_count": message.token_count,
        "model": message.model or None,
        "finish_reason": FINISH_REASONS.get(message.finish_reason),
        "create_time": timestamp(message.create_time),
        "run_id": message.run_id or None,
        "usage": usage_json(message.usage) if message.HasField("usage") else None,
        # OpenAI's shapes: an answer's calls, and the call a tool message is the result of.
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
        or None,
        "tool_call_id": message.tool_call_id or None,
        "name": message.tool_name or None,
    }


def versions_json(versions: chat_pb2.Versions) -> dict:
    """A message's place among its versions (a branch page's); count 0: not known."""
    return {
        "count": versions.count,
        "number": versions.number,
        "previous_id": versions.previous_id or None,
        "next_id": versions.next_id or None,
    }


def search_hit_json(hit: chat_pb2.SearchHit) -> dict:
    return {
        "chat_id": hit.chat_id,
        "chat_title": hit.chat_title,
        "message_id": hit.message_id or None,
        "role": ROLES.get(hit.role, "title") if hit.message_id else "title",
        "snippet": hit.snippet,
        "create_time": timestamp(hit.create_time),
    }


def run_json(run: chat_pb2.Run) -> dict:
    return {
        "run_id": run.run_id,
        "chat_id": run.chat_id or None,
        "status": RUN_STATUSES.get(run.status, "unspecified"),
        "last_seq": run.last_seq,
        "assistant_message_id": run.assistant_message_id or None,
        "create_time": timestamp(run.create_time),
    }


def event_json(event: chat_pb2.RunEvent) -> tuple[str, dict]:
    """An SSE event name and its data for one run event."""
    kind = event.WhichOneof("kind")
    if kind == "started":
        s = event.started
        return kind, {
            "run_id": s.run_id,
            "chat_id": s.chat_id or None,
            "user_message_id": s.user_message_id or None,
            "assistant_message_id": s.assistant_message_id or None,
            "model": s.model,
            "degraded": s.degraded,
        }
    if kind == "delta":
        delta = event.delta
        data = {"text": delta.text, "token_count": delta.token_count}
        if delta.logprobs:  # a run that asked for them (GenerationOptionsIn.logprobs)
            data["logprobs"] = logprobs_json(delta.logprobs)
        return kind, data
    if kind == "usage":
        return kind, usage_json(event.usage)
    if kind == "done":
        return kind, {
            "finish_reason": FINISH_REASONS.get(event.done.finish_reason),
            "assistant_message_id": event.done.assistant_message_id or None,
        }
    if kind == "error":
        return kind, {
            "code": event.error.code,
            "message": event.error.message,
            "retry_after_ms": event.error.retry_after_ms,
        }
    if kind == "step_started":
        started = event.step_started
        return kind, {"call_id": started.call_id, "tool": started.tool, "arguments": started.arguments}
    if kind == "step_result":
        result = event.step_result
        outcome = chat_pb2.ToolOutcome.Name(result.outcome).removeprefix("TOOL_OUTCOME_").lower()
        return kind, {"call_id": result.call_id, "tool": result.tool, "outcome": outcome, "text": result.text}
    return "unknown", {}
