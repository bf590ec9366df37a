"""The model's log-probability of a sampled token, and of the likeliest tokens at its position.

Taken from the raw logits (log-softmax before temperature, penalties or bias), as OpenAI reports them:
what the model thought, not what the sampler's settings made of it. A function of the logits alone, so
the same position gives the same numbers alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.sampler import best_ids


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # The likeliest tokens at the position, likeliest first (ties: lower id first): (token id, logprob).
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token_id: int, top: int) -> TokenLogprob:
    """``token_id``'s log-probability under ``logits`` [vocab], with the ``top`` likeliest tokens'."""
    row = logits.astype(np.float64)
    peak = row.max()
    log_total = peak + np.log(np.exp(row - peak).sum())
    best = best_ids(row, top).tolist() if top else []
    return TokenLogprob(
        token_id, float(row[token_id] - log_total), tuple((t, float(row[t] - log_total)) for t in best)
    )
