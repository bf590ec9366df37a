"""The edge drains on SIGTERM: it stops taking connections, lets open answer streams finish within
--drain-grace-s, and closes the rest without stopping their runs (clients resume elsewhere).
Real edge processes against ScriptedChatService (not the orchestrator)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from meshkit.launcher import Launcher
from tests.fixtures.edge import start_edge
from tests.fixtures.identity import session_keys
from tests.front_door.conftest import ScriptedFrontDoor
from tests.front_door.helpers import wait_for
from tests.front_door.sse_client import iter_events


def drain_edge(launcher: Launcher, front_door: ScriptedFrontDoor, grace_s: float):
    return start_edge(
        launcher,
        f"127.0.0.1:{front_door.scripted_port}",
        name="draining-edge",
        extra_flags=("--drain-grace-s", str(grace_s)),
    )


@pytest.mark.parametrize(("tokens", "grace_s", "finishes"), [(20, 6.0, True), (80, 2.0, False)])
def test_sigterm_drains_open_streams(
    front_door: ScriptedFrontDoor, tmp_path, user: str, tokens, grace_s, finishes
):
    # Straight to the edge, as Envoy would call it: with the caller's token.
    headers = {"Authorization": f"Bearer {session_keys().mint(user, 'pro')}"}
    with Launcher(tmp_path, echo=lambda _: None) as launcher:
        edge = drain_edge(launcher, front_door, grace_s)
        with httpx.Client(base_url=edge.url, headers=headers, timeout=20) as client:
            chat_id = client.post("/v1/chats", json={}).json()["chat_id"]
            events = []
            body = {"content": f"drain !tokens {tokens} 50"}
            with client.stream("POST", f"/v1/chats/{chat_id}/messages", json=body) as reply:
                for event in iter_events(reply):
                    events.append(event)
                    if len(events) == 3:
                        signalled = time.monotonic()
                        launcher.signal("draining-edge", signal.SIGTERM)
                        # No new connections once draining.
                        wait_for(lambda: _refused(edge.url), timeout_s=5, what="the listener to close")
            process = launcher.running["draining-edge"].process
            # A clean exit once the streams have ended, not death by the signal.
            assert process.wait(timeout=grace_s + 5) == 0
            launcher.forget("draining-edge")
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    run_id = events[0].data["run_id"]
    if finishes:
        assert events[-1].event == "done" and events[-1].data["finish_reason"] == "stop"
    else:
        # Cut at the end of the grace period, without a final event: the client resumes elsewhere ...
        assert events[-1].event == "delta"
        assert time.monotonic() - signalled < grace_s + 3
        # ... and the run went on regardless.
        run = front_door.scripted.runs[run_id]
        wait_for(lambda: run.finished, timeout_s=10, what="the run to finish after the edge left")
        assert run.events[-1].done.finish_reason == 1  # FINISH_REASON_STOP


def test_a_send_still_waiting_for_its_first_event_when_the_edge_drains_gets_a_503_to_retry(
    front_door: ScriptedFrontDoor, tmp_path, user: str
):
    headers = {"Authorization": f"Bearer {session_keys().mint(user, 'pro')}"}
    with Launcher(tmp_path, echo=lambda _: None) as launcher:
        edge = drain_edge(launcher, front_door, 1.5)
        with httpx.Client(base_url=edge.url, headers=headers, timeout=20) as client:
            chat_id = client.post("/v1/chats", json={}).json()["chat_id"]
            with front_door.scripted.delay("SendMessage", 8.0):
                # The answer's first event is 8 s away; the edge is told to stop after 0.5 s of waiting.
                launcher_signal = threading.Timer(0.5, launcher.signal, ("draining-edge", signal.SIGTERM))
                launcher_signal.start()
                started = time.monotonic()
                reply = client.post(f"/v1/chats/{chat_id}/messages", json={"content": "slow !tokens 2 1"})
                launcher_signal.join()
            assert reply.status_code == 503, reply.text
            assert reply.headers["Retry-After"] == "1"
            assert reply.json()["error"]["code"] == "draining"
            assert time.monotonic() - started < 1.5 + 3  # within the drain grace, not after the answer
        launcher.running["draining-edge"].process.wait(timeout=10)
        launcher.forget("draining-edge")


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/healthz", timeout=1)
    except httpx.TransportError:
        return True
    return False
