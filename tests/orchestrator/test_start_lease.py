"""The start lease of an idempotency key (orchestrator/runs/chat_run.py): the attempt holding it writes
its run before the lease can pass to a retry on another replica, and should two attempts ever start
the same run, they generate the same answer. Pure arithmetic and the router request, no services."""

from __future__ import annotations

import pytest

from chatmesh.limits import Generation
from memory_store.config import StoreConfig
from memory_store.ids import new_id
from orchestrator.config import LEASE_SKEW_S, OrchestratorConfig, RunConfig
from orchestrator.router_client import start_frame

# A lease is one replica's clock read by another's, and a write in flight when its caller gave up may
# still land (Cassandra's write timeout): what the lease must leave beyond the writes' own deadlines.
SKEW_S = 5.0


@pytest.mark.parametrize("config", [RunConfig(), RunConfig(placement_timeout_s=5.0, store_deadline_s=2.0)])
def test_a_lease_holder_writes_its_run_before_its_lease_can_pass_to_another_attempt(
    config: RunConfig,
) -> None:
    # create_run's longest: its logged batch times out, then the ordered fallback's two writes do;
    # three requests one after another, each bounded by the store deadline.
    create_run_s = 3 * config.store_deadline_s
    # The latest a holder begins create_run, measured from before its claim (or lease take) was sent.
    latest_start = config.start_lease_s - config.create_run_s - LEASE_SKEW_S
    assert latest_start + create_run_s + SKEW_S <= config.start_lease_s
    # Before that: the claim and the first reads beside it, then the placement with the budget's read
    # and write beside it. A lease shorter than all of it would refuse sends that went as they should.
    before_s = config.store_deadline_s + max(config.placement_timeout_s, 2 * config.store_deadline_s)
    assert before_s <= latest_start


def test_two_starters_of_one_run_sample_the_same_answer() -> None:
    options = Generation("model", 16, temperature=0.7, top_p=1.0, seed=None, stop=())
    run_id, other = str(new_id()), str(new_id())
    first = start_frame(run_id, [1, 2, 3], options, "pro", "chat", "fingerprint")
    second = start_frame(run_id, [1, 2, 3], options, "pro", "chat", "fingerprint")
    assert first.sampling.seed == second.sampling.seed
    # Another run (a regenerated answer) samples anew; a seed the caller chose is kept.
    assert (
        start_frame(other, [1, 2, 3], options, "pro", "chat", "fingerprint").sampling.seed
        != first.sampling.seed
    )
    seeded = Generation("model", 16, temperature=0.7, top_p=1.0, seed=42, stop=())
    assert start_frame(run_id, [1, 2, 3], seeded, "pro", "chat", "fingerprint").sampling.seed == 42


def test_a_cassandra_timeout_longer_than_a_steps_deadline_is_refused_at_start() -> None:
    # A request outlasting its step's deadline could land after the lease passed on.
    with pytest.raises(ValueError, match="cassandra-timeout-s"):
        OrchestratorConfig(store=StoreConfig(request_timeout_s=20.0))
    assert OrchestratorConfig().runs.start_lease_s == 75.0
