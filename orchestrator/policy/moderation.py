"""Moderation: a pluggable policy, and the default rule-based one.

A policy looks at text and decides ALLOW, FLAG (let it through; log and count it) or BLOCK. Input is
checked before a prompt is assembled (a blocked message is refused with INVALID_ARGUMENT, reason
CONTENT_FILTER, and nothing is stored); output is checked as it streams (a block stops the run with
finish_reason CONTENT_FILTER; the text before the offending delta is kept).

What the rule-based policy catches, honestly: English phrasings close to the patterns below, and exact
PII formats. It does NOT understand meaning: paraphrases, other languages, misspellings, spacing
tricks or encodings pass; innocent text that happens to match is blocked. It is a floor that makes
decisions visible (logs, ``chatmesh_orchestrator_moderation_decisions_total``), not a safety
classifier: deploy a model-based ``ModerationPolicy`` where that matters. Prompt-injection markers are
flagged by default because the tokenizer already turns chat-template markup in user text into plain
text (``chatmesh.tokenizer``), so the markers cannot forge a turn; refusing them is an option.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import grpc

from chatmesh.errors import ServiceError
from orchestrator.config import ModerationConfig
from orchestrator.metrics import METRICS

log = logging.getLogger(__name__)


class Action(IntEnum):
    """Ordered by severity: a text's decision is its most severe rule's."""

    ALLOW = 0
    FLAG = 1
    BLOCK = 2


@dataclass(frozen=True)
class Decision:
    action: Action
    # e.g. "weapons", "prompt_injection", "pii.card"; empty when allowed.
    category: str = ""

    @property
    def blocked(self) -> bool:
        return self.action is Action.BLOCK


ALLOWED = Decision(Action.ALLOW)


class ModerationPolicy(Protocol):
    """Decides about user input and model output. Implementations must be fast and never raise."""

    # Lower-case strings of which every output match contains at least one (text holding none of them
    # is allowed without a check); None when the policy can say no such thing.
    output_anchors: tuple[str, ...] | None

    def check_input(self, text: str) -> Decision: ...

    def check_output(self, text: str) -> Decision: ...


@dataclass(frozen=True)
class Rule:
    category: str
    pattern: re.Pattern[str]
    on_input: Action
    on_output: Action
    # Lower-case strings of which every match contains at least one: a substring test far cheaper
    # than the pattern rules most text out before the pattern runs (output is checked per delta).
    anchors: tuple[str, ...] = ()
    # Confirms a match (e.g. a card number's Luhn checksum) to cut false positives.
    confirm: Callable[[str], bool] | None = None

    def matches(self, text: str, lowered: str) -> bool:
        if self.anchors and not any(anchor in lowered for anchor in self.anchors):
            return False
        for match in self.pattern.finditer(text):
            if self.confirm is None or self.confirm(match.group(0)):
                return True
        return False


def _luhn(candidate: str) -> bool:
    digits = [int(c) for c in candidate if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = 0
    for i, digit in enumerate(reversed(digits)):
        if i % 2:
            digit = digit * 2 - 9 if digit > 4 else digit * 2
        total += digit
    return total % 10 == 0


def _words(*alternatives: str) -> str:
    return r"\b(?:" + "|".join(alternatives) + r")\b"


_I = re.IGNORECASE
_HOW_TO = _words("how (?:do i|to|can i|would i)", "instructions? (?:for|to|on)", "steps? to", "recipe for")
_DIGITS = tuple("0123456789")
_MAKE = _words("make", "build", "assemble", "synthesi[sz]e", "produce", "manufacture")

DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(
        "weapons",
        re.compile(
            _HOW_TO
            + r".{0,40}"
            + _MAKE
            + r".{0,40}"
            + _words("(?:pipe )?bombs?", "explosives?", "nerve agents?", "sarin", "ricin", "napalm"),
            _I,
        ),
        Action.BLOCK,
        Action.BLOCK,
        anchors=("bomb", "explosive", "nerve agent", "sarin", "ricin", "napalm"),
    ),
    Rule(
        "malware",
        re.compile(
            _words("write", "create", "build", "code")
            + r".{0,40}"
            + _words("ransomware", "keyloggers?", "botnets?", "credential stealers?"),
            _I,
        ),
        Action.BLOCK,
        Action.BLOCK,
        anchors=("ransomware", "keylogger", "botnet", "credential stealer"),
    ),
    Rule(
        "self_harm",
        re.compile(
            _words("how (?:do i|to|can i)", "best way to", "painless way to")
            + r".{0,30}"
            + _words("kill myself", "commit suicide", "end my life"),
            _I,
        ),
        Action.BLOCK,
        Action.BLOCK,
        anchors=("kill myself", "commit suicide", "end my life"),
    ),
    Rule(
        "sexual_minors",
        re.compile(
            _words("explicit", "nude", "naked", "pornographic", "erotic")
            + r".{0,40}"
            + _words("child(?:ren)?", "minors?", "underage", r"1[0-7][- ]year[- ]olds?"),
            _I,
        ),
        Action.BLOCK,
        Action.BLOCK,
        anchors=("explicit", "nude", "naked", "pornographic", "erotic"),
    ),
    Rule(
        "prompt_injection",
        re.compile(
            _words(
                r"ignore (?:all |any )?(?:the |your )?(?:previous|prior|above|earlier) "
                r"(?:instructions|prompts|rules|messages)",
                r"disregard (?:the |your |all )?(?:system prompt|instructions|rules)",
                r"you are now (?:dan|in developer mode)",
                r"reveal (?:your|the) system prompt",
            )
            + r"|<\|im_(?:start|end)\|>|<\|(?:system|user|assistant)\|>|\[/?INST\]|<</?SYS>>",
            _I,
        ),
        Action.FLAG,
        Action.ALLOW,
        anchors=("ignore", "disregard", "you are now", "system prompt", "<|", "inst]", "<<sys>>", "<</sys>>"),
    ),
    Rule(
        "pii.email",
        re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[a-z]{2,}\b", _I),
        Action.FLAG,
        Action.FLAG,
        anchors=("@",),
    ),
    Rule(
        "pii.phone",
        re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?\(?\d{3}\)?[ .-]\d{3}[ .-]\d{4}\b"),
        Action.FLAG,
        Action.FLAG,
        anchors=_DIGITS,
    ),
    Rule(
        "pii.card",
        re.compile(r"\b(?:\d[ -]?){12,18}\d\b"),
        Action.FLAG,
        Action.BLOCK,
        anchors=_DIGITS,
        confirm=_luhn,
    ),
    Rule(
        "pii.ssn",
        re.compile(r"\b(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}\b"),
        Action.FLAG,
        Action.BLOCK,
        anchors=_DIGITS,
    ),
)


class RuleBasedPolicy:
    """The default policy: regular expressions per category (see the module docstring for its limits)."""

    def __init__(self, rules: Iterable[Rule] = DEFAULT_RULES) -> None:
        self.rules = tuple(rules)
        screened = [rule for rule in self.rules if rule.on_output is not Action.ALLOW]
        self.output_anchors = (
            tuple(sorted({anchor for rule in screened for anchor in rule.anchors}))
            if all(rule.anchors for rule in screened)
            else None
        )

    @classmethod
    def from_config(cls, config: ModerationConfig) -> RuleBasedPolicy:
        rules = []
        for rule in DEFAULT_RULES:
            if rule.category == "prompt_injection" and config.block_injection:
                rule = dataclasses.replace(rule, on_input=Action.BLOCK)
            rules.append(rule)
        if config.blocked_terms:
            terms = "|".join(re.escape(term) for term in config.blocked_terms)
            anchors = tuple(term.lower() for term in config.blocked_terms)
            pattern = re.compile(rf"\b(?:{terms})\b", _I)
            rules.append(Rule("blocked_term", pattern, Action.BLOCK, Action.BLOCK, anchors))
        return cls(rules)

    def check_input(self, text: str) -> Decision:
        return self._check(text, output=False)

    def check_output(self, text: str) -> Decision:
        return self._check(text, output=True)

    def _check(self, text: str, output: bool) -> Decision:
        worst = ALLOWED
        lowered = text.lower()
        for rule in self.rules:
            action = rule.on_output if output else rule.on_input
            if action > worst.action and rule.matches(text, lowered):
                worst = Decision(action, rule.category)
                if action is Action.BLOCK:
                    break
        return worst


class AllowAll:
    """The policy when moderation is switched off."""

    output_anchors: tuple[str, ...] | None = ()

    def check_input(self, text: str) -> Decision:
        return ALLOWED

    def check_output(self, text: str) -> Decision:
        return ALLOWED


class Moderator:
    """Runs a policy and makes its decisions visible: every FLAG and BLOCK is logged and counted."""

    def __init__(self, policy: ModerationPolicy) -> None:
        self.policy = policy

    def screen_input(self, text: str, field: str, who: str) -> None:
        """Refuses a blocked input text (INVALID_ARGUMENT naming ``field``, reason CONTENT_FILTER),
        before anything is read or written for it."""
        decision = self.record("input", self.policy.check_input(text), who)
        if decision.blocked:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the message was refused by the content policy ({decision.category})",
                field=field,
                reason="CONTENT_FILTER",
            )

    def output_screen(self, who: str) -> OutputScreen:
        return OutputScreen(self, who)

    def record(self, stage: str, decision: Decision, who: str) -> Decision:
        if decision.action is not Action.ALLOW:
            METRICS.moderation_decisions.labels(stage, decision.category, decision.action.name.lower()).inc()
            # The category, never the text: logs must not become a copy of users' PII.
            log.info("moderation %s %s: %s (%s)", stage, decision.action.name, decision.category, who)
        return decision


class OutputScreen:
    """Checks a streamed answer delta by delta. Patterns may straddle deltas, so each check covers the
    new text plus the tail of what came before; each category is recorded once per answer.

    Most windows hold none of the policy's anchors, and then nothing can match: the policy is asked only
    while one is in the window. An anchor in the tail was found when it came, so each delta is searched
    with just the characters before it that an anchor ending in it could start at (a few, against the
    whole window's 256: output is checked for every token of every answer).
    """

    # Longer than any default pattern's longest match (about 130 characters).
    TAIL_CHARS = 256

    def __init__(self, moderator: Moderator, who: str) -> None:
        self._moderator = moderator
        self._who = who
        self._tail = ""
        self._seen: set[str] = set()
        self._anchors = moderator.policy.output_anchors
        # How many characters before a delta an anchor that ends in it may start (lower-casing never
        # makes text shorter, so an anchor's match in the text is at most the anchor's length).
        self._reach = max((len(anchor) for anchor in self._anchors or ()), default=1) - 1
        # Characters that came after the delta in which the newest anchor was found (no anchor yet: as
        # if it had left the window).
        self._since_anchor = self.TAIL_CHARS

    def check(self, delta: str) -> Decision:
        window = self._tail + delta
        self._tail = window[-self.TAIL_CHARS :]
        if self._anchors is not None:
            if _holds_any(window[-(len(delta) + self._reach) :].lower(), self._anchors):
                self._since_anchor = 0
            else:
                in_window = self._since_anchor < self.TAIL_CHARS
                self._since_anchor += len(delta)
                if not in_window:
                    return ALLOWED
        decision = self._moderator.policy.check_output(window)
        if decision.action is Action.ALLOW or decision.category in self._seen:
            return decision
        self._seen.add(decision.category)
        return self._moderator.record("output", decision, self._who)


def _holds_any(text: str, needles: tuple[str, ...]) -> bool:
    # A loop, not any() over a generator: this runs for every delta, and the generator costs more.
    for needle in needles:  # noqa: SIM110
        if needle in text:
            return True
    return False


def create_moderator(config: ModerationConfig) -> Moderator:
    return Moderator(RuleBasedPolicy.from_config(config) if config.enabled else AllowAll())
