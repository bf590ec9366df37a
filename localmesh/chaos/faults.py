"""The faults: what is done to one process of a component, and when it counts as recovered.

  kill   SIGKILL to the process group (a crash); the supervisor restarts it after its backoff.
  term   SIGTERM (a rolling restart's stop): the service drains and exits; the supervisor restarts it.
  pause  SIGSTOP, ``pause_s`` later SIGCONT: a process that hangs, then wakes (a GC pause, a stuck host).
  slow   ``slow_ms`` of latency on every chunk both ways through the delay proxy in front of it, for
         ``slow_s`` (only the first replica of a tier has a proxy; Cassandra members have none).

The fault is over when the signal is sent (kill, term), at SIGCONT (pause) or when the latency is taken
off (slow); it has recovered when the process runs again and passes its readiness check (a restarted one
is a new process) and then an answer through the front door completes. Time to recover is measured from
the end of the fault to that answer's end.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from localmesh.chaos.topology import SLOWABLE, ChaosMesh

ACTIONS = ("kill", "term", "pause", "slow")


@dataclass(frozen=True)
class Fault:
    component: str
    action: str

    @property
    def kind(self) -> str:
        return f"{self.component} {self.action}"


def faults_for(components: list[str], actions: list[str]) -> list[Fault]:
    """Every (component, action) pair that can be done, components outermost."""
    return [
        Fault(component, action)
        for component in components
        for action in actions
        if action != "slow" or component in SLOWABLE
    ]


@dataclass(frozen=True)
class FaultTiming:
    pause_s: float = 3.0
    slow_ms: float = 300.0
    slow_s: float = 5.0


@dataclass
class Injection:
    fault: Fault
    target: str
    injected_at: float
    over_at: float = 0.0
    # Seconds from the fault's end until the component was back and a probe answer completed; None if
    # that did not happen within the recovery timeout.
    recover_s: float | None = None


def target_of(mesh: ChaosMesh, fault: Fault, earlier: int) -> str:
    """The process a fault hits: the replicas of its component in turn (``earlier``: faults its component
    had before), so no one process restarts over and over and waits out a long backoff; for ``slow``,
    the one behind the proxy."""
    replicas = mesh.replicas(fault.component)
    if fault.action == "slow":
        return replicas[0]
    return replicas[earlier % len(replicas)]


def inject(
    mesh: ChaosMesh, fault: Fault, target: str, timing: FaultTiming, wait: Callable[[float], None]
) -> Injection:
    """Does the fault to ``target``; ``wait(seconds)`` keeps the supervisor ticking meanwhile."""
    injection = Injection(fault, target, time.monotonic())
    if fault.action in ("kill", "term"):
        mesh.signal(target, signal.SIGKILL if fault.action == "kill" else signal.SIGTERM)
    elif fault.action == "pause":
        mesh.signal(target, signal.SIGSTOP)
        try:
            wait(timing.pause_s)
        finally:
            mesh.signal(target, signal.SIGCONT)
    elif fault.action == "slow":
        mesh.proxies.set_delay(fault.component, timing.slow_ms / 1000)
        try:
            wait(timing.slow_s)
        finally:
            mesh.proxies.set_delay(fault.component, 0.0)
    else:
        raise ValueError(f"unknown fault action {fault.action!r}")
    injection.over_at = time.monotonic()
    return injection


def back(mesh: ChaosMesh, injection: Injection, old_pid: int | None) -> bool:
    """Whether the target runs again (a new process after kill or term) and is ready."""
    if injection.fault.action in ("kill", "term") and mesh.pid(injection.target) == old_pid:
        return False
    return mesh.ready(injection.target)
