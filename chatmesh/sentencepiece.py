"""SentencePiece tokenization from a GGUF's vocabulary and scores, as llama.cpp does it ("llama" model).

A GGUF converted from a SentencePiece model (Gemma, Llama 2, Mistral) carries no merges: its tokens,
their scores and their types are the whole model. Encoding, in llama.cpp's order:
1. the text is split around the tokens matched before anything else, longest first: user-defined ones
   always (Gemma's whitespace runs and HTML tags), control ones only in template markup
   (``parse_special``), so a ``<start_of_turn>`` typed by a user stays text;
2. each remaining piece gets a leading space when ``add_space_prefix`` says so (Llama 2's, Mistral's;
   not Gemma's) and it starts the text or follows a matched token; spaces become U+2581;
3. starting from single characters, the adjacent pair whose concatenation is a token with the highest
   score merges (ties: the leftmost), until no pair forms a token;
4. a symbol that is no token becomes one ``<0xXX>`` token per UTF-8 byte (byte fallback), or unknown.
Decoding turns U+2581 back into spaces and byte tokens back into bytes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

SPACE = "\u2581"  # what SentencePiece writes for a space
TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = 1, 2, 3, 4, 5, 6


class SentencePieceCodec:
    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float],
        token_types: Sequence[int],
        unknown_id: int | None,
        add_space_prefix: bool,
    ) -> None:
        if not len(tokens) == len(scores) == len(token_types):
            raise ValueError(
                f"{len(tokens)} tokens, {len(scores)} scores and {len(token_types)} token types: "
                "a SentencePiece vocabulary needs one of each per token"
            )
        self.vocab_size = len(tokens)
        self._tokens = list(tokens)
        self._scores = list(scores)
        self._types = list(token_types)
        self._unknown_id = unknown_id
        self.add_space_prefix = add_space_prefix
        # Later duplicates lose, as in llama.cpp's token_to_id map (first insertion wins).
        self._ids: dict[str, int] = {}
        for i, token in enumerate(self._tokens):
            self._ids.setdefault(token, i)
        self._bytes = {b: self._ids.get(f"<0x{b:02X}>") for b in range(256)}
        by_length = sorted(range(len(self._tokens)), key=lambda i: (-len(self._tokens[i]), i))
        self._user_defined = [i for i in by_length if self._types[i] == TYPE_USER_DEFINED and self._tokens[i]]
        self._special = [
            i
            for i in by_length
            if self._types[i] in (TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNKNOWN) and self._tokens[i]
        ]

    # -- encode --------------------------------------------------------------------------------------

    def encode(self, text: str, parse_special: bool) -> list[int]:
        """Ids of ``text``; ``parse_special``: control-token strings in it become those tokens."""
        ids: list[int] = []
        after_token = True  # the text's start counts as following a token (for the space prefix)
        for piece in self._partition(text, self._special if parse_special else self._user_defined):
            if isinstance(piece, int):
                ids.append(piece)
                after_token = True
                continue
            if self.add_space_prefix and after_token:
                piece = " " + piece
            self._encode_piece(piece.replace(" ", SPACE), ids)
            after_token = False
        return ids

    def _partition(self, text: str, matched_first: list[int]) -> list[str | int]:
        """``text`` as raw pieces and token ids: each token in turn (longest first) is cut out of every
        raw piece wherever it occurs."""
        pieces: list[str | int] = [text] if text else []
        for token_id in matched_first:
            token = self._tokens[token_id]
            if not any(isinstance(p, str) and token in p for p in pieces):
                continue
            split: list[str | int] = []
            for piece in pieces:
                if isinstance(piece, int) or token not in piece:
                    split.append(piece)
                    continue
                parts = piece.split(token)
                for k, part in enumerate(parts):
                    if k:
                        split.append(token_id)
                    if part:
                        split.append(part)
            pieces = split
        return pieces

    def _encode_piece(self, text: str, out: list[int]) -> None:
        symbols = list(text)  # one symbol per character; "" once merged into its left neighbour
        prev = list(range(-1, len(symbols) - 1))
        nxt = [*range(1, len(symbols)), -1]
        queue: list[tuple[float, int, int, int]] = []  # (-score, left, right, merged length)

        def try_pair(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            merged = symbols[left] + symbols[right]
            token_id = self._ids.get(merged)
            if token_id is not None:
                heapq.heappush(queue, (-self._scores[token_id], left, right, len(merged)))

        for i in range(1, len(symbols)):
            try_pair(i - 1, i)
        while queue:
            _, left, right, length = heapq.heappop(queue)
            # Stale: one side has merged with something else since this pair was queued.
            if not symbols[left] or not symbols[right] or len(symbols[left]) + len(symbols[right]) != length:
                continue
            symbols[left] += symbols[right]
            symbols[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_pair(prev[left], left)
            try_pair(left, nxt[left])
        i = 0 if symbols else -1
        while i >= 0:
            self._emit(symbols[i], out)
            i = nxt[i]

    def _emit(self, symbol: str, out: list[int]) -> None:
        token_id = self._ids.get(symbol)
        if token_id is not None:
            out.append(token_id)
            return
        for byte in symbol.encode("utf-8"):
            byte_id = self._bytes[byte]
            if byte_id is None:
                if self._unknown_id is None:
                    raise ValueError(f"byte 0x{byte:02X} has no token and the vocabulary no unknown token")
                byte_id = self._unknown_id
            out.append(byte_id)

    # -- decode --------------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for (a byte token: its one byte)."""
        kind, token = self._types[token_id], self._tokens[token_id]
        if kind == TYPE_BYTE:
            return bytes([int(token[3:5], 16)])
        if kind in (TYPE_CONTROL, TYPE_USER_DEFINED):
            return token.encode("utf-8")
        return token.replace(SPACE, " ").encode("utf-8")

    def decode(self, ids: Sequence[int], skip_control: bool) -> str:
        """Text of ``ids``; incomplete UTF-8 (a character cut between byte tokens) decodes to U+FFFD.
        With ``add_space_prefix``, llama.cpp's detokenizer drops the first token's leading space; this
        keeps it, so that decoding stays prefix-stable for streamed output (engine.detokenizer)."""
        out = bytearray()
        for token_id in ids:
            kind, token = self._types[token_id], self._tokens[token_id]
            if kind == TYPE_BYTE:
                out.append(int(token[3:5], 16))
            elif kind == TYPE_CONTROL:
                if not skip_control:
                    out += token.encode("utf-8")
            elif kind == TYPE_UNKNOWN:
                out += "\u2585".encode()  # llama.cpp's stand-in for an unknown token
            elif kind == TYPE_USER_DEFINED:
                out += token.encode("utf-8")
            else:
                out += token.replace(SPACE, " ").encode("utf-8")
        return out.decode("utf-8", errors="replace")
