"""One chaos run: the load on the mesh, the faults one after another, then the stored chats read back.

    result = run_suite(mesh, faults, ChaosSettings(...))   # mesh started; returns rows per fault kind

Before the first fault the load runs ``baseline_s`` alone; each fault is injected into the
next replica of its component, and the next one waits until the mesh has recovered (see faults.py) and
``settle_s`` more. Then the users finish the answers they are reading, every chat they used is read back
through the door and compared with what they were streamed, and the tool steps their runs stored with
what the streams delivered and how often each step's tool ran (the orchestrators' logs).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from localmesh.chaos.clients import ChatUser
from localmesh.chaos.faults import Fault, FaultTiming, Injection, back, inject, target_of
from localmesh.chaos.load import Load, LoadSettings, http_client, stored, stored_steps
from localmesh.chaos.report import Row, ToolRecord, tabulate
from localmesh.chaos.tool_load import executions
from localmesh.chaos.topology import ChaosMesh

TICK_S = 0.2
T = TypeVar("T")


def in_thread(coroutine: Coroutine[object, object, T]) -> T:
    """Runs ``coroutine`` to its end on an event loop of its own, in a thread of its own: ``asyncio.run``
    here would leave the calling thread with no event loop (pytest-asyncio's session loop, in a test)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


@dataclass(frozen=True)
class ChaosSettings:
    load: LoadSettings = field(default_factory=LoadSettings)
    timing: FaultTiming = field(default_factory=FaultTiming)
    repeat: int = 1  # injections of each fault kind
    baseline_s: float = 10.0  # the load alone before the first fault
    settle_s: float = 3.0  # the load alone after each recovery
    recover_timeout_s: float = 120.0


@dataclass
class SuiteResult:
    rows: list[Row]
    injections: list[Injection]
    answers: int
    seconds: float


class Suite:
    def __init__(self, mesh: ChaosMesh, settings: ChaosSettings, echo: Callable[[str], None] = print) -> None:
        self.mesh = mesh
        self.settings = settings
        self.echo = echo

    def wait(self, seconds: float) -> None:
        """Sleeps while the supervisor restarts what died."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            self.mesh.supervisor.tick()
            time.sleep(min(TICK_S, left))

    def run(self, faults: list[Fault]) -> SuiteResult:
        began = time.monotonic()
        settings, mesh = self.settings, self.mesh
        probe_user, probe_chat = self._probe_user()
        load = Load(mesh.url, mesh.keys, settings.load)
        load.start()
        injections: list[Injection] = []
        try:
            self.wait(settings.baseline_s)
            for _ in range(settings.repeat):
                for fault in faults:
                    earlier = sum(1 for done in injections if done.fault.component == fault.component)
                    injections.append(self._one(fault, earlier, probe_user, probe_chat))
                    self.wait(settings.settle_s)
        finally:
            load.stop()
            while load.alive:  # users finish the answers they read; keep restarting what dies
                self.wait(TICK_S)
        record = load.record
        messages = in_thread(stored(mesh.url, mesh.keys, record.chats, settings.load))
        steps = in_thread(stored_steps(mesh.url, mesh.keys, record.answers, settings.load))
        tools = ToolRecord(steps, executions(mesh.logs("orchestrator")))
        rows = tabulate(injections, record.answers, record.failures, messages, tools)
        return SuiteResult(rows, injections, len(load.record.answers), time.monotonic() - began)

    def _one(self, fault: Fault, earlier: int, probe_user: str, probe_chat: str) -> Injection:
        mesh, settings = self.mesh, self.settings
        target = target_of(mesh, fault, earlier)
        old_pid = mesh.pid(target)
        injection = inject(mesh, fault, target, settings.timing, self.wait)
        deadline = injection.over_at + settings.recover_timeout_s
        while time.monotonic() < deadline and not back(mesh, injection, old_pid):
            self.wait(TICK_S)
        left = deadline - time.monotonic()
        if left > 0 and self._probe(probe_user, probe_chat, left):
            injection.recover_s = round(time.monotonic() - injection.over_at, 2)
        self.echo(
            f"  {fault.kind:<18} -> {target:<15} recovered in "
            f"{'-' if injection.recover_s is None else f'{injection.recover_s:.1f}s'}"
        )
        return injection

    def _probe_user(self) -> tuple[str, str]:
        async def create() -> str:
            async with http_client(self.mesh.url) as http:
                return await self._chat_user(http, "chaos-probe").create_chat()

        return "chaos-probe", in_thread(create())

    def _chat_user(self, http: httpx.AsyncClient, name: str, deadline_s: float = 60.0) -> ChatUser:
        return ChatUser(http, name, self.mesh.keys.mint(name, "enterprise"), 4, deadline_s)

    def _probe(self, name: str, chat_id: str, deadline_s: float) -> bool:
        """Whether a short answer through the door completes within ``deadline_s`` (the supervisor is
        not ticked meanwhile: what the probe needs is up already)."""

        async def probe() -> bool:
            deadline = time.monotonic() + deadline_s
            async with http_client(self.mesh.url) as http:
                while (left := deadline - time.monotonic()) > 0:
                    if (await self._chat_user(http, name, left).answer(chat_id, "probe")).completed:
                        return True
                    await asyncio.sleep(0.5)
            return False

        return in_thread(probe())
