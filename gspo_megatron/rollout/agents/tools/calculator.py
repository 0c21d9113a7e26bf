"""The ``calculator`` tool: arithmetic on integers and decimals, evaluated from Python's syntax tree.

Design decisions:
- The expression is parsed with ``ast`` (``mode="eval"``) and walked; nothing is ever ``eval``-ed. Allowed:
  int and float literals (not bool, complex or strings), unary + -, binary + - * / // % ** and the
  parentheses the parser already folded into the tree. Any other node (a name, a call, an attribute, a
  comparison...) is refused with ``bad_arguments`` naming what was found.
- The work is bounded before it is done, because the runner cannot stop a thread: the expression is at
  most ``MAX_EXPRESSION_CHARS`` long, a ``**`` exponent at most ``MAX_EXPONENT`` in magnitude and a power
  whose result would pass ``MAX_MAGNITUDE`` is refused from logarithms before it is computed; every
  literal and intermediate result is held to ``MAX_MAGNITUDE`` too, so no operation ever sees an operand
  above 1e100 (a product is at most 1e200, a few hundred bits) and no float overflows unnoticed.
- Division (and ``//``, ``%``, ``0 ** -1``) by zero, and a result that is not real (``(-8) ** 0.5``), are
  ``bad_arguments``: the expression, not the tool, is at fault.
- Python's semantics throughout: ``/`` gives a float, ``//`` and ``%`` floor. Integers print as integers;
  floats in ``repr``'s shortest round-trip form with an integral value's trailing ".0" dropped (10 / 2
  -> "5", 7 / 2 -> "3.5", 0.1 + 0.2 -> "0.30000000000000004"), -0.0 as "0".
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from gspo_megatron.rollout.agents.tools.base import ToolResult, ToolSpec

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e100

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculationError(ValueError):
    """The expression cannot be evaluated; the message says why, for the model."""


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression (see the module docstring for what is allowed)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculationError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculationError(f"not a valid expression: {error.msg}") from None
    except (ValueError, RecursionError, MemoryError) as error:  # a null byte, nesting the parser gives up on
        raise CalculationError(f"not a valid expression: {type(error).__name__}") from None
    try:
        return _value(tree.body)
    except RecursionError:
        raise CalculationError("the expression is nested too deeply") from None


def _value(node: ast.expr) -> Number:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculationError("division by zero") from None
        except OverflowError:
            raise CalculationError(f"the result's magnitude passes {MAX_MAGNITUDE:g}") from None
        if isinstance(result, complex):
            raise CalculationError("the result is not a real number")
        return _bounded(result)
    raise CalculationError(f"{_describe(node)} is not allowed: only numbers, + - * / // % ** and parentheses")


def _check_power(base: Number, exponent: Number) -> None:
    """Refuse a power before computing it when its exponent or its result would be too large."""
    if abs(exponent) > MAX_EXPONENT:
        raise CalculationError(f"exponents are limited to +-{MAX_EXPONENT}, got {exponent}")
    # |base ** exponent| = 10 ** (exponent * log10|base|); log10 takes ints of any size exactly enough
    if base != 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise CalculationError(f"the result's magnitude passes {MAX_MAGNITUDE:g}")


def _bounded(value: Number) -> Number:
    if not abs(value) <= MAX_MAGNITUDE:  # also an inf literal ("1e999") and nan
        raise CalculationError(f"the result's magnitude passes {MAX_MAGNITUDE:g}")
    return value


def _describe(node: ast.expr) -> str:
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Attribute):
        return "an attribute"
    if isinstance(node, ast.BinOp | ast.UnaryOp):
        return f"the operator {type(node.op).__name__}"
    return f"a {type(node).__name__} expression"


def format_number(value: Number) -> str:
    """An integer as an integer; a float in ``repr``'s shortest form, an integral one without ".0"."""
    if isinstance(value, int):
        return str(value)
    if value == 0:
        return "0"  # also -0.0
    text = repr(value)
    return text[:-2] if text.endswith(".0") else text


class Calculator:
    """``calculator(expression)``: the value of an arithmetic expression, as text."""

    def __init__(self, timeout_s: float = 1.0):
        self.timeout_s = timeout_s
        self.spec = ToolSpec(
            name="calculator",
            description=(
                "Evaluate an arithmetic expression over integers and decimals: + - * / // % ** and parentheses "
                "(Python's semantics: / gives a decimal, // and % floor). Returns the value."
            ),
            parameters={
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (17 + 4) * 416.1 - 2 ** 10"}},
                "required": ["expression"],
                "additionalProperties": False,
            },
        )

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        try:
            return ToolResult(format_number(evaluate(arguments["expression"])))
        except CalculationError as error:
            return ToolResult(f"calculator: {error}", error="bad_arguments")
