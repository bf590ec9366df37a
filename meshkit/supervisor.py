"""Restarts the services of a ``Launcher`` that die, with backoff, as Kubernetes restarts a pod's container.

``make run`` calls ``tick()`` about once a second from its main thread (services must be spawned from a
thread that outlives them: see ``Launcher.spawn``). A service that exited is restarted after a backoff
that doubles with each restart (1 s, 2 s, 4 s ... up to 30 s) and is forgotten once the service has
stayed ready for a minute, so one crash a day never waits 30 s. Every exit, restart and recovery is
logged. A restart does not block: the service is spawned, and later ticks check its readiness, so the
other services stay supervised while a slow one (an engine loading its model) comes back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from meshkit.launcher import Launcher, PortInUseError, ServiceSpec

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# A service ready for this long has recovered: its next crash starts the backoff over.
STABLE_AFTER_S = 60.0


@dataclass
class _Watch:
    spec: ServiceSpec
    restarts: int = 0
    # When it is due to be spawned again (it exited), or None while it runs.
    restart_at: float | None = None
    # When it was spawned again and not yet seen ready, or None.
    respawned_at: float | None = None
    ready_since: float = 0.0


class Supervisor:
    """Keeps every service the launcher started running."""

    def __init__(
        self,
        launcher: Launcher,
        echo: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.launcher = launcher
        self._echo = echo or (lambda line: print(line, flush=True))
        self._clock = clock
        self._watches: dict[str, _Watch] = {}

    def watch_all(self) -> None:
        """Supervises every service the launcher runs now (call it once they are all ready)."""
        now = self._clock()
        for name, running in self.launcher.running.items():
            self._watches.setdefault(name, _Watch(running.spec, ready_since=now))

    def restarts(self, name: str) -> int:
        return self._watches[name].restarts

    def tick(self) -> None:
        now = self._clock()
        for name, watch in self._watches.items():
            if watch.restart_at is not None:
                if now >= watch.restart_at:
                    self._respawn(name, watch, now)
                continue
            running = self.launcher.running[name]
            code = running.process.poll()
            if code is not None:
                self._exited(name, watch, code, now)
            elif watch.respawned_at is not None and (watch.spec.ready is None or watch.spec.ready()):
                self._echo(f"  {name} ready again after {now - watch.respawned_at:.1f}s, pid {running.pid}")
                watch.respawned_at, watch.ready_since = None, now

    def _exited(self, name: str, watch: _Watch, code: int, now: float) -> None:
        if watch.respawned_at is None and now - watch.ready_since >= STABLE_AFTER_S:
            watch.restarts = 0
        backoff = min(FIRST_BACKOFF_S * 2**watch.restarts, MAX_BACKOFF_S)
        self._echo(
            f"\n{name} exited with code {code}; restarting it in {backoff:.0f}s "
            f"(restart {watch.restarts + 1}; log: {self.launcher.running[name].log_path})"
        )
        self.launcher.stop(name)  # reaps what it left in its process group
        watch.restart_at, watch.respawned_at = now + backoff, None

    def _respawn(self, name: str, watch: _Watch, now: float) -> None:
        watch.restarts += 1
        try:
            self.launcher.spawn(watch.spec)
        except PortInUseError as exc:
            # What it left behind still holds its port: try again after the next backoff.
            backoff = min(FIRST_BACKOFF_S * 2**watch.restarts, MAX_BACKOFF_S)
            self._echo(f"  cannot restart {name} yet ({exc}); next try in {backoff:.0f}s")
            watch.restart_at = now + backoff
            return
        watch.restart_at, watch.respawned_at = None, now
