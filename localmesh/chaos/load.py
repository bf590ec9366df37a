"""The steady chat load: ``users`` users, each in a chat of its own, sending one message after another
(a new chat every ``turns_per_chat`` messages, so prompts stay short) until told to stop.

It runs on an event loop in a thread of its own: the main thread keeps the supervisor ticking and does
the faults (services must be spawned from a thread that outlives them: ``Launcher.spawn``). Then the
stored chats are read back through the door (``stored``) to compare with what was streamed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import httpx

from localmesh.chaos.clients import Answer, ChatUser
from localmesh.dev_jwt import DevKeys

TIER = "enterprise"  # Envoy's per-user buckets and the orchestrator's limits do not shape the load


@dataclass(frozen=True)
class LoadSettings:
    users: int = 8
    max_tokens: int = 48
    think_s: float = 0.5
    turns_per_chat: int = 8
    answer_deadline_s: float = 90.0


@dataclass
class LoadRecord:
    answers: list[Answer] = field(default_factory=list)
    # Failures outside an answer (a chat that could not be created), with when they happened.
    failures: list[tuple[float, str]] = field(default_factory=list)
    chats: dict[str, str] = field(default_factory=dict)  # chat id -> user


def http_client(url: str) -> httpx.AsyncClient:
    # The read timeout outlasts the edge's keep-alive comments (15 s): a silent stream is a dead one.
    return httpx.AsyncClient(
        base_url=url,
        timeout=httpx.Timeout(30.0, connect=5.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


class Load:
    def __init__(self, url: str, keys: DevKeys, settings: LoadSettings) -> None:
        self.url = url
        self.keys = keys
        self.settings = settings
        self.record = LoadRecord()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="chaos-load")

    def user(self, http: httpx.AsyncClient, name: str) -> ChatUser:
        settings = self.settings
        token = self.keys.mint(name, TIER)
        return ChatUser(http, name, token, settings.max_tokens, settings.answer_deadline_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Asks every user to stop after the answer it is reading (``alive`` says when they have)."""
        self._stop.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def _run(self) -> None:
        async with http_client(self.url) as http:
            await asyncio.gather(
                *(self._chat(self.user(http, f"chaos-user-{i}")) for i in range(self.settings.users))
            )

    async def _chat(self, user: ChatUser) -> None:
        chat_id, turn = "", 0
        while not self._stop.is_set():
            try:
                if not chat_id or turn >= self.settings.turns_per_chat:
                    chat_id, turn = await user.create_chat(), 0
                    self.record.chats[chat_id] = user.user
                turn += 1
                self.record.answers.append(await user.answer(chat_id, f"Message {turn} from {user.user}"))
            except Exception as exc:
                self.record.failures.append((time.monotonic(), f"{type(exc).__name__}: {exc}"[:300]))
                chat_id = ""
            await asyncio.sleep(self.settings.think_s)


async def stored(url: str, keys: DevKeys, chats: dict[str, str], settings: LoadSettings) -> list[dict]:
    """Every stored message of ``chats`` (chat id -> user), read through the door as their users."""
    load = Load(url, keys, settings)
    async with http_client(url) as http:
        users = {name: load.user(http, name) for name in set(chats.values())}
        pages = await asyncio.gather(*(users[user].messages(chat_id) for chat_id, user in chats.items()))
    return [message for page in pages for message in page]
