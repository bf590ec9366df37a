"""The scale simulation, small: the real router code over 20 simulated engines for a few seconds."""

from dataclasses import replace

import pytest

from bench.sim.costs import SEEDS_GPU
from bench.sim.setup import Setup
from bench.sim.simulation import Simulation
from bench.sim.workload import Workload

ENGINES = 20
SMALL = Setup(
    engines=ENGINES,
    costs=SEEDS_GPU,
    workload=Workload(peak_prompts_per_s=20.0 * ENGINES, duration_s=24.0, ramp_s=8.0),
)


def run(**changes) -> dict:
    workload = replace(SMALL.workload, **changes.pop("workload", {}))
    return Simulation(replace(SMALL, workload=workload, **changes)).run().summary()


@pytest.fixture(scope="module")
def kv_aware() -> dict:
    return run()


def test_every_request_ends_finished_or_shed(kv_aware):
    assert kv_aware["requests"] > 200
    assert kv_aware["lost"] == 0
    assert kv_aware["finished"] == kv_aware["requests"]  # nothing shed at 1x


def test_kv_aware_hit_rate_is_near_the_oracles_and_far_above_round_robin(kv_aware):
    oracle, round_robin = run(policy="oracle"), run(policy="round_robin")
    assert kv_aware["hit_rate"] >= 0.9 * oracle["hit_rate"]
    assert kv_aware["hit_rate"] > round_robin["hit_rate"] + 0.3
    assert kv_aware["predicted_exact"] > 0.95  # the index saw exactly what the engines cached


def test_under_overload_the_free_tier_is_shed_before_the_paid_one():
    overloaded = run(workload={"load": 3.0})
    assert overloaded["lost"] == 0
    assert overloaded["shed_free"] > 0.2
    assert overloaded["shed_paid"] < overloaded["shed_free"] / 4


def test_replicas_following_every_engine_hold_the_same_index():
    replicated = run(routers=3)
    assert replicated["replicas_agree"] and replicated["lost"] == 0


def test_a_dead_engines_requests_fail_over_and_none_is_lost():
    failed = run(fail_engine_at_s=12.0)
    assert failed["failovers"] > 0
    assert failed["lost"] == 0


def test_session_hints_place_a_lagging_index_s_follow_ups_as_a_prompt_index_would(kv_aware):
    lagging = run(event_lag_s=0.5, session_hints=0)
    hinted = run(event_lag_s=0.5)
    assert lagging["predicted_exact"] < 0.97  # turns came before their last answer's events
    assert hinted["hinted"] > 0.02 and hinted["predicted_exact"] > 0.99
    assert abs(hinted["hit_rate"] - kv_aware["hit_rate"]) < 0.005
