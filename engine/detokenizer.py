"""Incremental detokenization: text deltas that never split a UTF-8 character or leak a stop string.

What has been released for an output token list is a pure function of that list, so an engine that
resumes a request after a failover agrees with the first engine on what the client already has:

    T        = decode(ids) without trailing U+FFFD (bytes of a character that is not complete yet),
               cut before the first occurrence of any stop string (generation then stops);
    released = T without its longest suffix that is a proper prefix of a stop string.

Byte-level BPE decoding is prefix-stable at every complete character, so each step decodes only the
tokens after the last such boundary, not the whole output again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_control: bool = True) -> str: ...


class Detokenizer:
    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        self._decode = tokenizer.decode
        self._stop = tuple(stop)
        # Released characters a stop string could still straddle with text to come.
        self._keep = max((len(s) for s in self._stop), default=1) - 1
        self._tail: list[int] = []  # tokens since the last complete-character boundary
        self._tail_seen = 0  # characters of the tail's complete text already taken
        self._held = ""  # complete text held back: it may be the start of a stop string
        self._released_end = ""  # the last `_keep` released characters
        self.matched_stop: str | None = None

    def push(self, token_id: int) -> str:
        """Adds one output token; returns the text it releases."""
        if self.matched_stop is not None:
            raise RuntimeError("a stop string already ended this output")
        self._tail.append(token_id)
        text = self._decode(self._tail)
        complete = text.rstrip(_REPLACEMENT)
        new = complete[self._tail_seen :]
        if len(complete) == len(text):  # ends on a character boundary: later tokens cannot change it
            self._tail, self._tail_seen = [], 0
        else:
            self._tail_seen = len(complete)
        return self._release(new) if new else ""

    def flush(self) -> str:
        """Everything still held back, at the end of generation (an unfinished character decodes as U+FFFD)."""
        if self.matched_stop is not None:
            return ""
        rest = self._held + self._decode(self._tail)[self._tail_seen :]
        self._held, self._tail, self._tail_seen = "", [], 0
        return rest

    def _release(self, new: str) -> str:
        if not self._stop:
            return new
        text = self._released_end + self._held + new
        base = len(self._released_end)
        hits = [(at, s) for s in self._stop if (at := text.find(s)) >= 0]
        if hits:
            at, self.matched_stop = min(hits)
            self._held = ""
            return text[base:at]
        cut = len(text) - self._holdback(text, limit=len(text) - base)
        self._held = text[cut:]
        self._released_end = text[max(0, cut - self._keep) : cut]
        return text[base:cut]

    def _holdback(self, text: str, limit: int) -> int:
        """Length of the longest suffix of ``text`` (at most ``limit``) that starts some stop string."""
        for length in range(min(self._keep, limit), 0, -1):
            suffix = text[-length:]
            if any(s.startswith(suffix) for s in self._stop):
                return length
        return 0
