"""The null runner: the argmax it reports is its logits' own, and an engine on it emits the same tokens
whether it picks greedy rows from that argmax or scans the logits."""

from __future__ import annotations

import numpy as np

from engine.model.null_runner import NullModelRunner
from engine.model.runner import ModelSpec, SequenceChunk
from tests.engine.core_helpers import make_engine, prompt, request, tokenizer, word_tokens


def null_runner() -> NullModelRunner:
    tok = tokenizer()
    spec = ModelSpec("null", 0, 0, 0, tok.vocab_size, 4096)
    return NullModelRunner(spec, word_tokens())


def chunk(start: int, needs_logits: bool = True) -> SequenceChunk:
    return SequenceChunk(np.zeros(1, dtype=np.int32), start, [0] * (start // 4 + 1), needs_logits)


def test_the_argmax_it_reports_is_that_of_the_logits_it_returned_as_the_batch_grows_and_shrinks():
    runner = null_runner()
    for starts in ([3], [7, 12, 40], list(range(9)), [5, 6]):
        chunks = [chunk(s) for s in starts] + [chunk(99, needs_logits=False)]
        logits = runner.execute(chunks)
        assert len(logits) == len(starts)
        assert runner.argmax().tolist() == np.argmax(logits, axis=1).tolist()


class ScanningNullRunner(NullModelRunner):
    """The null runner without its argmax: the engine's sampler scans every row."""

    def __getattribute__(self, name: str):
        if name == "argmax":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_an_engine_on_it_emits_the_same_tokens_from_its_argmax_as_from_a_scan():
    def tokens(runner: NullModelRunner) -> dict[str, list[int]]:
        driven = make_engine(runner)
        for i in range(6):
            driven.engine.add_request(request(f"r{i}", prompt(5 + i, salt=i), max_tokens=12))
        return {rid: result.token_ids for rid, result in driven.run().items()}

    scanning = ScanningNullRunner(null_runner().spec, word_tokens())
    assert not hasattr(scanning, "argmax")
    told = tokens(null_runner())
    assert told == tokens(scanning)
    assert all(len(ids) == 12 for ids in told.values())
