"""Prompt-lookup speculative decoding: drafts taken from a sequence's own tokens, and when to draft.

A chat answer often quotes what the conversation holds (the code being edited, a list, names, the
paragraph being summarized): the tokens that followed the latest earlier occurrence of a sequence's
newest n tokens (n from ``MAX_NGRAM`` down to ``MIN_NGRAM``, anywhere in its prompt and output) are a
free guess of what comes next, with no draft model. The engine verifies a draft of k tokens in one
forward of k + 1 positions of the sequence (a small prefill chunk with logits at every position) and
keeps the prefix the model agrees with, plus the model's own token where it first disagrees
(``engine.llm_engine``), so the output is token for token what decoding without speculation gives.

Verifying is not free: on the CPU kernels each extra position of a one-stream step costs about a tenth
of the step (measured: 1.14x a decode step for 3 positions, 1.45x for 5), and a big batch is
compute-bound, where every extra position costs in full. So drafting is gated twice. Per step: only while
the requests running and waiting are at most ``max_batch``. Per request, on its measured acceptance: the
rolling share of the draft positions it verified that the model accepted (the chance a draft token is
right, given the ones before it were; recent verifications weigh most). A draft is only as long as its
last token still has a chance ``MARGINAL_ACCEPTANCE`` (what verifying one more position costs, with a
margin) of being reached and accepted; a request whose acceptance falls below that drafts nothing but for a
probe every ``PROBE_STEPS`` steps, so acceptance that recovers (the answer starts quoting) is seen again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_NGRAM = 3
# A single token occurs almost anywhere in a long prompt, and what followed it there is rarely next.
MIN_NGRAM = 2
ACCEPTANCE_WEIGHT = 0.25  # the latest verification's weight in a request's rolling acceptance
INITIAL_ACCEPTANCE = 0.5  # drafts of 2 at first
MARGINAL_ACCEPTANCE = 0.15
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
            found = self._last_end.get(tuple(tokens[newest - n + 1 :]))
            if found is not None:
                return list(tokens[found + 1 : found + 1 + k])
        return []


@dataclass
class Drafter:
    """One request's drafting: its n-gram index and its rolling acceptance (the step thread's)."""

    index: NgramIndex = field(default_factory=NgramIndex)
    acceptance: float = INITIAL_ACCEPTANCE
    steps_since_draft: int = 0

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens``, as many as its acceptance pays for; none while
        it is too low (but for a probe of one token every ``PROBE_STEPS`` steps)."""
        length = min(k, self.worth_drafting())
        if length == 0 and k > 0 and self.steps_since_draft + 1 >= PROBE_STEPS:
            length = 1
        if length == 0:
            self.steps_since_draft += 1
            return []
        drafts = self.index.propose(tokens, length)
        self.steps_since_draft = 0 if drafts else self.steps_since_draft + 1
        return drafts

    def worth_drafting(self) -> int:
        """The longest draft whose last token is reached and accepted with a chance of at least
        ``MARGINAL_ACCEPTANCE`` (at most 16)."""
        chance, length = self.acceptance, 0
        while chance >= MARGINAL_ACCEPTANCE and length < 16:
            length += 1
            chance *= self.acceptance
        return length

    def verified(self, proposed: int, accepted: int) -> None:
        """A draft of ``proposed`` tokens was verified; the model accepted its first ``accepted``: the
        positions it tried were those, and the one it rejected, if any."""
        tried = accepted + (accepted < proposed)
        self.acceptance += ACCEPTANCE_WEIGHT * (accepted / tried - self.acceptance)
