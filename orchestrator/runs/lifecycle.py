"""The runs of this replica, by job: each part is a file of its own, over one index of the runs held
here (``held_runs.py``), and a run's state is its own (``held_run.py``, ``run_state.py``).

    starts     admission, placement, going live (``starts.py``; each kind of run calls its steps)
    reads      following a run from a sequence number, reading it as it stands (``reads.py``)
    cancels    CancelRun, and the runs of a deleted chat (``cancels.py``)
    adoptions  continuing a lost replica's runs, and this replica's strays (``adoption.py``)
    drain      shutdown: a grace, then the rest handed over (``drain.py``)
"""

from __future__ import annotations

from memory_store.store import MemoryStore
from orchestrator.policy.admission import Budgets, RunSlots
from orchestrator.router_client import RouterClient
from orchestrator.runs.adoption import Adoptions
from orchestrator.runs.cancels import Cancels
from orchestrator.runs.drain import Drain
from orchestrator.runs.held_runs import HeldRuns
from orchestrator.runs.reads import Reads
from orchestrator.runs.relay import RelayDeps
from orchestrator.runs.starts import Starts


class Runs:
    def __init__(
        self,
        store: MemoryStore,
        router: RouterClient,
        deps: RelayDeps,
        budgets: Budgets,
        slots: RunSlots,
    ) -> None:
        self.deps = deps
        self.held = HeldRuns(deps.config, deps.late_ends)
        self.reads = Reads(self.held, store, deps.config)
        self.starts = Starts(self.held, self.reads, router, deps, budgets, slots)
        self.cancels = Cancels(self.held, self.reads, store, deps.config)
        self.adoptions = Adoptions(self.held, store, router, deps)
        self.drain = Drain(self.held, deps.config)
