"""Unsigned integers from query strings and headers (page_size, Last-Event-ID, after_seq), read once.

``str.isdigit`` accepts "²" and other digits ``int`` refuses, and ``int`` refuses more than 4,300 digits;
a value past the proto field's range would fail when the request is built. Each of those is the
caller's mistake: a 400 naming the parameter, never a crash.
"""

from __future__ import annotations

from edge.errors import ApiError


def unsigned(raw: str, param: str, maximum: int, code: str = "invalid_value") -> int:
    """``raw`` as an integer in 0..``maximum`` (ASCII digits only); 400 naming ``param`` otherwise."""
    text = raw.strip()
    # A bound on the digits first: no integer conversion of an arbitrarily long string.
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(maximum)) or int(text) > maximum:
        shown = text if len(text) <= 40 else f"{text[:40]}…"
        raise ApiError(
            400, f"{param} must be an integer from 0 to {maximum}, got {shown!r}", code=code, param=param
        )
    return int(text)
