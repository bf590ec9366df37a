"""The ``calculator`` tool: arithmetic on numbers, parsed with ``ast`` and evaluated node by node, so
no Python ever runs (no names, calls, attributes or subscripts: anything but numbers and arithmetic is
refused), and bounded so no expression can take the replica's CPU or memory."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from chatmesh.tool_format import Function

MAX_EXPRESSION_CHARS = 500
# An integer result (or operand) beyond this many bits is refused: 2**10000 already has 3011 digits.
MAX_INT_BITS = 10_000

FUNCTION = Function(
    name="calculator",
    description="Evaluates an arithmetic expression: numbers, + - * / // % **, and parentheses.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (12.5 * 4) / 3"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
)


class CalculatorError(ValueError):
    """The expression is not arithmetic, or its result is out of bounds (the message says which)."""


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int | float:
    """The value of ``expression``; raises CalculatorError naming what is wrong."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("the expression is not arithmetic") from None
    return _value(tree.body)


def _value(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError("only numbers may appear in an expression")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    raise CalculatorError(f"{type(node).__name__} is not arithmetic: only numbers and + - * / // % ** ( )")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuses a power whose result would be too large before computing it (2 ** 10**9 would take
    the CPU for minutes and the memory with it)."""
    bits = base.bit_length() if isinstance(base, int) else 0
    if isinstance(exponent, int) and exponent > 0 and abs(base) > 1 and exponent * bits > MAX_INT_BITS:
        raise CalculatorError("the result is too large")
    if base < 0 and not float(exponent).is_integer():
        raise CalculatorError("a negative number to a fractional power is not a real number")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError("the result is too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


async def calculator(arguments: dict[str, Any]) -> str:
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    value = evaluate(expression)
    return repr(value) if isinstance(value, float) else str(value)
