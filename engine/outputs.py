"""What the engine hands out: token outputs per request per step, and its load after each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from chatmesh.errors import ServiceError
from chatmesh.finish import FinishReason, Usage
from engine.logprobs import TokenLogprob


@dataclass(frozen=True)
class Finish:
    reason: FinishReason
    usage: Usage
    text: str = ""  # text held back until the end
    matched_stop: str = ""  # the stop string or stop token (as text) that ended generation
    error: str = ""  # non-empty: the engine failed and the request did not complete
    # Set: the engine refused the request before starting it (it waited past its queue limit). Not a
    # failure of the engine: the request ends with this error, nothing else does.
    refusal: ServiceError | None = None


@dataclass
class RequestOutput:
    """One request's share of one step: new tokens (maybe none), the text they release, maybe the end."""

    request_id: str
    index: int  # output position of token_ids[0] (resumed output counts)
    token_ids: list[int]
    text: str
    finish: Finish | None = None
    # Per token, the end offset in ``text`` (code points) of what it and the tokens before it released:
    # GenerateTokens.text_ends, so a reader can split merged frames back into per-token pieces.
    text_ends: list[int] = field(default_factory=list)
    # With SamplingParams.logprobs: one per token of token_ids.
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class EngineStats:
    """The engine's load after a step: what GetLoad and WatchLoad report and the gauges show."""

    waiting_requests: int = 0
    # Of those, the ones the step passed over (no running slot or KV blocks for them); requests that
    # arrived during the step wait only for the next one.
    blocked_requests: int = 0
    running_requests: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0  # prompt tokens still to compute before their first tokens
    # Its step time lately: step_fixed_s + step_token_s x tokens a step computes (0, 0: not measured).
    step_fixed_s: float = 0.0
    step_token_s: float = 0.0
    # Speculative decoding: draft tokens verified and accepted since start; whether the latest step
    # verified any.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    speculating: bool = False

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0
