"""Picks each next token from the logits: greedy, or temperature with top-k, top-p and min-p, after the
request's logit bias and presence / frequency penalties.

Reproducible by construction: the one random number a draw uses for output position ``i`` is a hash
of ``(seed, i)``, nothing else, and the logits are adjusted from the request's own output so far (resumed
output included), nothing else. The same seed gives the same output on any engine, at any batch
position, and a request re-dispatched after a failover continues exactly where it left off.
The draw is an inverse-CDF pick over the candidates sorted by logit (ties: lower token id first).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from engine.request import SamplingParams

# top-p without top-k looks for the nucleus among this many best tokens first, widening as needed.
_NUCLEUS_PROBE = 64
# best_ids picks its candidates' threshold from every s-th value of the row, s at most this.
_MAX_STRIDE = 16


def uniform(seed: int, position: int) -> float:
    """The random number in [0, 1) for output position ``position`` of a request seeded ``seed``."""
    digest = hashlib.blake2b(
        position.to_bytes(8, "little"), digest_size=8, key=seed.to_bytes(8, "little")
    ).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def sample(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    outputs: Sequence[Sequence[int]] | None = None,
    argmax: np.ndarray | None = None,
) -> list[int]:
    """One token per row of ``logits`` [n, vocab]; ``positions[r]`` is row r's output position.

    ``outputs[r]``: row r's output tokens so far (resumed ones included), read only for a row whose
    params penalize. ``argmax``: each row's argmax (ties: lowest id), when the runner that made the logits
    already has it; greedy rows then cost no scan of the vocabulary.
    """
    if not any(p.temperature == 0.0 for p in params):
        tokens = [0] * len(params)
    else:
        # One vectorized argmax over every row beats copying out the greedy rows first.
        tokens = (np.argmax(logits, axis=1) if argmax is None else argmax).tolist()
    for r, p in enumerate(params):
        if p.adjusts_logits:
            row = adjusted(logits[r], p, outputs[r] if outputs is not None else ())
            greedy = p.temperature == 0.0
            tokens[r] = int(np.argmax(row)) if greedy else sample_one(row, p, uniform(p.seed, positions[r]))
        elif p.temperature != 0.0:
            tokens[r] = sample_one(logits[r], p, uniform(p.seed, positions[r]))
    return tokens


def adjusted(logits: np.ndarray, params: SamplingParams, output: Sequence[int]) -> np.ndarray:
    """``logits`` plus the request's bias, less its penalties on the tokens of ``output``, as OpenAI
    defines them: ``l[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty``."""
    row = logits.astype(np.float64)  # a copy: the runner's logits stay as they are
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias, strict=True)
        row[list(ids)] += bias
    if params.penalizes and len(output):
        seen, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
        row[seen] -= params.presence_penalty + params.frequency_penalty * counts
    return row


def sample_one(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """A draw from softmax(logits / temperature) restricted by top-k then top-p, using ``u`` in [0, 1)."""
    scaled = logits.astype(np.float64) / params.temperature
    if params.min_p > 0.0:
        # p >= min_p * p_max, in logits: scaled >= max + log(min_p). The likeliest token always stays.
        scaled[scaled < scaled.max() + math.log(params.min_p)] = -np.inf
    vocab = scaled.shape[0]
    top_p = params.top_p if 0.0 < params.top_p < 1.0 else 1.0
    if 0 < params.top_k < vocab:
        candidates = best_ids(scaled, params.top_k)
        probs = np.exp(scaled[candidates] - scaled[candidates[0]])
        total = probs.sum()
    else:
        all_probs = np.exp(scaled - scaled.max())
        total = all_probs.sum()
        if top_p == 1.0:  # plain temperature: every token, in id order, no sorting needed
            cdf = np.cumsum(all_probs)
            return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), vocab - 1)
        candidates = _nucleus_superset(scaled, all_probs, top_p * total)
        probs = all_probs[candidates]
    cdf = np.cumsum(probs)
    if top_p < 1.0:
        # The smallest head of the sorted candidates whose mass reaches top_p.
        keep = int(np.searchsorted(cdf, top_p * total, side="left")) + 1
        candidates, cdf = candidates[:keep], cdf[:keep]
    pick = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(candidates) - 1)
    return int(candidates[pick])


def best_ids(scaled: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k highest values, sorted by value descending, then id ascending."""
    n = scaled.shape[0]
    stride = min(_MAX_STRIDE, n // (2 * k)) if k > 0 else 0
    if stride > 1:
        # Every value at or above the k-th largest, found among fewer: a threshold that at least k values
        # reach, from every stride-th value (the j-th largest of a subset is reached by j values or more
        # of the whole), then the exact selection on what passes it. The same ids as over the whole row.
        subset = scaled[::stride]
        for j in (min(k // stride + 16, k), k):
            threshold = np.partition(subset, len(subset) - j)[len(subset) - j]
            passed = np.flatnonzero(scaled >= threshold)
            if len(passed) >= k:
                return passed[_best_of(scaled[passed], k)]
    return _best_of(scaled, k)


def _best_of(values: np.ndarray, k: int) -> np.ndarray:
    """best_ids over the whole of ``values``: one partition, then the ties at the k-th value resolved."""
    part = np.argpartition(-values, k - 1)[:k]
    # Ties at the k-th value would leave the choice to the partition; take all, keep the lowest ids (a
    # stable sort of ascending ids by value descending).
    tied_or_better = np.flatnonzero(values >= values[part].min())
    return tied_or_better[np.argsort(-values[tied_or_better], kind="stable")][:k]


def _nucleus_superset(scaled: np.ndarray, probs: np.ndarray, mass: float) -> np.ndarray:
    """The best tokens, sorted, holding at least ``mass`` of ``probs`` (probe few, widen as needed)."""
    k = _NUCLEUS_PROBE
    while k < scaled.shape[0]:
        best = best_ids(scaled, k)
        if probs[best].sum() >= mass:
            return best
        k *= 8
    return best_ids(scaled, scaled.shape[0])
