"""Tools from MCP servers (docs/tools.md, "MCP servers"), against real MCP servers the tests start as
processes (``mcp_tool_server.py``, the SDK's own server, streamable HTTP on a port of its own): the
orchestrator's connections in this process (listing, calls, failures, the allow-lists, a server down
and back), then whole orchestrator processes over a null engine whose text is scripted to be a call
of the server's ``record`` tool (as in test_tool_steps.py): the call is a stored step, run once, with
its idempotency key and the bearer token from the credentials directory, and the answer goes on
after it; a hanging call is a timeout the model reads; a server down at start stops nothing."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.tool_format import ToolCall
from meshkit.launcher import Launcher, ServiceSpec, TcpOpen, free_port
from orchestrator.config import ToolConfig
from orchestrator.metrics import METRICS
from orchestrator.tools.mcp_servers import McpServer, McpServers
from orchestrator.tools.toolbox import Toolbox, builtin_tools
from tests.fixtures.engines import ROOT
from tests.fixtures.orchestrator import (
    ChatClient,
    Mesh,
    MeshFactory,
    OrchestratorProcess,
    collect,
    events,
    kinds,
)
from tests.fixtures.tool_calls import aligned_question, system_with
from tests.orchestrator.mcp_tool_server import RECORD_DESCRIPTION

TIERS = ("free", "pro", "enterprise")
TOKEN = "s3cret-token"
CALL = '<tool_call>{"name": "srv.record", "arguments": {"text": "milk"}}</tool_call>'
OPTIONS = chat_pb2.GenerationOptions(max_tokens=48, temperature=0.0)


@dataclass
class McpToolServer:
    """One test MCP server process: where it listens and where it records its ``record`` calls."""

    name: str
    port: int
    calls: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def recorded(self) -> list[dict]:
        if not self.calls.exists():
            return []
        return [json.loads(line) for line in self.calls.read_text().splitlines()]


class McpServerProcesses:
    def __init__(self, launcher: Launcher, folder: Path) -> None:
        self.launcher = launcher
        self.folder = folder
        self._count = 0

    def start(self, port: int | None = None, delay_s: float = 0.0) -> McpToolServer:
        """A server on ``port`` (default: a free one) whose ``record`` answers after ``delay_s``."""
        self._count += 1
        name = f"mcp-tools-{self._count}"
        server = McpToolServer(name, port or free_port(), self.folder / f"{name}.calls")
        argv = [sys.executable, "-m", "tests.orchestrator.mcp_tool_server", "--port", str(server.port)]
        argv += ["--calls", str(server.calls), "--delay-s", str(delay_s)]
        spec = ServiceSpec(name=name, argv=argv, ports=(server.port,), ready=TcpOpen(server.port), cwd=ROOT)
        self.launcher.start(spec)
        return server

    def stop(self, server: McpToolServer) -> None:
        self.launcher.stop(server.name)


@pytest.fixture(scope="module")
def mcp_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpServerProcesses]:
    folder = tmp_path_factory.mktemp("mcp")
    with Launcher(folder) as launcher:
        yield McpServerProcesses(launcher, folder)


@pytest.fixture(scope="module")
def mcp_server(mcp_processes: McpServerProcesses) -> McpToolServer:
    return mcp_processes.start()


@pytest.fixture(scope="module")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A credentials directory as the chart mounts the Secret: srv.token and srv.headers."""
    folder = tmp_path_factory.mktemp("mcp-credentials")
    (folder / "srv.token").write_text(f"{TOKEN}\n")
    (folder / "srv.headers").write_text("X-Tenant: acme\n")
    return folder


def _config(**changes: object) -> ToolConfig:
    settings: dict = {
        "enabled": True,
        "allowed": {"free": "calculator", "pro": "calculator,srv.*", "enterprise": "srv.record"},
        "mcp_refresh_s": 0.5,
    }
    return ToolConfig(**(settings | changes))


@contextlib.asynccontextmanager
async def connected(
    config: ToolConfig, url: str, credentials_dir: Path | None = None, wait: bool = True
) -> AsyncIterator[Toolbox]:
    """A toolbox over the MCP server ``srv`` at ``url``, its connection kept in this process; with
    ``wait``, once it has listed its tools."""
    server = McpServer("srv", url, str(credentials_dir or ""), config.mcp_refresh_s, config.timeout_s)
    mcp = McpServers([server])
    mcp.start()
    try:
        if wait:
            await until(lambda: bool(server.tools), "the MCP server's tools")
        yield Toolbox(config, builtin_tools(None), TIERS, mcp)  # type: ignore[arg-type]  # search unused
    finally:
        await mcp.stop()


