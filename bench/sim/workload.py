"""The simulated users: multi-turn chats with shared system prompts, think time, free and paid tiers.

A chat's prompt is its system prompt, then every earlier turn (the user's message and the answer), then
the new message: prefix-stable, as the orchestrator assembles it, so each turn's block hashes extend the
last turn's. When the next turn would not fit the context window, the orchestrator's rolling summary
replaces the history (system prompt + summary): a new prefix, which no engine holds yet.

Prompts arrive open-loop at the load's rate: each arrival is the next turn of the chat that has been
ready longest (done thinking); when none is ready, a chat joins. A run lasts seconds, far less than a
conversation, so joining chats are drawn mid-conversation (a uniform number of earlier turns, already in
their history). With ``warm_start`` (the default) that history is already cached on one engine drawn at
random, as in a fleet that has been serving for a while (the simulation announces it with the usual KV
events, so the router's index knows it as it would); without it, every chat's first turn in the run is
cold everywhere, and at the seeds' rate that cold prefill alone overloads the fleet until chats come back.

Token ids only need to make each block distinct: a message's first tokens name its chat, epoch and turn
(the chained hash makes every later block distinct too). Block hashes are ``chatmesh.block_hash``'s,
computed once per block as the conversation grows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from chatmesh.block_hash import BLOCK_HASH_SEED, block_hashes
from chatmesh.router.v1 import router_pb2

VOCAB = 49_152


@dataclass(frozen=True)
class Workload:
    peak_prompts_per_s: float = 20_000.0  # the seeds' peak
    load: float = 1.0  # multiple of the peak
    ramp_s: float = 10.0  # linear ramp from 0 to the load
    duration_s: float = 60.0  # arrivals stop after this (then the run drains)
    system_prompts: int = 8  # shared by every chat (each chat uses one)
    system_tokens: int = 1024
    user_tokens: int = 150  # mean user message (uniform in [0.5, 1.5] x mean)
    answer_tokens: int = 350  # mean answer; user + answer ≈ the seeds' 500 tokens a turn
    max_turns: int = 50  # the seeds' longest chat
    think_s: float = 2.0  # mean think time (exponential) before a chat is ready again
    context_window: int = 8192  # SmolLM2's; beyond it the history is summarized
    summary_tokens: int = 512
    paid_fraction: float = 0.2  # chats on the pro tier; the rest are free
    warm_start: bool = True  # a joining chat's history is cached on a random engine
    seed: int = 0

    def rate(self, now: float) -> float:
        """Prompts per second at ``now``."""
        if now >= self.duration_s:
            return 0.0
        return self.peak_prompts_per_s * self.load * min(1.0, now / self.ramp_s if self.ramp_s else 1.0)


class Chat:
    """One conversation: its context so far as token count, full-block hashes and the partial tail."""

    __slots__ = (
        "epoch",
        "hashes",
        "serial",
        "system",
        "tail",
        "tier",
        "tokens",
        "turn",
        "turns_left",
    )

    def __init__(self, serial: int, tier: int, system: int, turns_left: int) -> None:
        self.serial = serial
        self.tier = tier
        self.system = system
        self.turns_left = turns_left
        self.turn = 0
        self.epoch = 0  # bumped by each summary: a new prefix
        self.hashes: list[int] = []
        self.tail: list[int] = []
        self.tokens = 0

    @property
    def key(self) -> tuple[int, int]:
        """Names this chat's current prefix chain (engines cache chains)."""
        return (self.serial, self.epoch)

    def message(self, kind: int, length: int) -> list[int]:
        return [self.serial % VOCAB, self.serial // VOCAB, self.epoch, self.turn, kind] + [kind] * (
            length - 5
        )


class Conversations:
    """Makes chats and their turns; owns the shared system prompts' hashes."""

    def __init__(self, workload: Workload, block_size: int, rng: random.Random) -> None:
        if workload.system_tokens % block_size:
            raise ValueError("the system prompt must be whole blocks (it is shared block for block)")
        self.workload = workload
        self.block_size = block_size
        self.rng = rng
        self.system_hashes = [
            block_hashes([7 + s] * workload.system_tokens, block_size) for s in range(workload.system_prompts)
        ]
        self.system_blocks = workload.system_tokens // block_size
        self.started = 0

    def new_chat(self) -> Chat:
        w = self.workload
        tier = router_pb2.TIER_PRO if self.rng.random() < w.paid_fraction else router_pb2.TIER_FREE
        turns = self.rng.randint(1, w.max_turns)
        chat = Chat(self.started, tier, self.rng.randrange(w.system_prompts), turns)
        self.started += 1
        self._reset(chat)
        for _ in range(self.rng.randrange(turns)):  # its earlier turns: history
            self.add_user_message(chat)
            self.add_answer(chat, self.answer_length())
        return chat

    def _reset(self, chat: Chat) -> None:
        """The context becomes the system prompt (plus a summary after the first epoch)."""
        chat.hashes = list(self.system_hashes[chat.system])
        chat.tail = []
        chat.tokens = self.workload.system_tokens
        if chat.epoch:
            self._extend(chat, chat.message(3, self.workload.summary_tokens))

    def answer_length(self) -> int:
        return self._length(self.workload.answer_tokens)

    def add_user_message(self, chat: Chat) -> None:
        """The next turn's message; rolls a summary first when the turn would overflow the window."""
        length = self._length(self.workload.user_tokens)
        if chat.tokens + length + 2 * self.workload.answer_tokens > self.workload.context_window:
            chat.epoch += 1
            self._reset(chat)
        chat.turn += 1
        self._extend(chat, chat.message(1, length))

    def add_answer(self, chat: Chat, length: int) -> None:
        self._extend(chat, chat.message(2, length))

    def _length(self, mean: int) -> int:
        return max(8, round(mean * self.rng.uniform(0.5, 1.5)))

    def _extend(self, chat: Chat, tokens: list[int]) -> None:
        pending = chat.tail + tokens
        whole = len(pending) - len(pending) % self.block_size
        chat.hashes += block_hashes(pending[:whole], self.block_size, BLOCK_HASH_SEED, chat.hashes[-1])
        chat.tail = pending[whole:]
        chat.tokens += len(tokens)
