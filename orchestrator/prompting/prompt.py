"""Prompt assembly: system prompt + rolling summary + newest turns verbatim, fitted to the window.

The prompt is rendered with the model's own chat template and counted with its own tokenizer
(``chatmesh.tokenizer``), so what is counted here is exactly what the engine receives: the prompt's
token ids travel to the router as they are. ``budget`` is the context window minus ``max_tokens``;
the newest turns that fit are found by binary search over the number of turns kept, each probe an
exact count of the whole rendered prompt (token counts of a template are not simply additive).

A history that does not fit is cut in steps, not a turn at a time: the prompt may only start at a
turn where the history's running token count crosses a multiple of ``step_tokens``, so turn after turn
the cut stays where it was and the prompt is the previous one plus the newest exchange — a prefix the
engine (and the router's index) already holds. Dropping the oldest turn every turn would change the
prompt's first turn, and so every cached block after the system prompt, on every turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chatmesh.tokenizer import ChatMessage, ChatTokenizer, EncodedTexts, PromptEncoder

SUMMARY_HEADING = "Summary of the earlier conversation:"


class PromptTooLong(ValueError):
    """Even the system prompt and the newest message alone exceed the budget."""

    def __init__(self, needed: int, budget: int) -> None:
        super().__init__(f"the prompt needs {needed} tokens but only {budget} fit")
        self.needed = needed
        self.budget = budget


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    # What was rendered: the system message (with the summary, if used), then the turns kept.
    messages: list[ChatMessage]
    # Turns available (after the summary, if one applies) and how many of the newest were kept.
    turns_available: int
    turns_kept: int
    summary_used: bool
    # Tokens the prompt would need with every available turn (what the summary trigger looks at).
    full_tokens: int
    budget: int
    # The fingerprint of the tokenizer ``token_ids`` are of: engines of another tokenizer refuse them.
    fingerprint: str

    @property
    def opens_session(self) -> bool:
        """Nothing of the chat comes before the message answered (no earlier turn, no summary): a chat's
        first message, or a new root branch. The router places it knowing its next turns will follow."""
        return self.turns_available == 1 and not self.summary_used

    @property
    def history(self) -> str:
        """How history was fitted: verbatim, summary (+ verbatim), or truncated (oldest turns dropped)."""
        if self.turns_kept < self.turns_available:
            return "truncated"
        return "summary" if self.summary_used else "verbatim"


def system_message(system_prompt: str, summary: str | None) -> ChatMessage:
    if not summary:
        return ChatMessage("system", system_prompt)
    return ChatMessage("system", f"{system_prompt}\n\n{SUMMARY_HEADING}\n{summary}")


def fit_prompt(
    tokenizer: ChatTokenizer,
    system: Sequence[ChatMessage],
    turns: Sequence[ChatMessage],
    budget: int,
    summary: str | None = None,
    step_tokens: int = 0,
    recent: EncodedTexts | None = None,
) -> Prompt:
    """The prompt of ``system`` + the newest ``turns`` that fits ``budget`` tokens (``recent``: texts
    encoded for earlier prompts, which this one adds to).

    ``system`` are the leading system messages (the summary is appended to the first); the last turn
    (the message being answered) is always kept. When not every turn fits, the prompt starts at the
    earliest step boundary (``step_boundaries``) that fits, or — when ``step_tokens`` is 0 or no
    boundary fits — with as many newest turns as fit. Raises PromptTooLong if not even the last fits.
    """
    if not turns:
        raise ValueError("a prompt needs at least one turn")
    # The search below renders many subsets of the turns: each turn's content is encoded once (and not
    # at all if ``recent``, kept across prompts, has it).
    encoder = PromptEncoder(tokenizer, recent)

    def head(with_summary: bool) -> list[ChatMessage]:
        if not with_summary or not summary:
            return list(system)
        first = system[0] if system else ChatMessage("system", "")
        return [system_message(first.content, summary), *system[1:]]

    def render(kept: int, with_summary: bool) -> tuple[list[ChatMessage], list[int]]:
        messages = head(with_summary) + list(turns[len(turns) - kept :])
        return messages, encoder.encode_chat(messages)

    with_summary = bool(summary)
    messages, ids = render(len(turns), with_summary)
    full_tokens = len(ids)
    if full_tokens <= budget:
        return Prompt(
            ids, messages, len(turns), len(turns), with_summary, full_tokens, budget, tokenizer.fingerprint
        )
    smallest_messages, smallest = render(1, with_summary)
    if len(smallest) > budget and with_summary:
        # The summary itself does not fit next to the message: answer without it.
        with_summary = False
        smallest_messages, smallest = render(1, False)
    if len(smallest) > budget:
        raise PromptTooLong(len(smallest), budget)
    if step_tokens > 0:
        # The earliest boundary whose prompt fits (prompts shrink as the boundary moves on).
        cuts = step_boundaries(encoder, turns, step_tokens)
        first, end = 0, len(cuts)
        fitting = None
        while first < end:
            middle = (first + end) // 2
            candidate = render(len(turns) - cuts[middle], with_summary)
            if len(candidate[1]) <= budget:
                fitting, end = (len(turns) - cuts[middle], candidate), middle
            else:
                first = middle + 1
        if fitting:
            kept, (messages, ids) = fitting
            return Prompt(
                ids, messages, len(turns), kept, with_summary, full_tokens, budget, tokenizer.fingerprint
            )
    low, high = 1, len(turns) - 1  # `low` turns fit; all of them do not
    best = (smallest_messages, smallest)
    while low < high:
        middle = (low + high + 1) // 2
        candidate = render(middle, with_summary)
        if len(candidate[1]) <= budget:
            low, best = middle, candidate
        else:
            high = middle - 1
    return Prompt(best[1], best[0], len(turns), low, with_summary, full_tokens, budget, tokenizer.fingerprint)


def step_boundaries(
    tokenizer: ChatTokenizer | PromptEncoder, turns: Sequence[ChatMessage], step_tokens: int
) -> list[int]:
    """Indices of the turns a cut history may start at: each first turn after the running token count
    of ``turns`` (their contents) crosses a multiple of ``step_tokens``. They depend only on the turns
    before them, so a chat that grows keeps its boundaries; the last turn is never one (it is kept)."""
    boundaries: list[int] = []
    total = 0
    for index, turn in enumerate(turns[:-1]):
        before = total
        total += len(tokenizer.encode(turn.content))
        if total // step_tokens > before // step_tokens:
            boundaries.append(index + 1)
    return [cut for cut in boundaries if cut < len(turns) - 1]