async def until(condition: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    """Waits until ``condition()`` (or what it awaits to) is true: a state of another process, or of a
    connection's task."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        assert asyncio.get_running_loop().time() < deadline, f"waited {timeout_s} s for {what}"
        await asyncio.sleep(0.1)


def _call(name: str, call_id: str = "call_1", **arguments: object) -> ToolCall:
    return ToolCall(call_id, name, json.dumps(arguments))


def _offered(toolbox: Toolbox, tier: str) -> list[str]:
    tools = toolbox.tools_for(tier, 0)
    return [f.name for f in tools.functions] if tools is not None else []


# -- the connections, in this process ----------------------------------------------------------


async def test_a_servers_tools_are_offered_by_name_and_a_call_runs_once_with_its_key_and_token(
    mcp_server: McpToolServer, credentials: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with connected(_config(), mcp_server.url, credentials) as toolbox:
        # srv.odd (its schema does not compile) and srv.huge (over 8 KiB) are left out.
        assert _offered(toolbox, "pro") == ["calculator", "srv.record", "srv.fails", "srv.picture"]
        assert "tool 'odd' left out: its input schema does not compile" in caplog.text
        assert "tool 'huge' left out: its input schema is longer than 8192 characters" in caplog.text
        assert _offered(toolbox, "enterprise") == ["srv.record"]
        tools = toolbox.tools_for("pro", 0)
        assert tools is not None
        record = next(f for f in tools.functions if f.name == "srv.record")
        assert record.description == RECORD_DESCRIPTION and record.parameters is not None
        assert record.parameters["required"] == ["text"]
        assert METRICS.mcp_server_up.labels("srv")._value.get() == 1
        assert METRICS.mcp_server_tools.labels("srv")._value.get() == 3

        before = len(mcp_server.recorded())
        ok = METRICS.tool_calls.labels("srv.record", "ok")._value.get()
        result = await toolbox.run("u1", "pro", _call("srv.record", "call_once", text="eggs"))
        assert (result.outcome, result.text) == ("ok", "recorded 'eggs'")
        assert mcp_server.recorded()[before:] == [
            {"text": "eggs", "key": "call_once", "authorization": f"Bearer {TOKEN}"}
        ]
        assert METRICS.tool_calls.labels("srv.record", "ok")._value.get() == ok + 1


async def test_a_failing_tool_and_a_result_that_is_not_text_are_results_the_model_reads(
    mcp_server: McpToolServer,
) -> None:
    async with connected(_config(), mcp_server.url) as toolbox:
        failed = await toolbox.run("u1", "pro", _call("srv.fails"))
        # The server's own words (its SDK prefixes them).
        assert failed.outcome == "error" and failed.text.startswith("Error: ")
        assert failed.text.endswith("the disk is full")
        picture = await toolbox.run("u1", "pro", _call("srv.picture"))
        assert picture.outcome == "ok"
        assert picture.text == "a red dot\n[image content left out: only text is read]"
        bad = await toolbox.run("u1", "pro", _call("srv.record", number=1))  # no "text"
        assert bad.outcome == "error" and "text" in bad.text


async def test_a_call_that_hangs_is_a_timeout_and_the_server_is_called_again_after_it(
    mcp_processes: McpServerProcesses,
) -> None:
    slow = mcp_processes.start(delay_s=4)
    try:
        async with connected(_config(timeout_s=1.0), slow.url) as toolbox:
            timed_out = await toolbox.run("u1", "pro", _call("srv.record", text="late"))
            assert (timed_out.outcome, timed_out.text) == ("timeout", "The tool did not answer within 1 s.")
            after = await toolbox.run("u1", "pro", _call("srv.fails"))
            assert after.outcome == "error" and "disk is full" in after.text
    finally:
        mcp_processes.stop(slow)


async def test_the_allow_lists_refuse_a_tool_to_a_tier_and_nothing_reaches_the_server(
    mcp_server: McpToolServer,
) -> None:
    async with connected(_config(), mcp_server.url) as toolbox:
        assert _offered(toolbox, "free") == ["calculator"]
        before = len(mcp_server.recorded())
        refused = await toolbox.run("u1", "free", _call("srv.record", text="free"))
        assert refused.outcome == "refused" and "no tool 'srv.record' you may call" in refused.text
        other = await toolbox.run("u1", "enterprise", _call("srv.fails"))  # enterprise: srv.record only
        assert other.outcome == "refused"
        assert len(mcp_server.recorded()) == before
    with pytest.raises(ValueError, match=r"unknown tools \['nosuch.record'\]"):
        Toolbox(_config(allowed={"free": "nosuch.record", "pro": "", "enterprise": ""}), {}, TIERS)


async def test_a_server_down_at_start_has_no_tools_until_it_answers_and_none_after_it_goes(
    mcp_processes: McpServerProcesses,
) -> None:
    port = free_port()
    async with connected(_config(), f"http://127.0.0.1:{port}/mcp", wait=False) as toolbox:
        await asyncio.sleep(1.0)
        assert _offered(toolbox, "pro") == ["calculator"]
        assert METRICS.mcp_server_up.labels("srv")._value.get() == 0
        absent = await toolbox.run("u1", "pro", _call("srv.record", text="x"))
        assert absent.outcome == "error" and "not available now" in absent.text

        server = mcp_processes.start(port=port)
        await until(lambda: "srv.record" in _offered(toolbox, "pro"), "the tools of the server once up")
        assert METRICS.mcp_server_up.labels("srv")._value.get() == 1
        assert (await toolbox.run("u1", "pro", _call("srv.record", text="up"))).outcome == "ok"

        mcp_processes.stop(server)
        # A call to a server gone since its last listing is a result too (never the caller's failure).
        gone = await toolbox.run("u1", "pro", _call("srv.record", text="gone"))
        assert gone.outcome in ("error", "timeout"), gone
        assert "127.0.0.1" not in gone.text  # never the transport's words (addresses) to the model
        await until(lambda: _offered(toolbox, "pro") == ["calculator"], "the tools gone with their server")
        assert METRICS.mcp_server_up.labels("srv")._value.get() == 0


# -- through orchestrator processes ------------------------------------------------------------


@pytest.fixture(scope="module")
def record_mesh(start_mesh: MeshFactory) -> Iterator[Mesh]:
    """A null engine whose every answer is a call of srv.record (no orchestrator of its own kept)."""
    mesh = start_mesh(1, "null", engine_flags={"null_tokens_per_s": 40, "null_text": CALL})
    mesh.stop_orchestrator(mesh.orchestrator)
    yield mesh
    for replica in list(mesh.orchestrators):
        mesh.stop_orchestrator(replica)


@pytest.fixture(scope="module")
async def record_question(mcp_server: McpToolServer) -> str:
    """A question whose answer is the call (the pro tier is offered srv.record alone)."""
    config = _config(allowed={"free": "", "pro": "srv.record", "enterprise": ""})
    async with connected(config, mcp_server.url) as toolbox:
        tools = toolbox.tools_for("pro", 0)
    assert tools is not None
    return aligned_question("Write milk down.", system_with(tools.system_text()), CALL)


def _replica_flags(server_url: str, **more: object) -> dict[str, object]:
    return {
        "tools": True,
        "tools_pro": "srv.record",
        "tool_max_steps": 1,
        "mcp_server": f"srv={server_url}",
        "mcp_refresh_s": 1,
        **more,
    }


async def _answer(replica: OrchestratorProcess, question: str, connect) -> list[chat_pb2.RunEvent]:
    client: ChatClient = connect(replica.address)
    chat = await client.create_chat("mcp")
    return await asyncio.wait_for(collect(client.send(chat.chat_id, question, options=OPTIONS)), 60)


async def _up(replica: OrchestratorProcess) -> float:
    return await replica.counted("chatmesh_orchestrator_mcp_server_up", suffix="", server="srv")


async def test_an_orchestrator_runs_an_mcp_tool_once_and_the_answer_goes_on_after_it(
    record_mesh: Mesh, mcp_server: McpToolServer, credentials: Path, record_question: str, connect
) -> None:
    flags = _replica_flags(mcp_server.url, mcp_credentials_dir=str(credentials))
    with record_mesh.replica(**flags) as replica:
        await until(lambda: _up(replica), "the replica's MCP server up")
        before = len(mcp_server.recorded())
        run = await _answer(replica, record_question, connect)

        seen = kinds(run)
        assert seen[:3] == ["started", "step_started", "step_result"] and seen[-2:] == ["usage", "done"], seen
        assert "delta" in seen[3:], "the answer goes on after the step"
        started, result = run[1].step_started, run[2].step_result
        assert (started.tool, started.arguments) == ("srv.record", '{"text": "milk"}')
        assert (result.outcome, result.text) == (chat_pb2.TOOL_OUTCOME_OK, "recorded 'milk'")
        # Run once, with the step's call id as its idempotency key and the token from the Secret's file.
        assert mcp_server.recorded()[before:] == [
            {"text": "milk", "key": started.call_id, "authorization": f"Bearer {TOKEN}"}
        ]
        assert await replica.counted("chatmesh_orchestrator_tool_calls", tool="srv.record", outcome="ok") == 1
        assert await _up(replica) == 1


async def test_an_mcp_call_that_hangs_is_a_timeout_the_model_reads(
    record_mesh: Mesh, mcp_processes: McpServerProcesses, record_question: str, connect
) -> None:
    slow = mcp_processes.start(delay_s=4)
    try:
        with record_mesh.replica(**_replica_flags(slow.url, tool_timeout_s=1)) as replica:
            await until(lambda: _up(replica), "the replica's MCP server up")
            run = await _answer(replica, record_question, connect)
            assert kinds(run)[:3] == ["started", "step_started", "step_result"]
            assert run[2].step_result.outcome == chat_pb2.TOOL_OUTCOME_TIMEOUT
            assert kinds(run)[-1] == "done" and "delta" in kinds(run)[3:]
    finally:
        mcp_processes.stop(slow)


async def test_an_orchestrator_whose_mcp_server_is_down_at_start_serves_and_takes_its_tools_later(
    record_mesh: Mesh, mcp_processes: McpServerProcesses, record_question: str, connect
) -> None:
    port = free_port()
    with record_mesh.replica(**_replica_flags(f"http://127.0.0.1:{port}/mcp")) as replica:
        # Serving: an answer with no tools offered (the call's text is only text then).
        plain = await _answer(replica, record_question, connect)
        assert "step_started" not in kinds(plain) and kinds(plain)[-1] == "done"
        assert await _up(replica) == 0

        server = mcp_processes.start(port=port)
        await until(lambda: _up(replica), "the MCP server up once it answers")
        run = await _answer(replica, record_question, connect)
        assert run[2].step_result.outcome == chat_pb2.TOOL_OUTCOME_OK
        assert [call["text"] for call in server.recorded()] == ["milk"]
    mcp_processes.stop(server)


async def test_a_replica_killed_during_an_mcp_call_leaves_the_step_to_another_which_never_calls_again(
    record_mesh: Mesh, mcp_processes: McpServerProcesses, record_question: str, connect
) -> None:
    """The call takes 10 s on the server; the replica that made it is killed (SIGKILL) once the server
    has it. The replica that adopts the run answers the step "interrupted" and never calls the server
    again: the server saw the call once."""
    slow = mcp_processes.start(delay_s=10)
    reaping = {"heartbeat_interval_s": 0.5, "orphan_after_s": 2.0, "reap_interval_s": 0.5}
    flags = _replica_flags(slow.url, tool_timeout_s=30, **reaping)
    try:
        with record_mesh.replica(**flags) as survivor:
            victim = record_mesh.start_orchestrator(**flags)
            await until(lambda: _up(victim), "the victim's MCP server up")
            await until(lambda: _up(survivor), "the survivor's MCP server up")
            on_victim: ChatClient = connect(victim.address)
            chat = await on_victim.create_chat("killed during a call")
            seen: list[chat_pb2.RunEvent] = []
            async for event in events(on_victim.send(chat.chat_id, record_question, options=OPTIONS)):
                seen.append(event)
                if event.HasField("step_started"):
                    break  # stored before the call
            await until(slow.recorded, "the call on the server")
            record_mesh.launcher.signal(victim.name, signal.SIGKILL)
            record_mesh.launcher.forget(victim.name)
            record_mesh.orchestrators.remove(victim)

            survivors = connect(survivor.address, on_victim.user)
            rest = await asyncio.wait_for(
                collect(survivors.stream_run(seen[0].started.run_id, seen[-1].seq)), 60
            )
            run = seen + rest
            assert [event.seq for event in run] == list(range(1, len(run) + 1)), "a gap or a duplicate"
            assert kinds(run)[1:3] == ["step_started", "step_result"] and kinds(run)[-1] == "done"
            assert run[2].step_result.outcome == chat_pb2.TOOL_OUTCOME_INTERRUPTED
            await asyncio.sleep(2)  # any call the survivor made would have arrived by now
            call = {"text": "milk", "key": run[1].step_started.call_id, "authorization": None}
            assert slow.recorded() == [call]
            # Its one count of the tool: the interrupted step.
            assert await survivor.counted("chatmesh_orchestrator_tool_calls", tool="srv.record") == 1
            assert (
                await survivor.counted("chatmesh_orchestrator_tool_calls", tool="srv.record", outcome="ok")
                == 0
            )
    finally:
        mcp_processes.stop(slow)
