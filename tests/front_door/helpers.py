"""Small helpers the front-door tests share."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

from meshkit.launcher import Launcher
from tests.front_door.sse_client import Event, iter_events

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float = 10.0, what: str = "condition") -> T:
    """The first truthy value of ``predicate()``, polled until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def assert_json_error(reply: httpx.Response, status: int) -> dict:
    """Asserts an error reply in the edge's (OpenAI-shaped) JSON form; returns its ``error`` object."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"]
    return error


def answer(client: httpx.Client, chat_id: str, content: str, **body: object):
    """The SSE response to sending ``content`` (a context manager, like ``client.stream``)."""
    return client.stream("POST", f"/v1/chats/{chat_id}/messages", json={"content": content, **body})


def send(client: httpx.Client, chat_id: str, content: str, **body: object) -> list[Event]:
    """Every SSE event of the answer to ``content``, to its end."""
    with answer(client, chat_id, content, **body) as reply:
        assert reply.status_code == 200, reply.read()
        assert reply.headers["content-type"].startswith("text/event-stream")
        return list(iter_events(reply))


def kill_under_answers(
    launcher: Launcher,
    name: str,
    threads: list[threading.Thread],
    started: list[threading.Event],
    join_s: float,
) -> None:
    """Starts ``threads`` (each streams an answer and sets its ``started`` event at its first text),
    kills ``name`` (SIGKILL) once every answer has started, and waits for every thread to end."""
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(30), "an answer did not start"
    launcher.signal(name, signal.SIGKILL)
    for thread in threads:
        thread.join(join_s)
        assert not thread.is_alive()
