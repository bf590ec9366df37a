"""Sampling semantics (greedy, temperature, top-k, top-p, min-p, logit bias, penalties), logprobs, and
reproducibility per (seed, position)."""

import json
from pathlib import Path

import numpy as np
import pytest

from engine.logprobs import token_logprob
from engine.request import SamplingParams
from engine.sampler import adjusted, best_ids, sample, sample_one, uniform
from tests.fixtures.sampler_cases import OUTPUT, PARAMS, POSITIONS, logit_rows

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


def test_the_draws_over_a_262k_vocabulary_are_those_the_committed_data_recorded():
    """The token for each (settings, seed, position, logits) is the one the first sampler drew
    (tests/data/sampler_draws.json, bench/make_sampler_fixture.py): reworking the sampler for speed
    must not change a single draw."""
    recorded = json.loads((Path(__file__).parents[1] / "data" / "sampler_draws.json").read_text())["draws"]
    rows = logit_rows()
    for params, expected in zip(PARAMS, recorded, strict=True):
        for position, tokens in zip(POSITIONS, expected, strict=True):
            n = len(rows)
            assert sample(rows, [params] * n, [position] * n, [OUTPUT] * n) == tokens, (params, position)


def test_best_ids_are_the_k_highest_by_value_then_id_however_k_compares_with_the_vocabulary():
    rows = logit_rows().astype(np.float64)
    rows[1, ::7] = -np.inf  # what min-p leaves of a row
    ids = np.arange(rows.shape[1])
    for row in rows:
        everything = np.lexsort((ids, -row))  # a full sort: value descending, then id ascending
        for k in (1, 5, 40, 64, 1000, 4096, 20_000, 32_768, len(row) - 1, len(row)):
            assert (best_ids(row, k) == everything[:k]).all(), k


# -- logit bias, penalties, min-p: pure functions of (logits, params, output so far) ---------------------


def test_penalties_follow_openais_formula_on_the_output_so_far():
    logits = logits_with({1: 1.0, 2: 1.0, 3: 1.0})
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    row = adjusted(logits, params, [2, 3, 3, 3])
    assert row[1] == pytest.approx(1.0)
    assert row[2] == pytest.approx(1.0 - 0.5 - 0.25 * 1)
    assert row[3] == pytest.approx(1.0 - 0.5 - 0.25 * 3)
    assert logits[3] == 1.0, "the runner's logits are left as they were"


def test_a_negative_penalty_favours_what_was_said():
    row = adjusted(logits_with({1: 1.0, 2: 1.0}), SamplingParams(presence_penalty=-1.0), [2])
    assert row[2] > row[1]


def test_logit_bias_decides_greedy_decoding_and_bans_tokens_from_sampling():
    logits = logits_with({5: 3.0, 9: 2.0})
    forced = SamplingParams(logit_bias=((9, 5.0),))
    assert sample(np.stack([logits]), [forced], [0]) == [9]
    banned = SamplingParams(temperature=1.5, seed=4, logit_bias=((5, -100.0),))
    assert 5 not in {sample(np.stack([logits]), [banned], [i])[0] for i in range(300)}


def test_greedy_with_a_penalty_moves_off_a_repeated_token():
    logits = logits_with({5: 3.0, 9: 2.5})
    params = SamplingParams(frequency_penalty=1.0)
    assert sample(np.stack([logits]), [params], [0], outputs=[[]]) == [5]
    assert sample(np.stack([logits]), [params], [1], outputs=[[5]]) == [9]


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    # probabilities ~ 0.6, 0.3, 0.1: min_p 0.4 keeps tokens with p >= 0.24.
    logits = logits_with({10: np.log(0.6), 11: np.log(0.3), 12: np.log(0.1)}, rest=-60.0)
    assert set(draws(logits, SamplingParams(temperature=1.0, min_p=0.4, seed=2), n=2000)) == {10, 11}
    assert set(draws(logits, SamplingParams(temperature=1.0, min_p=0.1, seed=2), n=2000)) == {10, 11, 12}
    assert set(draws(logits, SamplingParams(temperature=1.0, min_p=1.0, seed=2), n=200)) == {10}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, seed=11, presence_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(temperature=0.9, seed=11, logit_bias=((3, 2.0), (7, -1.0)), min_p=0.05),
        SamplingParams(frequency_penalty=2.0, logit_bias=((4, 1.5),)),
    ],
    ids=["penalties", "bias-min-p", "greedy-penalized"],
)
def test_the_knobs_pick_the_same_token_alone_or_anywhere_in_a_batch(params):
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(4, VOCAB)).astype(np.float32)
    output = [3, 4, 4, 7, 3, 3]
    alone = sample(rows[2:3], [params], [6], outputs=[output])
    others = [SamplingParams(temperature=1.0, seed=i) for i in range(3)]
    batched = sample(
        rows, [others[0], others[1], params, others[2]], [0, 1, 6, 2], outputs=[[], [], output, []]
    )
    assert batched[2] == alone[0]


# -- logprobs ------------------------------------------------------------------------------------------


def test_token_logprob_is_the_log_softmax_of_the_raw_logits_with_the_likeliest_first():
    logits = logits_with({4: 2.0, 6: 1.0, 8: 2.0}, rest=-5.0)
    expected = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    found = token_logprob(logits, 6, top=3)
    assert found.token_id == 6 and found.logprob == pytest.approx(expected[6])
    assert [token for token, _ in found.top] == [4, 8, 6]  # ties: lower id first
    assert [value for _, value in found.top] == pytest.approx([expected[4], expected[8], expected[6]])
    assert token_logprob(logits, 6, top=0).top == ()
