"""The edge reaching the orchestrator replicas itself (the Helm chart's way:
``edge/chat_client/client.py:ChatClient`` over ``meshkit/replicas.py``), through the real Envoy and edge to
two real replicas over the shared mesh: a chat's sends stay on one replica while chats spread over both;
a replica that drains (SIGTERM) is passed over for new sends as soon as its health says NOT_SERVING (it
refuses them half a second later), and the answer it was streaming goes on from the other replica. A
stored chat's streams travel on the edge's completion links, each on a link to its chat's replica: one
replica killed (SIGKILL) under them, its answers go on from the other, which adopts their runs. Its
unary calls travel on those links too: a cancel and a read held by a replica that hangs (SIGSTOP) are
answered by the other once it is killed."""

from __future__ import annotations

import re
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx

from chatmesh.identity import CHAT_ID_HEADER
from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher, free_port
from meshkit.replicas import rendezvous
from tests.fixtures.front_door import FrontDoor, start_front_door
from tests.fixtures.orchestrator import Mesh, orchestrator_spec
from tests.front_door.helpers import kill_under_answers, send, wait_for
from tests.front_door.sse_client import Event, iter_events

CHATS = 16  # all of them on one of two replicas by chance: 2 in 2^16
SHORT = {"options": {"max_tokens": 4}}
_SENDS = re.compile(r'^chatmesh_orchestrator_runs_total\{[^}]*kind="send"[^}]*\} (\S+)$', re.M)


# A killed replica's runs are adopted within a few seconds (its heartbeats stop; another reaps).
FAST_REAPING = {"heartbeat_interval_s": 0.5, "orphan_after_s": 2.0, "reap_interval_s": 0.5}


def sends_ended(metrics_url: str) -> float:
    """The stored sends that ended on one replica (every status)."""
    return sum(float(value) for value in _SENDS.findall(httpx.get(metrics_url).text))


def counted(metrics_urls: list[str], before: list[float], sends: int) -> list[float] | None:
    """The sends ended on each replica since ``before``, once they come to ``sends``."""
    gained = [sends_ended(url) - was for url, was in zip(metrics_urls, before, strict=True)]
    return gained if sum(gained) == sends else None


def answered(events: list[Event]) -> bool:
    """An answer streamed whole: each event once, in order (the page's deltas come merged when they waited,
    numbered as the last: numbers only increase), every token once, ended by `done`."""
    seqs = [event.seq for event in events if event.id is not None]
    tokens = sum(event.data["token_count"] for event in events if event.event == "delta")
    usage = next(event.data for event in events if event.event == "usage")
    return seqs == sorted(set(seqs)) and tokens == usage["completion_tokens"] and events[-1].event == "done"


