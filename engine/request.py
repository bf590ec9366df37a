"""One request inside the engine: what was asked (``EngineRequest``) and how far it got (``Request``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, IntEnum

from engine.speculation import Drafter
from engine.structured import CompiledGrammar, Constraint, GrammarState


class Priority(IntEnum):
    LOW = 1
    NORMAL = 2
    HIGH = 3


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    seed: int = 0  # the draw for output position i depends only on (seed, i)
    max_tokens: int = 16  # counts resumed output tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    constraint: Constraint | None = None  # what the output must match (engine.structured)
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by id
    min_p: float = 0.0  # 0: off; else drop tokens below min_p times the likeliest's probability
    logprobs: bool = False  # report each sampled token's log-probability
    top_logprobs: int = 0  # and this many likeliest alternatives
    # Derived once, read for every row of every step (a property call there cost the sampler 2x on a
    # greedy batch of 32).
    penalizes: bool = field(init=False)
    # Whether the logits are changed before the pick (greedy decoding then needs them too).
    adjusts_logits: bool = field(init=False)

    def __post_init__(self) -> None:
        penalizes = self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        object.__setattr__(self, "penalizes", penalizes)
        object.__setattr__(self, "adjusts_logits", penalizes or bool(self.logit_bias))


@dataclass(frozen=True)
class EngineRequest:
    """A validated request, as the service hands it to the engine."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    # Output an earlier engine already delivered (failover): context here, output to the client.
    resumed_output_token_ids: tuple[int, ...] = ()
    priority: Priority = Priority.NORMAL
    # The longest it may wait before it is first scheduled (0: no limit): past it, it is refused.
    max_queue_s: float = 0.0
    # ``sampling.constraint`` compiled for the served tokenizer (the service compiles it before the
    # engine takes the request).
    grammar: CompiledGrammar | None = None


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_serials = itertools.count()


@dataclass(eq=False)
class Request:
    """A request's scheduling state: its tokens, how many of them have KV computed, the blocks holding it.

    ``token_ids`` is the prompt followed by every output token (resumed ones included). The scheduler
    lets ``num_computed_tokens`` catch up with ``num_tokens``; a sampled token extends ``token_ids``.
    """

    request: EngineRequest
    arrival: float
    # Aging without a timer: a request ranks as if it had arrived `aging_s` earlier per priority level,
    # so a LOW request that has waited 2·aging_s longer than a HIGH one goes first. The key never
    # changes, so queue order is stable and a heap works.
    aging_s: float
    serial: int = field(default_factory=lambda: next(_serials))  # breaks ties of equal keys: first come first
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)  # physical block ids, one per block_size tokens
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks, filled lazily
    num_stored_blocks: int = 0  # leading blocks that are prefix-cache entries (hits, or stored after a step)
    num_prefix_hit_tokens: int | None = None  # context tokens the prefix cache served at first schedule
    queued_prefill_tokens: int = 0  # while waiting: its tokens beyond the prefix cache's when it was queued
    status: RequestStatus = RequestStatus.WAITING
    grammar: GrammarState | None = None  # where its output is in its constraint's grammar, if any
    # Speculation (engine.speculation): its drafting state, and the tokens drafted for this step to
    # verify after its newest one. Drafts are never in token_ids: only tokens the model picked are.
    drafter: Drafter = field(default_factory=Drafter)
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = [*self.request.prompt_token_ids, *self.request.resumed_output_token_ids]
        self.num_prompt_tokens = len(self.request.prompt_token_ids)
        self.num_context_tokens = len(self.token_ids)  # prompt + resumed output: what Usage calls prompt
        self.sort_key = (self.arrival - int(self.priority) * self.aging_s, self.serial)
        max_queue_s = self.request.max_queue_s
        self.queue_deadline = self.arrival + max_queue_s if max_queue_s > 0 else None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def priority(self) -> Priority:
        return self.request.priority

    @property
    def started(self) -> bool:
        """Whether it has been scheduled once (its prefill begun): from then on it is never dropped."""
        return self.num_prefix_hit_tokens is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output positions so far, resumed ones included: the index of the next sampled token."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
