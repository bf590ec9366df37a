"""Chained KV block hashes: the contract between engines (which publish them) and routers (which index them).

A block is ``block_size`` consecutive token ids of a sequence, starting at a multiple of ``block_size``.
Only full blocks are hashed. Block ``i``'s hash covers its own tokens and block ``i-1``'s hash, so
equal hashes mean equal whole prefixes, not just equal blocks. The hash is keyed BLAKE2b-64 over
little-endian bytes, so it is stable across processes, machines and Python versions (unlike ``hash()``).

Engines and routers import this module; nothing re-implements it. An engine advertises its block size
and seed in ``GetModelInfo``; a router hashes each engine pool's requests with those values.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# b"chatmesh" as a little-endian integer: the default key of the hash.
BLOCK_HASH_SEED = int.from_bytes(b"chatmesh", "little")
DEFAULT_BLOCK_SIZE = 16

_NO_PARENT = b"\xff" * 8 + b"\x00"  # distinct from any real parent encoding (which ends in b"\x01")


def hash_block(parent: int | None, token_ids: Sequence[int], seed: int = BLOCK_HASH_SEED) -> int:
    """Hash of one full block, chained to its parent block's hash (None for a sequence's first block)."""
    return _hash_packed(parent, struct.pack(f"<{len(token_ids)}I", *token_ids), seed)


def _hash_packed(parent: int | None, block: bytes | memoryview, seed: int) -> int:
    h = hashlib.blake2b(digest_size=8, key=seed.to_bytes(8, "little"))
    h.update(_NO_PARENT if parent is None else parent.to_bytes(8, "little") + b"\x01")
    h.update(block)
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = BLOCK_HASH_SEED,
    parent: int | None = None,
) -> list[int]:
    """Chained hashes of every full block of ``token_ids``; a trailing partial block is not hashed.

    ``parent`` continues a chain: pass the hash of the block that precedes ``token_ids[0]``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    whole = len(token_ids) - len(token_ids) % block_size
    # Packed once, then hashed a block's bytes at a time.
    packed = memoryview(struct.pack(f"<{whole}I", *token_ids[:whole]))
    hashes: list[int] = []
    step = block_size * 4
    for start in range(0, whole * 4, step):
        parent = _hash_packed(parent, packed[start : start + step], seed)
        hashes.append(parent)
    return hashes
