"""Prompt-lookup speculative decoding: drafts taken from a sequence's own tokens, and when to draft.

A chat answer often quotes what the conversation holds (the code being edited, a list, names, the
paragraph being summarized): the tokens that followed the latest earlier occurrence of a sequence's
newest n tokens (n from ``MAX_NGRAM`` down to ``MIN_NGRAM``, anywhere in its prompt and output) are a
free guess of what comes next, with no draft model. The engine verifies a draft of k tokens in one
forward of k + 1 positions of the sequence (a small prefill chunk with logits at every position) and
keeps the prefix the model agrees with, plus the model's own token where it first disagrees
(``engine.llm_engine``), so the output is token for token what decoding without speculation gives.

Verifying costs little on a bandwidth-bound step (one stream: the weights are read once for k + 1
positions as for one) and a lot on a compute-bound one (a big batch), and a draft nobody accepts is
pure cost. So drafting is gated twice: per step, only while the running requests are at most
``max_batch``; per request, only while its rolling acceptance (the share of its drafted tokens the
model accepted, recent verifications weighing most) stays at ``MIN_ACCEPTANCE`` or more. A request
below it drafts again once every ``PROBE_STEPS`` steps, so acceptance that recovers (the answer starts
quoting) is seen again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_NGRAM = 3
# A single token occurs almost anywhere in a long prompt, and what followed it there is rarely next.
MIN_NGRAM = 2
ACCEPTANCE_WEIGHT = 0.25  # the latest verification's weight in a request's rolling acceptance
INITIAL_ACCEPTANCE = 0.5  # two drafts rejected outright from the start, and the request stops drafting
MIN_ACCEPTANCE = 0.3
PROBE_STEPS = 16


class NgramIndex:
    """Where each n-gram of a sequence (``MIN_NGRAM`` <= n <= ``MAX_NGRAM``) last ended, indexed as the
    sequence grows (its tokens are only ever appended). One dict for every n: keys of different lengths
    never collide."""

    def __init__(self) -> None:
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # the grams ending before this position are in the index

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
        ``tokens`` found (none: an empty list)."""
        newest = len(tokens) - 1
        # Grams ending before the newest token: the suffix itself must match an earlier occurrence.
        for end in range(max(self._indexed, MIN_NGRAM - 1), newest):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end + 1) + 1):
                self._last_end[tuple(tokens[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, newest)
        for n in range(min(MAX_NGRAM, newest), MIN_NGRAM - 1, -1):
            end = self._last_end.get(tuple(tokens[newest - n + 1 :]))
            if end is not None:
                return list(tokens[end + 1 : end + 1 + k])
        return []


@dataclass
class Drafter:
    """One request's drafting: its n-gram index and its rolling acceptance (the step thread's)."""

    index: NgramIndex = field(default_factory=NgramIndex)
    acceptance: float = INITIAL_ACCEPTANCE
    steps_since_draft: int = 0

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens``, or none while its acceptance is low (but for a
        probe every ``PROBE_STEPS`` steps)."""
        if k <= 0:
            return []
        if self.acceptance < MIN_ACCEPTANCE and self.steps_since_draft + 1 < PROBE_STEPS:
            self.steps_since_draft += 1
            return []
        drafts = self.index.propose(tokens, k)
        self.steps_since_draft = 0 if drafts else self.steps_since_draft + 1
        return drafts

    def verified(self, proposed: int, accepted: int) -> None:
        """A draft of ``proposed`` tokens was verified; the model accepted its first ``accepted``."""
        self.acceptance += ACCEPTANCE_WEIGHT * (accepted / proposed - self.acceptance)
