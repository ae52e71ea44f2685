"""A calculator tool: arithmetic the model asks for, evaluated here, in the rollouter's own
process, so it must never run code and never run long.

The expression is parsed with :mod:`ast` and only a small language is evaluated: numbers,
``+ - * / // % **``, unary signs, parentheses, the functions of :data:`FUNCTIONS` and the
constants ``pi`` and ``e``. Anything else (names, attributes, strings, comprehensions) is
refused. Sizes are checked before an operation runs, not after: ``9**9**9`` is refused from
the operands' sizes at once instead of computing a number of 370 million digits; integer
results are exact up to :data:`MAX_DIGITS` digits (below Python's own limit on printing a
big int).
"""

from __future__ import annotations

import ast
import math
import operator
import uuid
from collections.abc import Callable
from typing import Any

from agent.tool import schema_name

__all__ = ["MAX_DIGITS", "MAX_EXPRESSION_CHARS", "CalculatorError", "CalculatorTool", "evaluate",
           "render"]

MAX_DIGITS = 4000
"""The most decimal digits an integer (operand or result) may have."""

MAX_EXPRESSION_CHARS = 2000
"""The longest expression accepted (parsing a deeply nested one costs recursion)."""

Number = int | float

FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt, "log": math.log, "exp": math.exp, "sin": math.sin, "cos": math.cos,
    "tan": math.tan, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil,
}

CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}

BINARY: dict[type[ast.operator], Callable[[Any, Any], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}

_MAX_BITS = int(MAX_DIGITS * math.log2(10))


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; its text is for the model."""


def evaluate(expression: str) -> Number:
    """The value of ``expression``; raises :class:`CalculatorError` saying why not."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not an arithmetic expression ({type(e).__name__})") from None
    try:
        return _value(tree.body)
    except CalculatorError:
        raise
    except OverflowError:
        raise CalculatorError("the result is out of a float's range") from None
    except (ArithmeticError, ValueError, TypeError) as e:
        raise CalculatorError(str(e) or type(e).__name__) from None
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def _value(node: ast.expr) -> Number:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"{node.value!r} is not a number")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        _check_size(node.op, left, right)
        return _bounded(BINARY[type(node.op)](left, right))
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id]
    if isinstance(node, ast.Call):
        return _call(node)
    raise CalculatorError(f"{ast.unparse(node)[:60]!r} is not allowed in an expression")


def _call(node: ast.Call) -> Number:
    name = node.func.id if isinstance(node.func, ast.Name) else None
    if name not in FUNCTIONS or node.keywords:
        raise CalculatorError(f"{ast.unparse(node.func)[:60]!r} is not a function here; "
                              f"these are: {', '.join(FUNCTIONS)}")
    args = [_value(arg) for arg in node.args]
    if name == "round" and len(args) == 2 and not isinstance(args[1], int):
        raise CalculatorError("round's digits must be an integer")
    return _bounded(FUNCTIONS[name](*args))


def _check_size(op: ast.operator, left: Number, right: Number) -> None:
    """Refuses an integer operation whose result would pass the bound, before computing it
    (only ``*`` and ``**`` grow a number faster than by one bit). The estimates are within a
    factor of two of the result's size: what passes is cheap to compute, and
    :func:`_bounded` then decides exactly."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return
    if isinstance(op, ast.Mult):
        bits = left.bit_length() + right.bit_length()
    elif isinstance(op, ast.Pow) and right > 0 and abs(left) > 1:
        bits = right * (abs(left).bit_length() - 1)  # at least this many bits
    else:
        return
    if bits > _MAX_BITS + 8:
        raise CalculatorError(f"the result would have more than {MAX_DIGITS} digits")


def _bounded(value: Number) -> Number:
    """``value``, unless an integer of more than MAX_DIGITS digits (counted by its bits, by
    its decimal digits only near the bound)."""
    bits = value.bit_length() if isinstance(value, int) else 0
    if bits > _MAX_BITS + 4 or (bits > _MAX_BITS and len(str(abs(value))) > MAX_DIGITS):
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return value


def render(value: Number) -> str:
    """A result as the model reads it: an integer exactly, a float as Python's repr."""
    return str(value) if isinstance(value, int) else repr(value)


DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % **, "
                       "parentheses, sqrt, log, exp, sin, cos, tan, abs, round, floor, ceil, "
                       "pi, e.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string",
                                          "description": "The expression, e.g. 2**10 / 3."}},
            "required": ["expression"],
        },
    },
}
"""The schema a :class:`CalculatorTool` has when its configuration gives none."""


class CalculatorTool:
    """The calculator as a tool of verl's interface: ``{"expression": ...}`` gives the value
    as text, or ``Error: ...`` saying why there is none; the reward is 0.0; the metric
    ``calculator_error`` is 0/1. No configuration keys."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: Any = None) -> None:
        self.config = dict(config or {})
        self.tool_schema = tool_schema or DEFAULT_SCHEMA
        self.name = schema_name(self.tool_schema)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, None]:
        return (instance_id or str(uuid.uuid4())), None

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[str, float, dict[str, float]]:
        expression = parameters.get("expression") if isinstance(parameters, dict) else None
        if not isinstance(expression, str):
            return ('Error: the parameter "expression" must be a string, e.g. "2**10 / 3"',
                    0.0, {"calculator_error": 1.0})
        try:
            text = render(evaluate(expression))
        except CalculatorError as e:
            return f"Error: {e}", 0.0, {"calculator_error": 1.0}
        return text, 0.0, {"calculator_error": 0.0}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None