def test_a_chats_sends_stay_on_one_replica_chats_spread_and_a_draining_replica_is_passed_over(
    tmp_path: Path, dev_jwt_keys: DevKeys, mesh: Mesh
):
    with Launcher(tmp_path, echo=lambda line: None) as launcher:
        names, ports, metrics = [], [], []
        for _ in range(2):
            name, port, metrics_port = f"orchestrator-{uuid.uuid4().hex[:6]}", free_port(), free_port()
            cql_port = mesh.cassandra.node.config.cql_port
            launcher.start(
                orchestrator_spec(name, port, metrics_port, mesh.router_address, cql_port, replica_id=name)
            )
            names.append(name)
            ports.append(port)
            metrics.append(f"http://127.0.0.1:{metrics_port}/metrics")
        door = start_front_door(launcher, dev_jwt_keys, ports)
        # Enterprise: its buckets take this many sends without a 429.
        user = f"u-{uuid.uuid4().hex[:8]}"
        with door.client(user, "enterprise") as client:
            chats = [client.post("/v1/chats", json={}).json()["chat_id"] for _ in range(CHATS)]
            home: dict[str, int] = {}
            for chat in chats:
                before = [sends_ended(url) for url in metrics]
                for turn in range(2):
                    assert answered(send(client, chat, f"turn {turn}", **SHORT))
                # A run is counted as it ends, just after its last event went out.
                gained = wait_for(
                    lambda before=before: counted(metrics, before, 2), what="both sends counted"
                )
                assert sorted(gained) == [0, 2], gained  # both turns on one replica
                home[chat] = gained.index(2)
            assert set(home.values()) == {0, 1}, home  # and chats on both

            # Replica 0 drains while it streams an answer: the answer goes on from replica 1 (the run
            # handed over, the edge attaching there after the last event it relayed), and every send
            # to replica 0's chats meanwhile is answered by replica 1.
            draining = [chat for chat in chats if home[chat] == 0]
            long_answer: list[Event] = []
            started = threading.Event()

            def stream_long_answer() -> None:  # 3 s at the engines' 200 tokens a second
                body = {"content": "long", "options": {"max_tokens": 600}}
                with (
                    door.client(user, "enterprise") as own,
                    own.stream("POST", f"/v1/chats/{draining[0]}/messages", json=body) as reply,
                ):
                    assert reply.status_code == 200, reply.read()
                    for event in iter_events(reply):
                        long_answer.append(event)
                        if event.event == "delta":
                            started.set()

            streaming = threading.Thread(target=stream_long_answer, daemon=True)
            streaming.start()
            assert started.wait(30), "the long answer did not start"
            stopping = threading.Thread(target=launcher.stop, args=(names[0],), daemon=True)
            stopping.start()
            asked = 0
            while stopping.is_alive() or asked < 4:
                chat = draining[1 + asked % (len(draining) - 1)]
                assert answered(send(client, chat, f"during the drain {asked}", **SHORT))
                asked += 1
            streaming.join(60)
            assert not streaming.is_alive()
            assert answered(long_answer), [event.event for event in long_answer[-3:]]
            # Stored as streamed, across the handover.
            stored = client.get(f"/v1/chats/{draining[0]}/messages").json()["messages"][0]
            assert stored["content"] == "".join(e.data["text"] for e in long_answer if e.event == "delta")


def stream_answer(
    door: FrontDoor, user: str, chat: str, max_tokens: int, streamed: list[Event], started: threading.Event
) -> None:
    """Streams an answer of ``max_tokens`` in ``chat`` into ``streamed``, setting ``started`` at its first
    text."""
    body = {"content": "long", "options": {"max_tokens": max_tokens}}
    with (
        door.client(user, "enterprise") as client,
        client.stream("POST", f"/v1/chats/{chat}/messages", json=body, timeout=90) as reply,
    ):
        assert reply.status_code == 200, reply.read()
        for event in iter_events(reply):
            streamed.append(event)
            if event.event == "delta":
                started.set()


def two_fast_reaping_replicas(
    launcher: Launcher, dev_jwt_keys: DevKeys, mesh: Mesh
) -> tuple[list[str], FrontDoor, dict[int, list[tuple[str, str]]]]:
    """Two replicas that adopt a dead one's runs within seconds, the door reaching them itself, and
    three chats (user, chat id) the edge puts on each (as it picks: rendezvous hashing on the chat id)."""
    names, ports = [], []
    for _ in range(2):
        name, port = f"orchestrator-{uuid.uuid4().hex[:6]}", free_port()
        cql_port = mesh.cassandra.node.config.cql_port
        launcher.start(
            orchestrator_spec(
                name, port, free_port(), mesh.router_address, cql_port, replica_id=name, **FAST_REAPING
            )
        )
        names.append(name)
        ports.append(port)
    door = start_front_door(launcher, dev_jwt_keys, ports)
    addresses = [f"127.0.0.1:{port}" for port in ports]
    chats: dict[int, list[tuple[str, str]]] = {0: [], 1: []}
    for _ in range(40):
        user = f"u-{uuid.uuid4().hex[:8]}"
        with door.client(user, "enterprise") as client:
            chat = client.post("/v1/chats", json={}).json()["chat_id"]
        home = max((0, 1), key=lambda n: rendezvous(chat, addresses[n]))
        if len(chats[home]) < 3:
            chats[home].append((user, chat))
        if len(chats[0]) == len(chats[1]) == 3:
            break
    return names, door, chats


