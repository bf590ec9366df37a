"""The steady chat load: ``users`` users, each in a chat of its own, sending one message after another
(a new chat every ``turns_per_chat`` messages, so prompts stay short) until told to stop. A
``tool_share`` of the messages are questions whose answers call the orchestrator's calculator
(tool_load.py), each in a new chat.

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

from localmesh.chaos.clients import Answer, ChatUser, StepEvent
from localmesh.chaos.tool_load import aligned_question
from localmesh.dev_jwt import DevKeys

TIER = "enterprise"  # Envoy's per-user buckets and the orchestrator's limits do not shape the load


@dataclass(frozen=True)
class LoadSettings:
    users: int = 8
    max_tokens: int = 48
    think_s: float = 0.5
    turns_per_chat: int = 8
    answer_deadline_s: float = 90.0
    # The share of messages whose answers take tool steps (the mesh's tools on: Topology.tools), and
    # their max_tokens (each step's call is 31 of them).
    tool_share: float = 0.25
    tool_max_tokens: int = 96


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


def tool_count(sent: int, share: float) -> int:
    """How many of a user's first ``sent`` messages are tool questions: ``share`` of them, the first
    one of them (if the share is not 0) being the first message."""
    return int(sent * share + 1 - share) if share else 0


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
        chat_id, turn, sent = "", 0, 0
        settings = self.settings
        while not self._stop.is_set():
            try:
                sent += 1
                # Spread evenly, the first one included: the n-th message is a tool question when the
                # share's count (from 1 - share) goes up.
                if tool_count(sent, settings.tool_share) > tool_count(sent - 1, settings.tool_share):
                    self.record.answers.append(await self._tool_question(user, sent))
                    continue
                if not chat_id or turn >= settings.turns_per_chat:
                    chat_id, turn = await user.create_chat(), 0
                    self.record.chats[chat_id] = user.user
                turn += 1
                self.record.answers.append(await user.answer(chat_id, f"Message {turn} from {user.user}"))
            except Exception as exc:
                self.record.failures.append((time.monotonic(), f"{type(exc).__name__}: {exc}"[:300]))
                chat_id = ""
            finally:
                await asyncio.sleep(settings.think_s)

    async def _tool_question(self, user: ChatUser, sent: int) -> Answer:
        chat_id = await user.create_chat()
        self.record.chats[chat_id] = user.user
        # Tokenizing takes milliseconds: off the loop the other users' streams are read on.
        question = await asyncio.to_thread(
            aligned_question, f"Message {sent} from {user.user}: what is 6 * 7?", TIER
        )
        return await user.answer(chat_id, question, tools=True, max_tokens=self.settings.tool_max_tokens)


async def stored(url: str, keys: DevKeys, chats: dict[str, str], settings: LoadSettings) -> list[dict]:
    """Every stored message of ``chats`` (chat id -> user), read through the door as their users."""
    load = Load(url, keys, settings)
    async with http_client(url) as http:
        users = {name: load.user(http, name) for name in set(chats.values())}
        pages = await asyncio.gather(*(users[user].messages(chat_id) for chat_id, user in chats.items()))
    return [message for page in pages for message in page]


async def stored_steps(
    url: str, keys: DevKeys, answers: list[Answer], settings: LoadSettings
) -> dict[str, list[StepEvent]]:
    """The tool step events each run of ``answers`` that is of the tool share or took a step stored
    (run id -> events), replayed through the door as their users."""
    load = Load(url, keys, settings)
    runs = {a.run_id: a for a in answers if a.run_id and (a.tools or a.steps)}
    async with http_client(url) as http:
        users = {a.user: load.user(http, a.user) for a in runs.values()}
        found = await asyncio.gather(*(users[a.user].run_steps(run, a.chat_id) for run, a in runs.items()))
    return dict(zip(runs, found, strict=True))
