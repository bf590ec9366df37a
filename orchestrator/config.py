"""The orchestrator's configuration: one dataclass per concern, filled from ``python -m orchestrator`` flags.

Every flag has a ``CHATMESH_ORCHESTRATOR_<FLAG>`` environment default (``meshkit.config.ServiceArgs``);
the Cassandra flags are memory_store's own (``memory_store.config.add_store_flags``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import socket
from dataclasses import dataclass, field

from chatmesh.limits import Limits
from chatmesh.tiers import TIERS
from memory_store.config import StoreConfig, add_store_flags
from meshkit.config import ServiceArgs

DEFAULT_SYSTEM_PROMPT = "You are a helpful, honest assistant. Answer clearly and concisely."


@dataclass(frozen=True)
class BudgetConfig:
    """Tokens (prompt + completion) each tier may use per window (0 means unlimited), and the runs of
    one user each tier may have at once on one replica."""

    window_s: int = 86_400
    tokens: dict[str, int] = field(
        default_factory=lambda: {"free": 100_000, "pro": 2_000_000, "enterprise": 0}
    )
    concurrent_runs: dict[str, int] = field(default_factory=lambda: {"free": 2, "pro": 4, "enterprise": 16})


@dataclass(frozen=True)
class PromptConfig:
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    # The model's context window used for prompts; 0 takes it from the model file.
    context_window: int = 0
    # Newest messages of a branch read for a prompt (older turns live in the summary).
    max_history_messages: int = 400


@dataclass(frozen=True)
class SummaryConfig:
    """Rolling summaries and titles, generated in the background at low priority."""

    enabled: bool = True
    # Refresh the summary when the verbatim history after it exceeds this share of the prompt budget.
    trigger_fraction: float = 0.6
    # A refreshed summary leaves about this share of the prompt budget as verbatim newest turns.
    keep_fraction: float = 0.3
    max_tokens: int = 192
    titles: bool = True
    title_max_tokens: int = 24
    # Background generations at once, and queued ones; beyond that new jobs are dropped (and counted).
    concurrency: int = 2
    queue: int = 256
    timeout_s: float = 120.0


@dataclass(frozen=True)
class RunConfig:
    # Checkpoint partial output every this many events or this many milliseconds, whichever comes first.
    checkpoint_events: int = 32
    checkpoint_interval_ms: int = 500
    heartbeat_interval_s: float = 3.0
    # A replica silent this long has its in-progress runs marked interrupted by another replica.
    orphan_after_s: float = 15.0
    reap_interval_s: float = 5.0
    # Deadline of one generation through the router.
    max_run_s: float = 600.0
    # Time the router gets to admit and place a request before the send fails.
    placement_timeout_s: float = 30.0
    # How long a cancel waits for the router's final frame before abandoning the stream.
    cancel_timeout_s: float = 5.0
    max_subscribers_per_run: int = 64
    # A finished run stays in memory this long for fast replays, then replays come from Cassandra.
    finished_ttl_s: float = 30.0
    # Replicas that do not own a run follow its checkpoints this often.
    follow_poll_ms: int = 200
    # Every Cassandra call of a send has this deadline on top of the driver's own request timeout.
    store_deadline_s: float = 10.0
    # Sends waiting for the same idempotency key on other replicas look for its run this long.
    claim_wait_s: float = 5.0


@dataclass(frozen=True)
class ModerationConfig:
    enabled: bool = True
    # Extra terms (case-insensitive, whole words) blocked in input and output, e.g. a site's blocklist.
    blocked_terms: tuple[str, ...] = ()
    # Prompt-injection markers are logged and counted; with this they are refused.
    block_injection: bool = False


@dataclass(frozen=True)
class OrchestratorConfig:
    replica_id: str
    router: str = "127.0.0.1:50051"
    router_timeout_s: float = 5.0
    model_file: str = ""
    # Model used when a request names none; empty: the model of the tokenizer.
    default_model: str = ""
    store: StoreConfig = field(default_factory=StoreConfig)
    limits: Limits = field(default_factory=Limits)
    budgets: BudgetConfig = field(default_factory=BudgetConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    summaries: SummaryConfig = field(default_factory=SummaryConfig)
    runs: RunConfig = field(default_factory=RunConfig)
    moderation: ModerationConfig = field(default_factory=ModerationConfig)


def default_replica_id() -> str:
    """Unique per process: a restarted replica is a new one (its predecessor's runs get reaped)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def add_flags(args: ServiceArgs) -> None:
    budgets, prompt = BudgetConfig(), PromptConfig()
    summaries, runs = SummaryConfig(), RunConfig()
    args.add_server_flags(port=50050)
    args.add("router", "127.0.0.1:50051", "router address host:port")
    args.add("router-timeout-s", 5.0, "deadline of unary router calls (ListEngines)")
    args.add("replica-id", "", "this replica's id in run ownership and heartbeats (default: host-pid-random)")
    add_store_flags(args)
    args.add(
        "model-file", "", "GGUF whose tokenizer and chat template prompts use (default: the bundled model)"
    )
    args.add("default-model", "", "model for requests that name none (default: the tokenizer's model)")
    args.add("system-prompt", prompt.system_prompt, "system prompt of stored chats")
    args.add("context-window", prompt.context_window, "context window in tokens (0: the model's)")
    args.add(
        "max-history-messages", prompt.max_history_messages, "newest messages of a branch read per prompt"
    )
    for setting in dataclasses.fields(Limits):
        if "help" in setting.metadata:
            args.add(setting.name.replace("_", "-"), setting.default, setting.metadata["help"])
    for tier in TIERS:
        args.add(f"concurrent-runs-{tier}", budgets.concurrent_runs[tier], f"runs at once per {tier} user")
        args.add(f"budget-{tier}-tokens", budgets.tokens[tier], f"{tier} tokens per window (0: unlimited)")
    args.add("budget-window-s", budgets.window_s, "length of a token budget window (aligned to the epoch)")
    args.add("summaries", summaries.enabled, "keep rolling summaries of long chats")
    args.add(
        "summary-trigger-fraction", summaries.trigger_fraction, "refresh when history exceeds this share"
    )
    args.add("summary-keep-fraction", summaries.keep_fraction, "share of the budget kept verbatim")
    args.add("summary-max-tokens", summaries.max_tokens, "length of a summary")
    args.add("titles", summaries.titles, "generate chat titles after the first exchange")
    args.add("background-concurrency", summaries.concurrency, "summaries and titles generated at once")
    args.add("checkpoint-events", runs.checkpoint_events, "checkpoint partial output every N events")
    args.add("checkpoint-interval-ms", runs.checkpoint_interval_ms, "... or every N milliseconds")
    args.add("heartbeat-interval-s", runs.heartbeat_interval_s, "replica heartbeat period")
    args.add("orphan-after-s", runs.orphan_after_s, "a replica silent this long loses its runs")
    args.add("reap-interval-s", runs.reap_interval_s, "how often to look for orphaned runs")
    args.add("max-run-s", runs.max_run_s, "deadline of one generation")
    args.add("max-subscribers-per-run", runs.max_subscribers_per_run, "streams attached to one run")
    args.add("moderation", True, "check input and output with the rule-based moderation policy")
    args.add_list("moderation-blocked-term", [], "an extra blocked term (repeatable)")
    args.add("moderation-block-injection", False, "refuse prompt-injection markers instead of flagging")


def from_args(ns: argparse.Namespace) -> OrchestratorConfig:
    if ns.orphan_after_s < 3 * ns.heartbeat_interval_s:
        # Replicas would take each other's ordinary heartbeat gaps for deaths and interrupt live runs.
        raise argparse.ArgumentTypeError(
            f"--orphan-after-s ({ns.orphan_after_s}) must be at least 3 x --heartbeat-interval-s "
            f"({ns.heartbeat_interval_s}), the same on every replica"
        )
    limits = Limits(
        **{s.name: getattr(ns, s.name) for s in dataclasses.fields(Limits) if "help" in s.metadata}
    )
    store = dataclasses.replace(StoreConfig.from_args(ns), usage_window_s=ns.budget_window_s, limits=limits)
    return OrchestratorConfig(
        replica_id=ns.replica_id or default_replica_id(),
        router=ns.router,
        router_timeout_s=ns.router_timeout_s,
        model_file=ns.model_file,
        default_model=ns.default_model,
        store=store,
        limits=limits,
        budgets=BudgetConfig(
            window_s=ns.budget_window_s,
            tokens={tier: getattr(ns, f"budget_{tier}_tokens") for tier in TIERS},
            concurrent_runs={tier: getattr(ns, f"concurrent_runs_{tier}") for tier in TIERS},
        ),
        prompt=PromptConfig(
            system_prompt=ns.system_prompt,
            context_window=ns.context_window,
            max_history_messages=ns.max_history_messages,
        ),
        summaries=SummaryConfig(
            enabled=ns.summaries,
            trigger_fraction=ns.summary_trigger_fraction,
            keep_fraction=ns.summary_keep_fraction,
            max_tokens=ns.summary_max_tokens,
            titles=ns.titles,
            concurrency=ns.background_concurrency,
        ),
        runs=RunConfig(
            checkpoint_events=ns.checkpoint_events,
            checkpoint_interval_ms=ns.checkpoint_interval_ms,
            heartbeat_interval_s=ns.heartbeat_interval_s,
            orphan_after_s=ns.orphan_after_s,
            reap_interval_s=ns.reap_interval_s,
            max_run_s=ns.max_run_s,
            max_subscribers_per_run=ns.max_subscribers_per_run,
        ),
        moderation=ModerationConfig(
            enabled=ns.moderation,
            blocked_terms=tuple(ns.moderation_blocked_term),
            block_injection=ns.moderation_block_injection,
        ),
    )


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, OrchestratorConfig]:
    args = ServiceArgs("orchestrator", "Serves ChatService: chats, messages and streamed answers.")
    add_flags(args)
    ns = args.parse(argv)
    try:
        return ns, from_args(ns)
    except argparse.ArgumentTypeError as exc:
        args.parser.error(str(exc))
