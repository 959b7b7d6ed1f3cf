"""Bash integer arithmetic (`$((...))`, `((...))`) evaluated by a small precedence-climbing parser.

No Python `eval`: the expression is tokenized and evaluated here. Values are Python ints with C-style
division (truncating toward zero); an unknown variable makes the result unknown (None) unless a
short-circuit operator decides it anyway.
"""

from __future__ import annotations

import re
from typing import Callable

from heteroflow.megatron.shell.errors import ShellSyntaxError

_TOKEN = re.compile(r"\s*(?:(?P<num>0[xX][0-9a-fA-F]+|\d+#[0-9a-zA-Z@_]+|\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                    r"|(?P<op>\*\*=?|<<=|>>=|\+\+|--|&&|\|\||<=|>=|==|!=|<<|>>|[-+*/%&|^]=|[-+*/%<>=!~&|^?:(),]))")
_BINARY = {  # operator -> (precedence, right associative)
    "||": (3, False), "&&": (4, False), "|": (5, False), "^": (6, False), "&": (7, False),
    "==": (8, False), "!=": (8, False), "<": (9, False), ">": (9, False), "<=": (9, False), ">=": (9, False),
    "<<": (10, False), ">>": (10, False), "+": (11, False), "-": (11, False),
    "*": (12, False), "/": (12, False), "%": (12, False), "**": (14, True),
}
_ASSIGN_OPS = ("=", "*=", "/=", "%=", "+=", "-=", "<<=", ">>=", "&=", "^=", "|=", "**=")

Lookup = Callable[[str], "int | None"]
Store = Callable[[str, int], None]


class ArithError(ShellSyntaxError):
    """An arithmetic expression bash would reject (syntax, division by zero)."""


def _parse_number(text: str) -> int:
    if "#" in text:
        base, digits = text.split("#", 1)
        return int(digits, int(base))
    if text[:2] in ("0x", "0X"):
        return int(text, 16)
    if len(text) > 1 and text.startswith("0"):
        return int(text, 8)
    return int(text)


def _c_div(a: int, b: int) -> int:
    if b == 0:
        raise ArithError("division by 0 in arithmetic")
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _c_mod(a: int, b: int) -> int:
    return a - b * _c_div(a, b)


def _apply(op: str, a: int, b: int) -> int:
    return {
        "+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: _c_div(a, b),
        "%": lambda: _c_mod(a, b), "**": lambda: a ** b, "<<": lambda: a << b, ">>": lambda: a >> b,
        "&": lambda: a & b, "|": lambda: a | b, "^": lambda: a ^ b,
        "==": lambda: int(a == b), "!=": lambda: int(a != b), "<": lambda: int(a < b),
        ">": lambda: int(a > b), "<=": lambda: int(a <= b), ">=": lambda: int(a >= b),
    }[op]()


class _Evaluator:
    def __init__(self, text: str, lookup: Lookup, store: Store | None):
        self.text = text
        self.tokens = self._tokenize(text)
        self.pos = 0
        self.lookup = lookup
        self.store = store

    @staticmethod
    def _tokenize(text: str) -> list[tuple[str, str]]:
        out, i = [], 0
        while i < len(text):
            if text[i:].strip() == "":
                break
            m = _TOKEN.match(text, i)
            if not m or m.end() == i:
                raise ArithError(f"cannot read arithmetic expression {text.strip()!r} at {text[i:].strip()!r}")
            kind = m.lastgroup
            out.append((kind, m.group(kind)))
            i = m.end()
        return out

    def _peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> tuple[str, str]:
        tok = self._peek()
        if tok is None:
            raise ArithError(f"arithmetic expression {self.text.strip()!r} ends too early")
        self.pos += 1
        return tok

    def _is(self, op: str) -> bool:
        tok = self._peek()
        return tok is not None and tok == ("op", op)

    def run(self) -> int | None:
        if not self.tokens:
            return 0
        value = self._comma()
        if self._peek() is not None:
            raise ArithError(f"unexpected {self._peek()[1]!r} in arithmetic expression {self.text.strip()!r}")
        return value

    def _comma(self) -> int | None:
        value = self._assignment()
        while self._is(","):
            self._take()
            value = self._assignment()
        return value

    def _assignment(self) -> int | None:
        tok = self._peek()
        nxt = self.tokens[self.pos + 1] if self.pos + 1 < len(self.tokens) else None
        if tok and tok[0] == "name" and nxt and nxt[0] == "op" and nxt[1] in _ASSIGN_OPS:
            self.pos += 2
            rhs = self._assignment()
            if nxt[1] == "=":
                value = rhs
            else:
                current = self.lookup(tok[1])
                value = None if current is None or rhs is None else _apply(nxt[1][:-1], current, rhs)
            if value is not None and self.store is not None:
                self.store(tok[1], value)
            return value
        return self._ternary()

    def _ternary(self) -> int | None:
        cond = self._binary(3)
        if not self._is("?"):
            return cond
        self._take()
        yes = self._assignment()
        if not self._is(":"):
            raise ArithError(f"`?` without `:` in arithmetic expression {self.text.strip()!r}")
        self._take()
        no = self._assignment()
        if cond is None:
            return yes if yes == no else None
        return yes if cond else no

    def _binary(self, min_prec: int) -> int | None:
        left = self._unary()
        while True:
            tok = self._peek()
            if tok is None or tok[0] != "op" or tok[1] not in _BINARY:
                return left
            prec, right_assoc = _BINARY[tok[1]]
            if prec < min_prec:
                return left
            self._take()
            right = self._binary(prec if right_assoc else prec + 1)
            op = tok[1]
            if op == "&&":
                left = 0 if 0 in (left, right) else (None if None in (left, right) else int(bool(left and right)))
            elif op == "||":
                if (left not in (None, 0)) or (right not in (None, 0)):
                    left = 1
                else:
                    left = None if None in (left, right) else 0
            else:
                left = None if left is None or right is None else _apply(op, left, right)

    def _unary(self) -> int | None:
        tok = self._peek()
        if tok and tok[0] == "op" and tok[1] in ("!", "~", "-", "+"):
            self._take()
            value = self._unary()
            if value is None:
                return None
            return {"!": lambda: int(not value), "~": lambda: ~value, "-": lambda: -value, "+": lambda: value}[tok[1]]()
        if tok and tok[0] == "op" and tok[1] in ("++", "--"):
            self._take()
            name = self._take()
            if name[0] != "name":
                raise ArithError(f"`{tok[1]}` needs a variable in {self.text.strip()!r}")
            current = self.lookup(name[1])
            value = None if current is None else current + (1 if tok[1] == "++" else -1)
            if value is not None and self.store is not None:
                self.store(name[1], value)
            return value
        return self._postfix()

    def _postfix(self) -> int | None:
        kind, text = self._take()
        if kind == "num":
            return _parse_number(text)
        if kind == "name":
            value = self.lookup(text)
            if self._is("++") or self._is("--"):
                op = self._take()[1]
                if value is not None and self.store is not None:
                    self.store(text, value + (1 if op == "++" else -1))
            return value
        if text == "(":
            value = self._comma()
            if not self._is(")"):
                raise ArithError(f"missing `)` in arithmetic expression {self.text.strip()!r}")
            self._take()
            return value
        raise ArithError(f"unexpected {text!r} in arithmetic expression {self.text.strip()!r}")


def evaluate(text: str, lookup: Lookup, store: Store | None = None) -> int | None:
    """The value of a bash arithmetic expression; None when it depends on an unknown variable."""
    return _Evaluator(text, lookup, store).run()
