"""Envoy's internal listener places the edge's completion links (the ``orchestrator_links`` cluster):
through the real Envoy and edge to two ScriptedChatServers, one of which drains as an orchestrator does
(a new link stream refused UNAVAILABLE before it is read, its open ones ended once empty) while its
health still says SERVING, as it does to Envoy until two checks have seen otherwise (up to ten seconds
at the chart's interval)."""

from __future__ import annotations

import threading
from pathlib import Path

from edge.settings import EdgeSettings
from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher
from tests.fixtures.front_door import FrontDoor, start_front_door
from tests.front_door.scripted_chat_service import ScriptedChatServer, scripted_text

LINKS = EdgeSettings.completion_links  # the edge's default --completion-links
# Half a second each: answers asked together are all running at once, one on each link.
ANSWER = {"model": "", "messages": [{"role": "user", "content": "!tokens 25 20"}], "max_tokens": 25}


def answers_together(door: FrontDoor, count: int) -> list[tuple[int, str]]:
    """``count`` answers asked at once (a user each): their statuses and texts."""
    results: list[tuple[int, str]] = [(0, "")] * count

    def ask(n: int) -> None:
        with door.client(f"balance-user-{n}") as client:
            reply = client.post("/v1/chat/completions", json=ANSWER, timeout=30)
        text = reply.json()["choices"][0]["message"]["content"] if reply.status_code == 200 else reply.text
        results[n] = (reply.status_code, text)

    threads = [threading.Thread(target=ask, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_a_link_stream_a_draining_replica_refuses_goes_to_the_other_however_idle_the_draining_one(
    tmp_path: Path, dev_jwt_keys: DevKeys, two_replicas: tuple[ScriptedChatServer, ScriptedChatServer]
):
    draining, serving = two_replicas
    with Launcher(tmp_path, echo=lambda line: None) as launcher:
        door = start_front_door(launcher, dev_jwt_keys, [draining.port, serving.port], edge_via_envoy=True)
        # Four answers at once open the four links, which Envoy spreads over both replicas.
        assert answers_together(door, LINKS) == [(200, scripted_text(25))] * LINKS
        assert draining.service.calls_to("Complete") and serving.service.calls_to("Complete")

        # The links on the draining replica end; each opens again as an answer needs it, and Envoy
        # places the new stream. The draining replica holds no request now and the other holds every
        # open link, so a policy that always picks the least loaded host (least request over every
        # host) sends the stream there on every try, its retries too: the edge then answered 503.
        draining.drain_links()
        before = len(serving.service.calls_to("Complete")), len(draining.service.calls_to("Complete"))
        assert answers_together(door, LINKS) == [(200, scripted_text(25))] * LINKS
        after = len(serving.service.calls_to("Complete")), len(draining.service.calls_to("Complete"))
        assert (after[0] - before[0], after[1] - before[1]) == (LINKS, 0)
