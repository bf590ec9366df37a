"""The composition root: every part of an orchestrator replica, built by keyword from its config over the
store, router and models it was given (``build_orchestrator``), and what stopping it takes
(``Orchestrator.stop``). Nothing here starts anything (``Membership.join`` does, once the server is about
to serve); connecting, the gRPC services and serving are ``__main__``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chatmesh.limits import Generation
from chatmesh.tiers import TIERS
from memory_store.store import MemoryStore
from orchestrator.config import OrchestratorConfig
from orchestrator.membership import Membership
from orchestrator.policy.admission import Budgets, RunSlots
from orchestrator.policy.moderation import create_moderator
from orchestrator.prompting.models import Models, ModelSpec
from orchestrator.router_client import RouterClient
from orchestrator.runs.checkpoints import CheckpointWriter
from orchestrator.runs.context import RunContext
from orchestrator.runs.late_ends import LateEnds
from orchestrator.runs.lifecycle import Runs
from orchestrator.runs.relay import RelayDeps, usage_settled_after_s
from orchestrator.tools.toolbox import Toolbox, builtin_tools
from orchestrator.upkeep.after_runs import Upkeep
from orchestrator.upkeep.jobs import BackgroundJobs
from orchestrator.upkeep.summaries import Summarizer
from orchestrator.upkeep.titles import Titler

if TYPE_CHECKING:
    from orchestrator.tools.mcp_servers import McpServers


@dataclass(frozen=True)
class Orchestrator:
    """A replica's parts, wired together: what its calls use, and what keeps its runs."""

    ctx: RunContext
    budgets: Budgets
    checkpoints: CheckpointWriter
    jobs: BackgroundJobs
    membership: Membership
    # The MCP servers whose tools answers may call (None: none configured, or --tools off); their
    # connections start with ``McpServers.start``.
    mcp: McpServers | None = None

    async def stop(self) -> None:
        """After the drain (or without one): the runs it left are handed over, the last checkpoints and
        background jobs end, the MCP servers' connections close, and the replica leaves its group."""
        handed_over = await self.ctx.runs.drain.shutdown(0.0)
        if self.mcp is not None:
            await self.mcp.stop()
        await self.checkpoints.close()
        await self.jobs.close()
        await self.membership.leave(handed_over)


def build_orchestrator(
    config: OrchestratorConfig, *, store: MemoryStore, router: RouterClient, specs: Sequence[ModelSpec]
) -> Orchestrator:
    """The replica's parts over its store, router and models. Titles and summaries are written by the
    default model (a chat model)."""
    runs_config, summary_config = config.runs, config.summaries
    models = Models.over(store=store, specs=specs, config=config.prompt, default=config.default_model)
    writer = models.get(models.default)
    checkpoints = CheckpointWriter(
        store=store,
        every_events=runs_config.checkpoint_events,
        interval_s=runs_config.checkpoint_interval_ms / 1000,
        deadline_s=runs_config.store_deadline_s,
    )
    late_ends = LateEnds(store=store, deadline_s=runs_config.store_deadline_s)
    budgets = Budgets(store=store, config=config.budgets, settled_after_s=usage_settled_after_s(runs_config))
    tools = config.tools
    mcp = mcp_servers(config) if tools.enabled and tools.mcp_servers else None
    deps = RelayDeps(
        store=store,
        moderator=create_moderator(config.moderation),
        config=runs_config,
        router=router,
        checkpoints=checkpoints,
        late_ends=late_ends,
        toolbox=Toolbox(config=tools, tools=builtin_tools(store), tiers=TIERS, mcp=mcp)
        if tools.enabled
        else None,
        models=models,
        budgets=budgets,
    )
    runs = Runs(
        store=store,
        router=router,
        deps=deps,
        budgets=budgets,
        slots=RunSlots(limits=config.budgets.concurrent_runs),
    )
    jobs = BackgroundJobs(
        concurrency=summary_config.concurrency,
        queue=summary_config.queue,
        timeout_s=summary_config.timeout_s,
    )
    titler = Titler(
        store=store,
        router=router,
        tokenizer=writer.tokenizer,
        generation=background_generation(writer.name, summary_config.title_max_tokens),
        deadline_s=summary_config.timeout_s,
    )
    summarizer = Summarizer(
        store=store,
        router=router,
        tokenizer=writer.tokenizer,
        config=summary_config,
        generation=background_generation(writer.name, summary_config.max_tokens),
        prompt_budget=writer.context_window - summary_config.max_tokens,
        max_history_messages=config.prompt.max_history_messages,
        deadline_s=summary_config.timeout_s,
    )
    upkeep = Upkeep(
        jobs=jobs,
        titler=titler if summary_config.titles else None,
        summarizer=summarizer if summary_config.enabled else None,
    )
    ctx = RunContext(
        config=config, store=store, runs=runs, models=models, moderator=deps.moderator, upkeep=upkeep
    )
    membership = Membership(
        replica_id=config.replica_id,
        group=config.replica_group,
        store=store,
        runs=runs,
        late_ends=late_ends,
        config=runs_config,
    )
    return Orchestrator(
        ctx=ctx, budgets=budgets, checkpoints=checkpoints, jobs=jobs, membership=membership, mcp=mcp
    )


def mcp_servers(config: OrchestratorConfig) -> McpServers:
    """The MCP servers of ``--mcp-server``, not yet connected. Imported here only: the SDK takes seconds
    to import, which a replica without MCP servers never pays."""
    from orchestrator.tools.mcp_servers import McpServer, McpServers

    tools = config.tools
    return McpServers(
        [
            McpServer(name, url, tools.mcp_credentials_dir, tools.mcp_refresh_s, tools.timeout_s)
            for name, url in tools.mcp_servers
        ]
    )


def background_generation(model: str, max_tokens: int) -> Generation:
    """A title's or summary's generation: greedy (the same chat gets the same title), no stop strings."""
    return Generation(model=model, max_tokens=max_tokens, temperature=0.0, top_p=0.0, seed=None, stop=())
