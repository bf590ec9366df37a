"""Placeholder until the engine's per-token text boundaries land (replaced at merge)."""

from __future__ import annotations

from chatmesh.engine.v1 import engine_pb2


def token_pieces(frame: engine_pb2.GenerateTokens) -> list[tuple[int, str]]:
    ids = list(frame.token_ids)
    if not ids:
        return []
    return [(token, "") for token in ids[:-1]] + [(ids[-1], frame.text)]
