"""Incremental detokenization: UTF-8 safe deltas, stop strings across tokens, a pure function of the ids."""

import numpy as np
import pytest

from chatmesh.tokenizer import load_tokenizer
from engine.detokenizer import Detokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def released(tok, ids: list[int], stop: tuple[str, ...] = ()) -> str:
    """The specification (see engine/detokenizer.py), computed from scratch."""
    text = tok.decode(ids).rstrip(REPLACEMENT)
    hits = [at for s in stop if (at := text.find(s)) >= 0]
    if hits:
        return text[: min(hits)]
    for length in range(min(len(text), max((len(s) for s in stop), default=1) - 1), 0, -1):
        if any(s.startswith(text[-length:]) for s in stop):
            return text[:-length]
    return text


def stream(tok, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], Detokenizer]:
    detok = Detokenizer(tok, stop)
    deltas = []
    for token in ids:
        deltas.append(detok.push(token))
        if detok.matched_stop is not None:
            break
    return deltas, detok


def test_multibyte_characters_split_across_tokens_are_never_split_in_deltas(tok):
    text = "Grüße 東京 🙂 ok, ½ café"
    ids = tok.encode(text)
    assert any(REPLACEMENT in tok.decode([i]) for i in ids), "the test needs characters split across tokens"
    deltas, detok = stream(tok, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text


def test_what_is_released_is_a_pure_function_of_the_token_ids(tok):
    rng = np.random.default_rng(7)
    byte_tokens = [
        i for i in range(tok.vocab_size) if len(tok.decode([i])) == 1 and tok.decode([i]) == REPLACEMENT
    ]
    words = tok.encode(" the cat 東京 🙂 Paris is nice")
    stops = ("Paris", "cat 東", "🙂 P")
    for trial in range(40):
        pool = byte_tokens[:40] + words
        ids = [int(pool[i]) for i in rng.integers(0, len(pool), size=25)]
        stop = stops if trial % 2 else ()
        detok = Detokenizer(tok, stop)
        so_far = ""
        for k, token in enumerate(ids, start=1):
            so_far += detok.push(token)
            assert so_far == released(tok, ids[:k], stop), (trial, k)
            if detok.matched_stop is not None:
                break


def test_a_stop_string_spanning_tokens_is_never_released(tok):
    ids = tok.encode(" The capital of France is Paris. It is big.")
    deltas, detok = stream(tok, ids, stop=("France is",))
    assert detok.matched_stop == "France is"
    assert "".join(deltas) == " The capital of "
    assert not any("France" in d for d in deltas)
    assert detok.flush() == ""


def test_a_held_back_partial_match_is_released_when_it_turns_out_not_to_be_one(tok):
    ids = tok.encode(" Paris. Then")
    deltas, detok = stream(tok, ids, stop=("Paris!",))
    assert detok.matched_stop is None
    text = "".join(deltas) + detok.flush()
    assert text == " Paris. Then"
    # " Paris" was held while it could still become "Paris!", then came out with the "."
    paris_at = [i for i, d in enumerate(deltas) if "Paris" in d]
    assert paris_at and "." in deltas[paris_at[0]]


def test_flush_returns_text_held_for_a_possible_stop(tok):
    ids = tok.encode(" Hello wor")
    deltas, detok = stream(tok, ids, stop=("world",))
    assert "".join(deltas) == " Hello "
    assert detok.flush() == "wor"


def test_flush_of_an_unfinished_character_gives_the_replacement_character(tok):
    ids = tok.encode("東")
    assert len(ids) > 1
    deltas, detok = stream(tok, ids[:-1])
    assert "".join(deltas) == ""
    assert detok.flush() == REPLACEMENT
