"""The engine's step time as a line in the tokens a step computes, fitted from the steps it ran."""

import pytest

from engine.step_cost import HALF_LIFE_STEPS, StepCost


def test_before_any_step_nothing_is_known():
    assert StepCost().line() == (0.0, 0.0)


def test_steps_of_different_sizes_give_the_fixed_part_and_the_part_per_token():
    cost = StepCost()
    for tokens in (20, 512, 64, 300, 1, 128) * 5:
        cost.observe(tokens, 0.015 + 0.003 * tokens)
    fixed, per_token = cost.line()
    assert fixed == pytest.approx(0.015) and per_token == pytest.approx(0.003)


def test_steps_all_of_one_size_charge_every_second_to_the_tokens():
    # The fixed part cannot be told apart: the line through the origin overstates smaller steps, never
    # understates bigger ones.
    cost = StepCost()
    for _ in range(10):
        cost.observe(32, 0.08)
    assert cost.line() == pytest.approx((0.0, 0.0025))


def test_a_paced_engine_whose_steps_take_the_same_time_whatever_their_size_costs_nothing_a_token():
    cost = StepCost()
    for tokens, seconds in ((4, 0.021), (30, 0.019), (8, 0.0205), (64, 0.0195)):
        cost.observe(tokens, seconds)
    fixed, per_token = cost.line()
    assert per_token == 0.0 and fixed == pytest.approx(0.02, abs=0.001)


def test_the_fit_follows_the_engine_when_its_steps_slow_down():
    # A CPU that another process starts sharing: steps take twice as long. After a few half-lives the
    # line is the new one.
    cost = StepCost()
    for tokens in (16, 256) * HALF_LIFE_STEPS:
        cost.observe(tokens, 0.01 + 0.002 * tokens)
    for tokens in (16, 256) * 4 * HALF_LIFE_STEPS:
        cost.observe(tokens, 0.02 + 0.004 * tokens)
    fixed, per_token = cost.line()
    assert per_token == pytest.approx(0.004, rel=0.05) and fixed == pytest.approx(0.02, rel=0.1)
