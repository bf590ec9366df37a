"""How long a step takes as a function of the tokens it computes, fitted online from the steps run.

A step's time is close to linear in its tokens: a fixed part (the per-step work: scheduling, the
layers' kernel launches, sampling) and a part per token computed (the matmuls, attention). The router
predicts a new request's time to a first token from this line and the engine's queue
(``router/admission.py``), so the line must follow what the engine does now: a CPU shared with other
work, longer contexts, a bigger batch. Hence a least-squares fit with exponential forgetting (the last
``HALF_LIFE_STEPS`` steps weigh half), which costs a few multiplications a step.
"""

from __future__ import annotations

from dataclasses import dataclass

HALF_LIFE_STEPS = 64
# Below this spread of tokens a step (in tokens², after forgetting), the steps seen do not tell the
# fixed part from the part per token: the line goes through the origin (every second charged per token,
# which overstates small steps and so errs on the side of a longer predicted wait).
MIN_TOKEN_VARIANCE = 4.0


@dataclass
class StepCost:
    """Forgetting sums of the steps seen: weight, tokens, seconds, tokens², tokens x seconds."""

    weight: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0
    tokens_sq: float = 0.0
    tokens_seconds: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """One step that computed ``tokens`` tokens in ``seconds``."""
        keep = 0.5 ** (1 / HALF_LIFE_STEPS)
        self.weight = self.weight * keep + 1
        self.tokens = self.tokens * keep + tokens
        self.seconds = self.seconds * keep + seconds
        self.tokens_sq = self.tokens_sq * keep + tokens * tokens
        self.tokens_seconds = self.tokens_seconds * keep + tokens * seconds

    def line(self) -> tuple[float, float]:
        """(fixed seconds a step, seconds a token); (0, 0) before any step."""
        if not self.weight or not self.tokens:
            return 0.0, 0.0
        mean_tokens, mean_seconds = self.tokens / self.weight, self.seconds / self.weight
        variance = self.tokens_sq / self.weight - mean_tokens**2
        if variance < MIN_TOKEN_VARIANCE:
            return 0.0, self.seconds / self.tokens
        per_token = (self.tokens_seconds / self.weight - mean_tokens * mean_seconds) / variance
        if per_token < 0:  # noise about a flat line (a paced null engine): no cost per token
            return mean_seconds, 0.0
        fixed = mean_seconds - per_token * mean_tokens
        if fixed < 0:  # the best line through the origin instead
            return 0.0, self.tokens_seconds / self.tokens_sq
        return fixed, per_token
