"""Sandboxed calculator: a recursive-descent parser for integer arithmetic (+ - * / and parentheses).
Model text is never passed to eval/exec; length, nesting depth, magnitude and work are bounded."""
from __future__ import annotations

from dataclasses import dataclass

MAX_CHARS = 64
MAX_DEPTH = 16
MAX_MAGNITUDE = 10 ** 12
MAX_STEPS = 512


class CalcError(ValueError):
    """The expression is malformed or exceeds a sandbox limit."""


@dataclass
class _Parser:
    text: str
    pos: int = 0
    steps: int = 0

    def _tick(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise CalcError("expression: too much work")

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expr(self, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise CalcError("expression: nested too deeply")
        value = self.term(depth)
        while self.peek() in ("+", "-") and self.peek():
            op = self.text[self.pos]; self.pos += 1
            rhs = self.term(depth)
            value = _check(value + rhs if op == "+" else value - rhs)
        return value

    def term(self, depth: int) -> int:
        value = self.factor(depth)
        while self.peek() in ("*", "/") and self.peek():
            op = self.text[self.pos]; self.pos += 1
            rhs = self.factor(depth)
            if op == "*":
                value = _check(value * rhs)
            else:
                if rhs == 0:
                    raise CalcError("expression: division by zero")
                if value % rhs:
                    raise CalcError("expression: inexact division")
                value = value // rhs
        return value

    def factor(self, depth: int) -> int:
        self._tick()
        ch = self.peek()
        if ch == "-":
            self.pos += 1
            return -self.factor(depth)
        if ch == "(":
            self.pos += 1
            value = self.expr(depth + 1)
            if self.peek() != ")":
                raise CalcError("expression: missing ')'")
            self.pos += 1
            return value
        start = self.pos
        while self.peek().isdigit():
            self.pos += 1
        if start == self.pos:
            raise CalcError(f"expression: expected a number at position {start}")
        if self.pos - start > 13:
            raise CalcError("expression: number too long")
        return _check(int(self.text[start:self.pos]))


def _check(v: int) -> int:
    if abs(v) > MAX_MAGNITUDE:
        raise CalcError("expression: magnitude limit exceeded")
    return v


def evaluate(expression: str) -> int:
    """Evaluate an integer arithmetic expression within the sandbox limits; raise CalcError otherwise."""
    text = expression.replace(" ", "")
    if not text:
        raise CalcError("expression: empty")
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression: longer than {MAX_CHARS} characters")
    if any(c not in "0123456789+-*/()" for c in text):
        raise CalcError("expression: characters outside the arithmetic grammar")
    p = _Parser(text)
    value = p.expr(0)
    if p.pos != len(text):
        raise CalcError(f"expression: unexpected {text[p.pos]!r} at position {p.pos}")
    return value
