"""What a PromQL expression reads: the metric names it selects, the label matchers on each, and the labels
it groups or joins by. A tokenizer, not a full parser: enough to check dashboards, alerts and autoscaling
queries against what the services export (test_observability_metrics.py).

Grafana's ``label_values(metric{...}, label)`` template queries are read as the selector and the label.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Tokens, in the order they are tried: strings, range/subquery brackets, braces, numbers and durations
# (``1e3``, ``5m``), names, other characters.
_TOKEN = re.compile(
    r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<braces>\{[^}]*\})
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?:ms|[smhdwy])*)
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<other>\S)
    """,
    re.VERBOSE,
)
_MATCHER = re.compile(
    r"""\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<op>=~|!~|!=|=)\s*(?P<value>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')\s*,?"""
)
_LABEL_VALUES = re.compile(
    r"^\s*label_values\((?:(?P<selector>.+),)?\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$"
)
KEYWORDS = {"and", "or", "unless", "offset", "bool", "inf", "nan", "atan2"}
# Followed by a parenthesised label list rather than an expression.
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}


@dataclass(frozen=True)
class Matcher:
    """One label matcher of a selector: ``label op "value"`` (op: =, !=, =~, !~)."""

    label: str
    op: str
    value: str


@dataclass
class Query:
    """Selectors (metric name -> its matchers, all selections of it together) and grouping labels."""

    selectors: dict[str, list[Matcher]] = field(default_factory=dict)
    grouping: set[str] = field(default_factory=set)

    @property
    def metrics(self) -> set[str]:
        return set(self.selectors)


class PromQLError(ValueError):
    """The text is not an expression this reader understands (unbalanced, or a selector with no name)."""


def parse_matchers(braces: str) -> list[Matcher]:
    """``{a="1", b=~"x|y"}`` -> its matchers; anything left over is an error."""
    inner, matchers, pos = braces[1:-1], [], 0
    while inner[pos:].strip():
        found = _MATCHER.match(inner, pos)
        if not found:
            raise PromQLError(f"cannot read label matchers {braces!r} at {inner[pos:]!r}")
        value = found["value"][1:-1].encode().decode("unicode_escape")
        matchers.append(Matcher(found["label"], found["op"], value))
        pos = found.end()
    return matchers


def parse(expr: str) -> Query:
    label_values = _LABEL_VALUES.match(expr)
    if label_values:
        query = parse(label_values["selector"] or "")
        query.grouping.add(label_values["label"])
        return query
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr)]
    query = Query()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
        if kind == "braces":
            raise PromQLError(f"a selector with no metric name: {text!r} in {expr!r}")
        if kind != "name" or text.lower() in KEYWORDS:
            i += 1
            continue
        if text in GROUPING:
            if following[1] == "(":
                i += 2
                while i < len(tokens) and tokens[i][1] != ")":
                    if tokens[i][0] == "name":
                        query.grouping.add(tokens[i][1])
                    i += 1
            i += 1
            continue
        if following[1] == "(" or following[1] in ("by", "without"):  # a function or an aggregation
            i += 1
            continue
        matchers = parse_matchers(following[1]) if following[0] == "braces" else []
        query.selectors.setdefault(text, []).extend(matchers)
        i += 2 if following[0] == "braces" else 1
    _check_balanced(expr, tokens)
    return query


def _check_balanced(expr: str, tokens: list[tuple[str | None, str]]) -> None:
    depth = 0
    for _, text in tokens:
        depth += {"(": 1, ")": -1}.get(text, 0)
        if depth < 0:
            break
    if depth != 0:
        raise PromQLError(f"unbalanced parentheses in {expr!r}")
