"""The ``clock`` tool: the current date and time, in UTC or a named IANA timezone."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from chatmesh.tool_format import Function

FUNCTION = Function(
    name="clock",
    description="The current date and time (ISO 8601), in UTC unless an IANA timezone is named.",
    parameters={
        "type": "object",
        "properties": {"timezone": {"type": "string", "description": "e.g. Europe/Paris; default UTC"}},
        "additionalProperties": False,
    },
)


class ClockError(ValueError):
    """The timezone named is not one the replica knows."""


async def clock(arguments: dict[str, Any]) -> str:
    name = arguments.get("timezone") or "UTC"
    if not isinstance(name, str):
        raise ClockError("timezone must be a string")
    try:
        zone = ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ClockError(f"unknown timezone {name[:64]!r}: use an IANA name such as Europe/Paris") from None
    now = datetime.now(UTC).astimezone(zone)
    return f"{now.isoformat(timespec='seconds')} ({now:%A}, {name})"
