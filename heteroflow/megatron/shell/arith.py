"""Bash integer arithmetic (`$((...))`, `((...))`) evaluated by a small precedence-climbing parser.

No Python `eval`: the expression is tokenized and evaluated here. Values are 64-bit signed integers
that wrap around as bash's do (so no result grows without bound), with C-style division (truncating
toward zero); an unknown variable makes the result unknown (None) unless a short-circuit operator
decides it anyway. An expression longer than `MAX_CHARS` or nested deeper than `MAX_DEPTH` (parentheses,
unary operators, `**` chains, variables holding expressions) is an `ArithError`, never a Python
recursion error.
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

MAX_CHARS = 10_000
"""The longest arithmetic expression read."""
MAX_DEPTH = 100
"""How deeply an expression may nest (bash stops at 1024; Python's stack is the limit here)."""
_BITS = 64

Lookup = Callable[[str], "int | None"]
Store = Callable[[str, int], None]


class ArithError(ShellSyntaxError):
    """An arithmetic expression bash would reject (syntax, division by zero)."""


_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ@_"


def wrap(value: int) -> int:
    """`value` as bash's 64-bit signed arithmetic holds it."""
    return ((value + (1 << (_BITS - 1))) % (1 << _BITS)) - (1 << (_BITS - 1))


def _parse_number(text: str) -> int:
    """A bash integer constant: decimal, 0x hex, 0 octal, or BASE#DIGITS with BASE 2..64."""
    if "#" in text:
        base_text, digits = text.split("#", 1)
        base = int(base_text) if len(base_text) <= 3 else 0
        if not 2 <= base <= 64:
            raise ArithError(f"invalid arithmetic base {base_text[:10]} in {text[:40]!r} (bash takes 2 to 64)")
    elif text[:2] in ("0x", "0X"):
        base, digits = 16, text[2:]
    elif len(text) > 1 and text.startswith("0"):
        base, digits = 8, text[1:]
    else:
        base, digits = 10, text
    value = 0
    for c in digits:
        k = _DIGITS.index(c.lower() if base <= 36 else c)
        if k >= base:
            raise ArithError(f"value too great for base {base} in {text[:40]!r}")
        value = wrap(value * base + k)
    return value


_DECIMAL = re.compile(r"\s*([-+]?)([0-9]+)\s*")


def integer(text: str) -> int | None:
    """A decimal integer written as text (`shift 2`, `[ $N -eq 8 ]`) as a 64-bit value (wrapping), or None when
    `text` is not one (only ASCII digits count: `int()` would take other scripts' digits, and refuses more than
    4300 of them with a ValueError)."""
    match = _DECIMAL.fullmatch(text)
    if match is None:
        return None
    if len(match.group(2)) > MAX_CHARS:
        raise ArithError(f"a number of {len(match.group(2)):,} digits; at most {MAX_CHARS:,} are read")
    value = 0
    for digit in match.group(2):
        value = wrap(value * 10 + ord(digit) - ord("0"))
    return wrap(-value) if match.group(1) == "-" else value


def _c_div(a: int, b: int) -> int:
    if b == 0:
        raise ArithError("division by 0 in arithmetic")
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _c_mod(a: int, b: int) -> int:
    return a - b * _c_div(a, b)


def _power(a: int, b: int) -> int:
    if b < 0:
        raise ArithError("exponent less than 0 in arithmetic")
    return pow(a, b, 1 << _BITS)  # the low 64 bits of a ** b, however large b is


def _apply(op: str, a: int, b: int) -> int:
    return wrap({
        "+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: _c_div(a, b),
        "%": lambda: _c_mod(a, b), "**": lambda: _power(a, b), "<<": lambda: a << (b & (_BITS - 1)),
        ">>": lambda: a >> (b & (_BITS - 1)),
        "&": lambda: a & b, "|": lambda: a | b, "^": lambda: a ^ b,
        "==": lambda: int(a == b), "!=": lambda: int(a != b), "<": lambda: int(a < b),
        ">": lambda: int(a > b), "<=": lambda: int(a <= b), ">=": lambda: int(a >= b),
    }[op]())


class _Evaluator:
    def __init__(self, text: str, lookup: Lookup, store: Store | None):
        if len(text) > MAX_CHARS:
            raise ArithError(f"arithmetic expression of {len(text):,} characters {text[:40].strip()!r}...; at most "
                             f"{MAX_CHARS:,} are read")
        self.text = text
        self.tokens = self._tokenize(text)
        self.pos = 0
        self.lookup = lookup
        self.store = store
        self.depth = 0

    def _deeper(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ArithError(f"arithmetic expression {self.text.strip()[:60]!r} nests deeper than {MAX_DEPTH} levels")

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
        self._deeper()
        try:
            return self._assignment_at_depth()
        finally:
            self.depth -= 1

    def _assignment_at_depth(self) -> int | None:
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
            self._deeper()
            right = self._binary(prec if right_assoc else prec + 1)
            self.depth -= 1
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
            self._deeper()
            value = self._unary()
            self.depth -= 1
            if value is None:
                return None
            return wrap({"!": lambda: int(not value), "~": lambda: ~value, "-": lambda: -value,
                         "+": lambda: value}[tok[1]]())
        if tok and tok[0] == "op" and tok[1] in ("++", "--"):
            self._take()
            name = self._take()
            if name[0] != "name":
                raise ArithError(f"`{tok[1]}` needs a variable in {self.text.strip()!r}")
            current = self.lookup(name[1])
            value = None if current is None else wrap(current + (1 if tok[1] == "++" else -1))
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
                    self.store(text, wrap(value + (1 if op == "++" else -1)))
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
