"""Helpers for the engine-core tests: an engine (on the token-function runner unless given another), driven step by step."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from chatmesh.tokenizer import ChatTokenizer, load_tokenizer
from engine.config import EngineConfig
from engine.detokenizer import Detokenizer
from engine.llm_engine import LLMEngine
from engine.model.runner import ModelRunner
from engine.outputs import Finish, RequestOutput
from engine.request import EngineRequest, Priority, SamplingParams
from tests.engine.token_function_runner import TokenFunctionRunner

WORDS = " the cat sat on a mat while one dog ran far after birds and then it slept under old trees by rivers"


def tokenizer() -> ChatTokenizer:
    return load_tokenizer()


def word_tokens() -> list[int]:
    """Plain word tokens: what the token-function runner emits (never end-of-sequence)."""
    return tokenizer().encode(WORDS)


def prompt(n: int, salt: int = 0) -> list[int]:
    """A prompt of n word tokens; different salts give different prompts."""
    words = word_tokens()
    return [words[(i * 7 + salt * 13 + i // 5) % len(words)] for i in range(n)]


def released_pieces(
    tok: ChatTokenizer, token_ids: Sequence[int], stop: Sequence[str] = ()
) -> list[tuple[int, str]]:
    """What each token releases when tokens reach a fresh detokenizer one at a time (end-of-sequence
    tokens release nothing): the pieces any frame of these tokens must split back into."""
    detokenizer, eos = Detokenizer(tok, stop), set(tok.eos_token_ids)
    pieces = []
    for token in token_ids:
        pieces.append((token, "" if token in eos else detokenizer.push(token)))
        if detokenizer.matched_stop is not None:
            break
    return pieces


def request(
    request_id: str,
    prompt_ids: list[int],
    max_tokens: int = 8,
    priority: Priority = Priority.NORMAL,
    resumed: tuple[int, ...] = (),
    max_queue_s: float = 0.0,
    **sampling: object,
) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt_ids),
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
        resumed_output_token_ids=resumed,
        priority=priority,
        max_queue_s=max_queue_s,
    )


@dataclass
class DrivenEngine:
    engine: LLMEngine
    runner: TokenFunctionRunner
    outputs: list[RequestOutput] = field(default_factory=list)

    def run(self, max_steps: int = 10_000) -> dict[str, Result]:
        """Steps until every request finished; returns each request's result."""
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                return results(self.outputs)
            self.engine.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


@dataclass
class Result:
    first_index: int
    token_ids: list[int]
    text: str
    finish: Finish


def results(outputs: list[RequestOutput]) -> dict[str, Result]:
    """Each request's tokens and text, checking that its frames are contiguous and end with one finish."""
    found: dict[str, Result] = {}
    for out in outputs:
        res = found.get(out.request_id)
        if res is None:
            res = found[out.request_id] = Result(out.index, [], "", None)  # type: ignore[arg-type]
        assert res.finish is None, f"{out.request_id}: output after its finish"
        assert out.index == res.first_index + len(res.token_ids), f"{out.request_id}: frames not contiguous"
        res.token_ids += out.token_ids
        res.text += out.text
        if out.finish is not None:
            res.finish = out.finish
            res.text += out.finish.text
    return found


def make_engine(
    runner: ModelRunner | None = None, clock: Callable[[], float] = time.monotonic, **config: object
) -> DrivenEngine:
    tok = tokenizer()
    runner = runner or TokenFunctionRunner(tok.vocab_size, word_tokens())
    base = EngineConfig(num_kv_blocks=256, block_size=4, max_batched_tokens=64, max_running_requests=16)
    test = DrivenEngine(engine=None, runner=runner)  # type: ignore[arg-type]
    test.engine = LLMEngine(replace(base, **config), runner, tok, on_outputs=test.outputs.extend, clock=clock)
    return test
