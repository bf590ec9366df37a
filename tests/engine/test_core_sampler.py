"""Sampling semantics (greedy, temperature, top-k, top-p) and reproducibility per (seed, position)."""

import numpy as np
import pytest

from engine.request import SamplingParams
from engine.sampler import sample, sample_one, uniform

VOCAB = 1000


def logits_with(values: dict[int, float], rest: float = -20.0) -> np.ndarray:
    logits = np.full(VOCAB, rest, dtype=np.float32)
    for token, value in values.items():
        logits[token] = value
    return logits


def draws(logits: np.ndarray, params: SamplingParams, n: int = 4000) -> np.ndarray:
    return np.array([sample_one(logits, params, uniform(params.seed, i)) for i in range(n)])


def test_greedy_takes_the_argmax_and_ties_go_to_the_lowest_id():
    logits = logits_with({5: 3.0, 7: 3.0, 9: 1.0})
    assert sample(np.stack([logits, logits_with({9: 2.0})]), [SamplingParams()] * 2, [0, 0]) == [5, 9]


def test_a_runners_known_argmax_picks_the_greedy_rows_and_the_others_still_sample_their_logits():
    rows = np.stack([logits_with({5: 3.0}), logits_with({8: 9.0})])
    params = [SamplingParams(), SamplingParams(temperature=0.5, seed=3)]
    # The argmax the runner says is what a greedy row gets (here not the logits' own, to tell them apart).
    assert sample(rows, params, [0, 0], argmax=np.array([6, 0])) == [6, 8]


def test_top_k_1_is_greedy_at_any_temperature():
    logits = logits_with({3: 1.0, 4: 0.9, 8: 0.95})
    assert set(draws(logits, SamplingParams(temperature=2.0, top_k=1), n=200)) == {3}


def test_top_k_keeps_only_the_k_most_likely_tokens():
    logits = logits_with({1: 2.0, 2: 1.9, 3: 1.8, 4: 1.7, 5: 1.6})
    assert set(draws(logits, SamplingParams(temperature=1.0, top_k=3, seed=1))) == {1, 2, 3}


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    # probabilities ~ 0.5, 0.3, 0.2 (the rest negligible)
    logits = logits_with({10: np.log(0.5), 11: np.log(0.3), 12: np.log(0.2)}, rest=-60.0)
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=2))) == {10, 11}
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.85, seed=2))) == {10, 11, 12}


def test_top_p_finds_the_nucleus_when_it_is_wider_than_the_first_probe():
    logits = np.zeros(VOCAB, dtype=np.float32)  # uniform: the nucleus of 0.5 is half the vocabulary
    got = draws(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=3), n=3000)
    assert got.max() < VOCAB // 2 + 1, "ties are broken by id, so the nucleus is the lowest ids"
    assert len(set(got)) > 400


def test_temperature_matches_the_softmax_distribution():
    logits = logits_with({0: 1.0, 1: 0.0, 2: -1.0}, rest=-80.0)
    for temperature in (0.5, 1.0, 2.0):
        got = draws(logits, SamplingParams(temperature=temperature, seed=4), n=8_000)
        expected = np.exp(np.array([1.0, 0.0, -1.0]) / temperature)
        expected /= expected.sum()
        observed = np.bincount(got, minlength=3)[:3] / len(got)
        np.testing.assert_allclose(observed, expected, atol=0.02)


def test_the_same_seed_and_position_give_the_same_token_anywhere_in_a_batch():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((4, VOCAB)).astype(np.float32)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in (11, 12, 13, 14)]
    together = sample(rows, params, [5, 6, 7, 8])
    apart = [sample(rows[i : i + 1], [params[i]], [5 + i])[0] for i in range(4)]
    reordered = sample(rows[::-1].copy(), params[::-1], [8, 7, 6, 5])[::-1]
    assert together == apart == reordered


def test_the_draw_depends_only_on_seed_and_position():
    assert uniform(42, 7) == uniform(42, 7)
    assert len({uniform(42, i) for i in range(100)}) == 100
    assert uniform(42, 7) != uniform(43, 7)
    assert all(0.0 <= uniform(s, i) < 1.0 for s in (0, 2**64 - 1) for i in (0, 10**9))
    logits = np.random.default_rng(1).standard_normal(VOCAB).astype(np.float32)
    a = draws(logits, SamplingParams(temperature=1.0, seed=5), n=50)
    b = draws(logits, SamplingParams(temperature=1.0, seed=6), n=50)
    assert (a == draws(logits, SamplingParams(temperature=1.0, seed=5), n=50)).all()
    assert (a != b).any()


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_k=50)]
)
def test_samples_never_pick_a_token_with_negligible_probability(params):
    logits = logits_with({100: 5.0, 200: 4.0}, rest=-1e4)
    assert set(draws(logits, params, n=500)) <= {100, 200}