def test_stored_answers_on_links_to_a_replica_killed_under_them_go_on_from_the_other(
    tmp_path: Path, dev_jwt_keys: DevKeys, mesh: Mesh
):
    with Launcher(tmp_path, echo=lambda line: None) as launcher:
        names, door, chats = two_fast_reaping_replicas(launcher, dev_jwt_keys, mesh)
        streams = [*chats[0], *chats[1]]
        streamed: list[list[Event]] = [[] for _ in streams]
        started = [threading.Event() for _ in streams]
        threads = [
            threading.Thread(  # 5 s at the engines' 200 tokens a second
                target=stream_answer, args=(door, *streams[n], 1000, streamed[n], started[n]), daemon=True
            )
            for n in range(len(streams))
        ]
        kill_under_answers(launcher, names[0], threads, started, join_s=90)
        # Every answer whole (each event once, every token once), and stored as it streamed: those of
        # the dead replica's chats too (adopted by the other, the edge attaching there on a link).
        for (user, chat), events in zip(streams, streamed, strict=True):
            assert answered(events), [event.event for event in events[-3:]]
            with door.client(user, "enterprise") as client:
                stored = client.get(f"/v1/chats/{chat}/messages").json()["messages"][0]
            assert stored["content"] == "".join(e.data["text"] for e in events if e.event == "delta")
        launcher.forget(names[0])


def test_a_cancel_and_a_read_on_a_link_to_a_replica_that_hangs_then_dies_are_answered_by_the_other(
    tmp_path: Path, dev_jwt_keys: DevKeys, mesh: Mesh
):
    # The edge's unary calls travel on its links too: a replica that stops answering (SIGSTOP) holds
    # them; once it is killed (SIGKILL) its links break, and a read or a cancel, which repeat
    # harmlessly, go to the other replica, which ends the dead one's run in Cassandra.
    with Launcher(tmp_path, echo=lambda line: None) as launcher:
        names, door, chats = two_fast_reaping_replicas(launcher, dev_jwt_keys, mesh)
        user, chat = chats[0][0]
        streamed: list[Event] = []
        started = threading.Event()
        streaming = threading.Thread(  # 10 s at the engines' 200 tokens a second
            target=stream_answer, args=(door, user, chat, 2000, streamed, started), daemon=True
        )
        streaming.start()
        assert started.wait(30), "the answer did not start"
        run_id = streamed[0].data["run_id"]
        launcher.signal(names[0], signal.SIGSTOP)
        replies: dict[str, httpx.Response] = {}

        def ask(what: str, method: str, path: str) -> None:
            with door.client(user, "enterprise") as client:
                replies[what] = client.request(method, path, headers={CHAT_ID_HEADER: chat}, timeout=30)

        asking = [
            threading.Thread(target=ask, args=("cancel", "POST", f"/v1/runs/{run_id}/cancel")),
            threading.Thread(target=ask, args=("read", "GET", f"/v1/chats/{chat}")),
        ]
        for thread in asking:
            thread.start()
        time.sleep(1.0)
        assert not replies, "answered by a replica that is stopped"
        launcher.signal(names[0], signal.SIGKILL)
        for thread in asking:
            thread.join(30)
        assert replies["read"].status_code == 200 and replies["read"].json()["chat_id"] == chat
        assert replies["cancel"].status_code == 200, replies["cancel"].text
        assert replies["cancel"].json()["status"] in ("cancelled", "cancelling")
        with door.client(user, "enterprise") as client:
            wait_for(
                lambda: (
                    client.get(f"/v1/runs/{run_id}", headers={CHAT_ID_HEADER: chat}).json()["status"]
                    == "cancelled"
                ),
                timeout_s=30,
                what="the run stored cancelled",
            )
        streaming.join(60)
        assert not streaming.is_alive()
        launcher.forget(names[0])
