"""The chaos suite's quick case: one kill -9 of each kind of component under a short chat load, on the
multi-replica local mesh (``make run``'s services under its supervisor: 2 orchestrators, 2 routers, 3
paced null engines, a 3-node Cassandra cluster, the edge and Envoy; users through Envoy as the page).

Each test asserts the goal for its component: the mesh recovers, every answer completes, no gap, no
duplicate event, no acknowledged message lost, and what was stored is what was streamed (an engine:
the router's failover; a router: the orchestrator goes on through another; an orchestrator: another
replica adopts its runs; the edge and Envoy: clients resume with Last-Event-ID; a Cassandra member: RF=3
at LOCAL_QUORUM). A quarter of the questions make the orchestrator run its calculator (tool steps):
no step's tool runs twice, and no stream misses a step event.

The full suite (every fault kind, N times) is a benchmark: ``make chaos`` (bench/chaos.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from localmesh.chaos.faults import Fault
from localmesh.chaos.load import LoadSettings
from localmesh.chaos.report import BASELINE, Row
from localmesh.chaos.suite import ChaosSettings, Suite
from localmesh.chaos.topology import COMPONENTS, ChaosMesh, Topology

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

# A Cassandra member takes 30-50 s to come back on a busy 2-core box: the recovery timeout leaves room.
QUICK = ChaosSettings(
    load=LoadSettings(users=4, max_tokens=32), baseline_s=3.0, settle_s=1.5, recover_timeout_s=180
)


@pytest.fixture(scope="module")
def chaos_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosMesh]:
    mesh = ChaosMesh(Topology(delay_proxies=False), tmp_path_factory.mktemp("chaos"))
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.close()


def run(mesh: ChaosMesh, fault: Fault) -> dict[str, Row]:
    result = Suite(mesh, QUICK, echo=lambda line: None).run([fault])
    return {row.kind: row for row in result.rows}


@pytest.mark.parametrize("component", COMPONENTS)
def test_kill_9_under_load(chaos_mesh: ChaosMesh, component: str):
    fault = Fault(component, "kill")
    rows = run(chaos_mesh, fault)
    baseline, row = rows[BASELINE], rows[fault.kind]
    assert baseline.answers == baseline.completed and baseline.errors == 0, baseline
    assert row.injected == 1 and row.not_recovered == 0, row
    assert row.answers > 0, row  # answers ran through or after the fault: it was measured under load
    assert row.completed == row.answers and row.errors == 0, row
    assert (row.gaps, row.dups, row.lost, row.stored_differs) == (0, 0, 0, 0), row
    # A share of the answers took tool steps: none ran its tool twice, none went missing from a stream.
    assert baseline.steps + row.steps > 0, (baseline, row)
    assert (row.twice, row.step_gaps, baseline.twice, baseline.step_gaps) == (0, 0, 0, 0), row
    assert row.ran <= row.steps, row
