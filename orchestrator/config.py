"""The orchestrator's configuration: one dataclass per concern, whose settings are the
``python -m orchestrator`` flags (meshkit.config: each with a ``CHATMESH_ORCHESTRATOR_<FLAG>`` environment
default). The Cassandra flags are memory_store's own (``StoreConfig``); the request limits are
``chatmesh.limits.Limits``, set here and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import secrets
import socket
from dataclasses import dataclass

from chatmesh.identity import IdentityConfig
from chatmesh.limits import Limits
from chatmesh.tiers import TIERS
from memory_store.config import StoreConfig
from meshkit.config import ServiceArgs, nested, setting

DEFAULT_SYSTEM_PROMPT = "You are a helpful, honest assistant. Answer clearly and concisely."


def _model_budgets(specs: list[str]) -> tuple[tuple[str, str, int], ...]:
    """``--model-budget MODEL:TIER=TOKENS`` flags as (model, tier, tokens)."""
    budgets = []
    for spec in specs:
        head, sep, tokens = spec.rpartition("=")
        model, colon, tier = head.rpartition(":")
        if not sep or not colon or not model or tier not in TIERS or not tokens.strip().isdigit():
            raise ValueError(
                f"--model-budget must look like MODEL:TIER=TOKENS with a tier of {', '.join(TIERS)} and "
                f"tokens >= 0, got {spec!r}"
            )
        budgets.append((model, tier, int(tokens)))
    if len({(model, tier) for model, tier, _ in budgets}) != len(budgets):
        raise ValueError("--model-budget names each model and tier once")
    return tuple(budgets)


@dataclass(frozen=True)
class BudgetConfig:
    """Tokens (prompt + completion) each tier may use per window (0 means unlimited), per model where
    ``--model-budget`` says so, and the runs of one user each tier may have at once on one replica."""

    window_s: int = setting(
        86_400, "length of a token budget window (aligned to the epoch)", flag="budget-window-s"
    )
    tokens: dict[str, int] = setting(
        default_factory=lambda: {"free": 100_000, "pro": 2_000_000, "enterprise": 0},
        help="{key} tokens per window (0: unlimited)",
        flag="budget-{key}-tokens",
        per=TIERS,
    )
    # A model's own budget for a tier: a larger model may be given a lower ceiling than its tier's.
    per_model: tuple[tuple[str, str, int], ...] = setting(
        (),
        "MODEL:TIER=TOKENS: TIER users' requests to MODEL are admitted while their window's usage (every "
        "model's tokens) has room under TOKENS instead of the tier's budget (repeatable; 0: unlimited)",
        flag="model-budget",
        flag_default=[],
        parse=_model_budgets,
        repeat=True,
    )
    concurrent_runs: dict[str, int] = setting(
        default_factory=lambda: {"free": 2, "pro": 4, "enterprise": 16},
        help="runs at once per {key} user",
        flag="concurrent-runs-{key}",
        per=TIERS,
    )


@dataclass(frozen=True)
class PromptConfig:
    system_prompt: str = setting(DEFAULT_SYSTEM_PROMPT, "system prompt of stored chats")
    # The model's context window used for prompts; 0 takes it from the model file.
    context_window: int = setting(0, "context window in tokens (0: the model's)")
    # Newest messages of a branch read for a prompt (older turns live in the summary).
    max_history_messages: int = setting(400, "newest messages of a branch read per prompt")
    # A history that does not fit is cut in steps of this share of the prompt budget, so the prompt's
    # start (and the engine's cached prefix) holds for many turns; 0 drops the oldest turn each turn.
    truncation_step: float = setting(0.35, "cut an overlong history in steps of this share of the budget")
    # A chat's prompt is assembled again at every send from messages that never change: the ids of the
    # texts of recent prompts are kept (4 bytes a token, and the text), least recently used dropped.
    encoded_cache_tokens: int = setting(
        2_000_000, "token ids of recent prompts' texts kept for the next assembly, per tokenizer (0: none)"
    )

    def __post_init__(self) -> None:
        if not 0 <= self.truncation_step < 1:
            raise ValueError(f"--truncation-step ({self.truncation_step}) must be at least 0 and below 1")
        if self.encoded_cache_tokens < 0:
            raise ValueError(f"--encoded-cache-tokens ({self.encoded_cache_tokens}) must not be negative")


@dataclass(frozen=True)
class SummaryConfig:
    """Rolling summaries and titles, generated in the background at low priority."""

    enabled: bool = setting(True, "keep rolling summaries of long chats", flag="summaries")
    # Refresh the summary when the verbatim history after it exceeds this share of the prompt budget.
    trigger_fraction: float = setting(
        0.75, "refresh when history exceeds this share", flag="summary-trigger-fraction"
    )
    # A refreshed summary leaves about this share of the prompt budget as verbatim newest turns. A new
    # summary changes the prompt from the system message on (nothing after it is cached any more), so
    # the gap between the two fractions is how far a chat grows between such breaks
    # (bench/bench_prefix_stability.py: 0.6/0.3 → 0.75/0.25 took a long chat's hit rate 0.80 → 0.85).
    keep_fraction: float = setting(0.25, "share of the budget kept verbatim", flag="summary-keep-fraction")
    max_tokens: int = setting(192, "length of a summary", flag="summary-max-tokens")
    titles: bool = setting(True, "generate chat titles after the first exchange")
    title_max_tokens: int = 24
    # Background generations at once, and queued ones; beyond that new jobs are dropped (and counted).
    concurrency: int = setting(2, "summaries and titles generated at once", flag="background-concurrency")
    queue: int = 256
    timeout_s: float = 120.0


def _mcp_servers(specs: list[str]) -> tuple[tuple[str, str], ...]:
    """``--mcp-server NAME=URL`` flags as (name, url)."""
    servers = []
    for spec in specs:
        name, sep, url = spec.partition("=")
        if (
            not sep
            or not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,31}", name)
            or not url.startswith(("http://", "https://"))
        ):
            raise ValueError(
                "--mcp-server must look like NAME=URL with NAME of lowercase letters, digits, '-' and '_' "
                f"(at most 32) and an http:// or https:// URL, got {spec!r}"
            )
        servers.append((name, url))
    if len({name for name, _ in servers}) != len(servers):
        raise ValueError("--mcp-server names each server once")
    return tuple(servers)


@dataclass(frozen=True)
class ToolConfig:
    """The tools the orchestrator runs itself in stored chats (docs/tools.md)."""

    enabled: bool = setting(
        False, "let stored chats' answers call the orchestrator's own tools", flag="tools"
    )
    # Comma-separated tool names per tier (an MCP server's as SERVER.TOOL, or SERVER.* for all of them);
    # a tool not listed is neither described to the model nor run.
    allowed: dict[str, str] = setting(
        default_factory=lambda: {
            "free": "calculator,clock",
            "pro": "calculator,clock,search_chats",
            "enterprise": "calculator,clock,search_chats",
        },
        help="tools a {key} user's answers may call (comma-separated)",
        flag="tools-{key}",
        per=TIERS,
    )
    timeout_s: float = setting(
        5.0, "a tool call taking longer is cancelled (the model sees a timeout)", flag="tool-timeout-s"
    )
    max_steps: int = setting(
        4, "tool steps one answer may take; then it answers in text", flag="tool-max-steps"
    )
    max_result_chars: int = setting(
        4000, "a tool result longer than this is cut (and says so)", flag="tool-max-result-chars"
    )

    # MCP servers (docs/tools.md, "MCP servers"): their tools are offered as SERVER.TOOL where a tier's
    # list names them.
    mcp_servers: tuple[tuple[str, str], ...] = setting(
        (),
        "an MCP server whose tools answers may call, as NAME=URL (streamable HTTP); its tools are "
        "NAME.TOOL in the --tools-TIER lists (repeatable)",
        flag="mcp-server",
        flag_default=[],
        parse=_mcp_servers,
        repeat=True,
    )
    mcp_credentials_dir: str = setting(
        "",
        "a directory (a mounted Secret) with NAME.token, a bearer token, and NAME.headers, 'Header: value' "
        "lines, sent to MCP server NAME; read at each connection",
        flag="mcp-credentials-dir",
    )
    mcp_refresh_s: float = setting(
        30.0,
        "how often each MCP server's tool list is fetched again (a server down is retried sooner)",
        flag="mcp-refresh-s",
    )

    def allowed_for(self, tier: str) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.allowed.get(tier, "").split(",") if name.strip())

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.max_steps < 1 or self.max_result_chars < 64 or self.mcp_refresh_s <= 0:
            raise ValueError(
                "--tool-timeout-s and --mcp-refresh-s must be positive, --tool-max-steps at least 1 and "
                "--tool-max-result-chars at least 64"
            )


# A start lease is one replica's clock read by another's, and a write sent as its deadline passed may
# still land (within Cassandra's own write timeout, 2 s by default): what a start lease leaves beyond
# the deadlines of its holder's steps.
LEASE_SKEW_S = 5.0


@dataclass(frozen=True)
class RunConfig:
    # Checkpoint partial output every this many events or this many milliseconds, whichever comes first.
    checkpoint_events: int = setting(32, "checkpoint partial output every N events")
    checkpoint_interval_ms: int = setting(500, "... or every N milliseconds")
    heartbeat_interval_s: float = setting(3.0, "replica heartbeat period")
    # A replica silent this long has its in-progress runs adopted (and continued) by another replica.
    orphan_after_s: float = setting(15.0, "a replica silent this long loses its runs")
    reap_interval_s: float = setting(5.0, "how often to look for orphaned runs")
    # Deadline of one generation through the router.
    max_run_s: float = setting(600.0, "deadline of one generation")
    # Time the router gets to admit and place a request before the send fails.
    placement_timeout_s: float = 30.0
    # How long a cancel waits for the router's final frame before abandoning the stream.
    cancel_timeout_s: float = 5.0
    max_subscribers_per_run: int = setting(64, "streams attached to one run")
    # While this replica's event loop runs late, a stream's deltas gather up to this long and leave as
    # one event (meshkit.pacing); while it keeps up, each leaves as it is made.
    stream_interval_max_ms: int = setting(100, "longest a stream's deltas gather under load (0: never)")
    # A finished run stays in memory this long for fast replays, then replays come from Cassandra.
    finished_ttl_s: float = 30.0
    # Replicas that do not own a run follow its checkpoints this often.
    follow_poll_ms: int = 200
    # Every Cassandra call of a send has this deadline on top of the driver's own request timeout.
    store_deadline_s: float = 10.0
    # Storing a run's end is retried this long before its clients are told it failed; the replica then
    # keeps trying in the background until it lands (runs/late_ends.py).
    finish_retry_s: float = setting(120.0, "how long a run's end is retried before its streams fail")

    @property
    def create_run_s(self) -> float:
        """The longest a run's creation takes (memory_store's ``create_run``): its logged batch, and when
        that fails, the ordered fallback's two writes, one after the other, each within the store
        deadline."""
        return 3 * self.store_deadline_s

    @property
    def start_lease_s(self) -> float:
        """How long the attempt that claimed an idempotency key may take to start its run: retries of the
        key on other replicas wait for that run meanwhile. Its steps, each within its deadline: the claim
        and the reads beside it, the placement with the budget's read and write beside it, the run's
        creation; and LEASE_SKEW_S. With the defaults: 10 + max(30, 2 x 10) + 3 x 10 + 5 = 75 s. The
        holder begins the run's creation only with ``create_run_s`` + LEASE_SKEW_S of it left
        (``ChatRun.create_run``), so the run is written before the lease can pass to another attempt."""
        placement_s = max(self.placement_timeout_s, 2 * self.store_deadline_s)
        return self.store_deadline_s + placement_s + self.create_run_s + LEASE_SKEW_S

    def __post_init__(self) -> None:
        if self.orphan_after_s < 3 * self.heartbeat_interval_s:
            # Replicas would take each other's ordinary heartbeat gaps for deaths and interrupt live runs.
            raise ValueError(
                f"--orphan-after-s ({self.orphan_after_s}) must be at least 3 x --heartbeat-interval-s "
                f"({self.heartbeat_interval_s}), the same on every replica"
            )


@dataclass(frozen=True)
class ModerationConfig:
    enabled: bool = setting(
        True, "check input and output with the rule-based moderation policy", flag="moderation"
    )
    # Extra terms (case-insensitive, whole words) blocked in input and output, e.g. a site's blocklist.
    blocked_terms: tuple[str, ...] = setting(
        (),
        "an extra blocked term (repeatable)",
        flag="moderation-blocked-term",
        flag_default=[],
        parse=tuple,
        repeat=True,
    )
    # Prompt-injection markers are logged and counted; with this they are refused.
    block_injection: bool = setting(
        False, "refuse prompt-injection markers instead of flagging", flag="moderation-block-injection"
    )


def _replica_id(flag: str) -> str:
    """Unique per process unless set: a restarted replica is a new one (its predecessor's runs get reaped)."""
    return flag or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class OrchestratorConfig:
    replica_id: str = setting(
        "",
        "this replica's id in run ownership and heartbeats (default: host-pid-random)",
        parse=_replica_id,
    )
    router: str = setting(
        "127.0.0.1:50051", "router address host:port, several as ip:port,ip:port, or dns:///name:port"
    )
    # Replicas adopt the runs of lost replicas of their own group only: one group per deployment (per
    # router pool), so two deployments sharing a keyspace never continue each other's answers.
    replica_group: str = setting("orchestrator", "the replicas that adopt each other's runs (one deployment)")
    router_timeout_s: float = setting(5.0, "deadline of unary router calls (ListEngines)")
    # One per served model: the models requests may name are these files' (a request naming another is
    # refused before anything is stored). NAME=PATH serves the file under another name (a pool of the
    # same weights an engine serves with --served-model-name).
    model_files: tuple[str, ...] = setting(
        (),
        "a served model's GGUF file or Hugging Face directory, as PATH or NAME=PATH, whose tokenizer, "
        "chat template and context window its prompts use (repeatable; none: the bundled model)",
        flag="model-file",
        flag_default=[],
        parse=tuple,
        repeat=True,
    )
    # Model used when a request names none; empty: the first model file's with a chat template.
    default_model: str = setting("", "model for requests that name none; empty: the first chat model")
    store: StoreConfig = nested(StoreConfig)
    limits: Limits = nested(Limits)
    budgets: BudgetConfig = nested(BudgetConfig)
    prompt: PromptConfig = nested(PromptConfig)
    summaries: SummaryConfig = nested(SummaryConfig)
    runs: RunConfig = nested(RunConfig)
    moderation: ModerationConfig = nested(ModerationConfig)
    tools: ToolConfig = nested(ToolConfig)
    identity: IdentityConfig = nested(IdentityConfig)

    def __post_init__(self) -> None:
        if self.store.request_timeout_s > self.runs.store_deadline_s:
            # A request could outlast the deadline its step is given, and land after a start lease
            # (RunConfig.start_lease_s) passed on.
            raise ValueError(
                f"--cassandra-timeout-s ({self.store.request_timeout_s}) must be at most the store "
                f"deadline of a send's steps ({self.runs.store_deadline_s} s)"
            )
        # The store checks writes against the same limits, and counts usage in the same windows.
        store = dataclasses.replace(self.store, limits=self.limits, usage_window_s=self.budgets.window_s)
        object.__setattr__(self, "store", store)


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, OrchestratorConfig]:
    args = ServiceArgs("orchestrator", "Serves ChatService: chats, messages and streamed answers.")
    args.add_server_flags(port=50050)
    args.add_config(OrchestratorConfig)
    return args.config(OrchestratorConfig, argv)
