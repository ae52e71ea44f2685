"""agent.calculator: arithmetic evaluated safely, as Python would evaluate it, and bounded."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.calculator import (
    MAX_DIGITS,
    CalculatorError,
    CalculatorTool,
    evaluate,
    render,
)
from agent.tool import Tool


def integer_expressions() -> st.SearchStrategy[str]:
    """Expressions of small integers with + - * and parentheses (bounded results)."""
    leaves = st.integers(min_value=-1000, max_value=1000).map(lambda n: f"({n})")
    return st.recursive(
        leaves,
        lambda inner: st.tuples(inner, st.sampled_from("+-*"), inner).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"),
        max_leaves=12,
    )


@settings(max_examples=150, deadline=None)
@given(integer_expressions())
def test_integer_arithmetic_is_pythons(expression: str) -> None:
    assert evaluate(expression) == eval(expression)  # the generated text: numbers only


@settings(max_examples=150, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6),
       st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6),
       st.sampled_from(["+", "-", "*", "/", "//", "%"]))
def test_float_arithmetic_is_pythons(a: float, b: float, op: str) -> None:
    expression = f"{a!r} {op} ({b!r})"
    try:
        expected = eval(expression)
    except ZeroDivisionError:
        with pytest.raises(CalculatorError):
            evaluate(expression)
        return
    assert render(evaluate(expression)) == repr(expected)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_any_text_is_a_value_or_a_calculator_error(text: str) -> None:
    try:
        value = evaluate(text)
    except CalculatorError:
        return
    assert isinstance(value, int | float) and not isinstance(value, bool)


@pytest.mark.parametrize(("expression", "value"), [
    ("2**10 / 4", "256.0"),
    ("7 // 2 + 7 % 2", "4"),
    ("-(3) ** 2", "-9"),
    ("sqrt(16)", "4.0"),
    ("log(8, 2)", "3.0"),
    ("exp(0) + sin(0) + cos(0) + tan(0)", "2.0"),
    ("abs(-2) * round(2.567, 2)", "5.14"),
    ("floor(pi) + ceil(e)", "6"),
    ("2**200", str(2**200)),
    ("10**3999 * 9", "9" + "0" * 3999),
])
def test_values(expression: str, value: str) -> None:
    assert render(evaluate(expression)) == value


@pytest.mark.parametrize(("expression", "says"), [
    ("9**9**9", "digits"),
    ("10**4000", "digits"),
    ("(10**3999)**2", "digits"),
    ("7**(10**3999)", "digits"),
    ("2.0**5000", "range"),
    ("1/0", "division by zero"),
    ("__import__('os').system('true')", "not a function"),
    ("(1).real", "not allowed"),
    ("x + 1", "not allowed"),
    ("'a' * 3", "not a number"),
    ("True + 1", "not a number"),
    ("[1, 2]", "not allowed"),
    ("sqrt(-1)", "math domain error"),
    ("2 +", "not an arithmetic expression"),
    ("(" * 5000 + "1" + ")" * 5000, "longer than"),
])
def test_refusals(expression: str, says: str) -> None:
    with pytest.raises(CalculatorError, match=says):
        evaluate(expression)


def test_the_digit_bound_is_exact() -> None:
    assert len(render(evaluate(f"10**{MAX_DIGITS - 1}"))) == MAX_DIGITS
    assert math.isinf(evaluate("1e308 * 10"))  # floats overflow to inf on *, as Python's


@pytest.mark.asyncio
async def test_tool() -> None:
    tool = CalculatorTool({}, None)
    assert isinstance(tool, Tool) and tool.name == "calculator"
    instance, _ = await tool.create("given")
    assert instance == "given"
    assert await tool.execute(instance, {"expression": "6 * 7"}) == (
        "42", 0.0, {"calculator_error": 0.0})
    text, reward, metrics = await tool.execute(instance, {"expression": "9**9**9"})
    assert text.startswith("Error: ") and "digits" in text
    assert (reward, metrics) == (0.0, {"calculator_error": 1.0})
    text, _, _ = await tool.execute(instance, {"expr": "1"})
    assert text.startswith("Error: ") and "expression" in text
    assert await tool.calc_reward(instance) == 0.0
    await tool.release(instance)
    schema = {"type": "function", "function": {"name": "calc", "parameters": {}}}
    assert CalculatorTool({}, schema).name == "calc"
