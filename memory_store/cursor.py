"""Opaque page cursors: a clustering-key position, signed so that a tampered cursor is refused.

A cursor is never the driver's ``paging_state`` (which could be forged to read other partitions); it
holds the position of the last item returned (e.g. a message id) and an HMAC over that position, the
kind of listing and its scope (the chat or user it belongs to). A cursor from another chat, another
user, another listing, or with a flipped bit fails the check and is INVALID_ARGUMENT.

The key lives in the keyspace (``store_secrets``), so every replica accepts every replica's cursors.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

from memory_store.errors import InvalidArgument

_VERSION = 1
_MAC_BYTES = 16
_MAX_CURSOR_CHARS = 512


class CursorCodec:
    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("cursor key must be at least 16 bytes")
        self._key = key

    def _mac(self, kind: str, scope: str, payload: bytes) -> bytes:
        message = f"{_VERSION}\x00{kind}\x00{scope}\x00".encode() + payload
        return hmac.new(self._key, message, hashlib.sha256).digest()[:_MAC_BYTES]

    def encode(self, kind: str, scope: str, position: list[str | int]) -> str:
        payload = json.dumps(position, separators=(",", ":")).encode()
        token = bytes([_VERSION]) + payload + self._mac(kind, scope, payload)
        return base64.urlsafe_b64encode(token).rstrip(b"=").decode()

    def decode(self, cursor: str, kind: str, scope: str) -> list[str | int]:
        """The position in ``cursor``; INVALID_ARGUMENT unless this codec made it for kind and scope."""
        invalid = InvalidArgument("page token is invalid; start again from the first page")
        if not cursor or len(cursor) > _MAX_CURSOR_CHARS:
            raise invalid
        try:
            token = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        except ValueError:
            raise invalid from None
        # Base64 leaves spare bits in the last character: only the canonical spelling is accepted.
        canonical = base64.urlsafe_b64encode(token).rstrip(b"=").decode()
        if canonical != cursor or len(token) <= 1 + _MAC_BYTES or token[0] != _VERSION:
            raise invalid
        payload, mac = token[1:-_MAC_BYTES], token[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(kind, scope, payload)):
            raise invalid
        position = json.loads(payload)
        if not isinstance(position, list):
            raise invalid
        return position
