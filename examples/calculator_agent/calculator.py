"""A safe arithmetic evaluator for the calculator tool: numbers, + - * / ( ) and unary minus.

A small recursive-descent parser; nothing is handed to Python's `eval`. Inputs longer than
`MAX_CHARS` or nested deeper than `MAX_DEPTH` are refused, and results beyond `MAX_ABS` are
errors, so a model cannot make the tool slow or huge.
"""

from __future__ import annotations

import math
import re

MAX_CHARS = 64
MAX_DEPTH = 16
MAX_ABS = 1e15
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(.))")


class CalcError(ValueError):
    """The expression is not valid arithmetic; the message says why."""


def _tokens(expr: str) -> list[str]:
    out = []
    for m in _TOKEN.finditer(expr):
        num, op = m.groups()
        if num is not None:
            out.append(num)
        elif op is not None and op.strip():
            if op not in "+-*/()":
                raise CalcError(f"unexpected character {op!r}")
            out.append(op)
    return out


class _Parser:
    def __init__(self, tokens: list[str]):
        self.toks = tokens
        self.i = 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise CalcError("unexpected end of expression")
        self.i += 1
        return tok

    def expr(self, depth: int) -> float:  # expr := term (('+'|'-') term)*
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> float:  # term := factor (('*'|'/') factor)*
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.factor(depth)
            if op == "/" and rhs == 0:
                raise CalcError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def factor(self, depth: int) -> float:  # factor := '-' factor | '(' expr ')' | number
        if depth > MAX_DEPTH:
            raise CalcError("expression nested too deeply")
        tok = self.take()
        if tok == "-":
            return -self.factor(depth + 1)
        if tok == "+":
            return self.factor(depth + 1)
        if tok == "(":
            value = self.expr(depth + 1)
            if self.peek() != ")":
                raise CalcError("missing ')'")
            self.take()
            return value
        if tok[0].isdigit():
            return float(tok)
        raise CalcError(f"unexpected {tok!r}")


def evaluate(expr: str) -> float:
    """The value of an arithmetic expression, or CalcError."""
    if len(expr) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    tokens = _tokens(expr)
    if not tokens:
        raise CalcError("empty expression")
    p = _Parser(tokens)
    value = p.expr(0)
    if p.peek() is not None:
        raise CalcError(f"unexpected {p.peek()!r}")
    if not math.isfinite(value) or abs(value) > MAX_ABS:
        raise CalcError("result out of range")
    return value


def format_number(x: float) -> str:
    """Integers without a decimal point; others rounded to 4 decimals."""
    if x == int(x):
        return str(int(x))
    return f"{x:.4f}".rstrip("0").rstrip(".")


def calculator(expr: str) -> str:
    """The tool's reply: the value, or `error: <why>` (the model sees it either way)."""
    try:
        return format_number(evaluate(expr))
    except CalcError as e:
        return f"error: {e}"
