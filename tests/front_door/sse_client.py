"""Reading Server-Sent Events from an httpx response, with the time each event arrived."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx


@dataclass
class Event:
    event: str
    data: object
    id: str | None
    at: float

    @property
    def seq(self) -> int:
        assert self.id is not None, f"{self.event} event has no id"
        return int(self.id)


def iter_events(response: httpx.Response) -> Iterator[Event]:
    """Events as they arrive; comment lines (keep-alives) are skipped. ``data`` is parsed JSON when it is."""
    name, data, event_id = "message", [], None
    for line in response.iter_lines():
        if line == "":
            if data:
                text = "\n".join(data)
                try:
                    parsed: object = json.loads(text)
                except json.JSONDecodeError:
                    parsed = text
                yield Event(name, parsed, event_id, time.monotonic())
            name, data, event_id = "message", [], None
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
            elif field == "id":
                event_id = value
