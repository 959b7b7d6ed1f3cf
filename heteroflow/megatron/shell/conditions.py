"""`[ ... ]`, `test ...` and `[[ ... ]]` evaluated with three outcomes: True, False or None (undecided).

A variable the script never sets reads as empty, as in a clean environment (the interpreter notes it).
A test is undecided when an operand is truly unknown (a command substitution) or when it asks about
the machine the script would run on (files, directories): heteroflow never looks.
"""

from __future__ import annotations

import fnmatch
import re

from heteroflow.megatron.shell import arith
from heteroflow.megatron.shell.expand import Env, Field, expand_scalar
from heteroflow.megatron.shell.lexer import Lit
from heteroflow.megatron.shell.parser import Word

_FILE_TESTS = {"-a", "-b", "-c", "-d", "-e", "-f", "-g", "-h", "-k", "-L", "-p", "-r", "-s", "-S", "-t", "-u",
               "-w", "-x", "-O", "-G", "-N"}
_INT_OPS = {"-eq": lambda a, b: a == b, "-ne": lambda a, b: a != b, "-lt": lambda a, b: a < b,
            "-le": lambda a, b: a <= b, "-gt": lambda a, b: a > b, "-ge": lambda a, b: a >= b}
_STRING_OPS = ("=", "==", "!=", "<", ">")

Truth = bool | None


def _not(value: Truth) -> Truth:
    return None if value is None else not value


def _and(a: Truth, b: Truth) -> Truth:
    if a is False or b is False:
        return False
    return None if None in (a, b) else True


def _or(a: Truth, b: Truth) -> Truth:
    if a is True or b is True:
        return True
    return None if None in (a, b) else False


def _to_int(field: Field, env: Env, arithmetic: bool = False) -> int | None:
    if field.assumed is None:
        return None
    text = field.assumed.strip()
    if arithmetic and text == "":
        return 0  # `[[ $X -eq 0 ]]` evaluates its operands arithmetically: empty (unset X) is 0
    return arith.integer(text)


def _binary(op: str, left: Field, right: Field, env: Env, *, pattern: bool = False,
            arithmetic: bool = False) -> Truth:
    if op in _INT_OPS:
        a, b = _to_int(left, env, arithmetic), _to_int(right, env, arithmetic)
        return None if a is None or b is None else _INT_OPS[op](a, b)
    a, b = left.assumed, right.assumed
    if a is None or b is None:
        return None
    if op in ("=", "=="):
        return fnmatch.fnmatchcase(a, b) if pattern else a == b
    if op == "!=":
        return not (fnmatch.fnmatchcase(a, b) if pattern else a == b)
    if op == "<":
        return a < b
    if op == ">":
        return a > b
    if op == "=~":
        try:
            return re.search(b, a) is not None
        except re.error:
            return None
    if op in ("-nt", "-ot", "-ef"):
        return None
    return None


def _unary(op: str, operand: Field, env: Env) -> Truth:
    if op == "-z":
        return None if operand.assumed is None else operand.assumed == ""
    if op == "-n":
        return None if operand.assumed is None else operand.assumed != ""
    if op == "-v":
        return env.get(operand.text) is not None if operand.known else None
    if op in _FILE_TESTS:
        return None
    return None


def evaluate_test(args: list[Field], env: Env) -> Truth:
    """`test ARGS` / `[ ARGS ]` (the closing `]` already removed), POSIX rules with -a / -o / ! / ( )."""
    items = list(args)
    pos = 0

    def peek() -> str | None:
        return items[pos].text if pos < len(items) and items[pos].known else None

    def primary() -> Truth:
        nonlocal pos
        remaining = len(items) - pos
        if remaining == 0:
            return False
        if peek() == "!" and remaining > 1:
            pos += 1
            return _not(primary())
        if peek() == "(":
            pos += 1
            value = disjunction()
            if peek() == ")":
                pos += 1
            return value
        if remaining >= 3 and items[pos + 1].known and (items[pos + 1].text in _STRING_OPS
                                                        or items[pos + 1].text in _INT_OPS
                                                        or items[pos + 1].text in ("-nt", "-ot", "-ef")):
            left, op, right = items[pos], items[pos + 1].text, items[pos + 2]
            pos += 3
            return _binary(op, left, right, env)
        if remaining >= 2 and peek() and peek().startswith("-") and len(peek()) == 2:
            op = peek()
            operand = items[pos + 1]
            pos += 2
            return _unary(op, operand, env)
        operand = items[pos]
        pos += 1
        return None if operand.assumed is None else operand.assumed != ""

    def conjunction() -> Truth:
        nonlocal pos
        value = primary()
        while peek() == "-a":
            pos += 1
            value = _and(value, primary())
        return value

    def disjunction() -> Truth:
        nonlocal pos
        value = conjunction()
        while peek() == "-o":
            pos += 1
            value = _or(value, conjunction())
        return value

    return disjunction()


def evaluate_cond(items: tuple, env: Env) -> Truth:
    """`[[ ... ]]`: words are not split; the right side of `==` / `!=` is a pattern unless quoted."""
    pos = 0

    def is_op(*ops: str) -> bool:
        return pos < len(items) and isinstance(items[pos], str) and items[pos] in ops

    def word_text(item) -> str | None:
        if isinstance(item, Word) and len(item.parts) == 1 and isinstance(item.parts[0], Lit) \
                and not item.parts[0].quoted:
            return item.parts[0].text
        return item if isinstance(item, str) else None

    def operand(item) -> Field:
        if isinstance(item, str):
            return Field(item)
        return expand_scalar(item.parts, env)

    def primary() -> Truth:
        nonlocal pos
        if is_op("!"):
            pos += 1
            return _not(primary())
        if is_op("("):
            pos += 1
            value = disjunction()
            if is_op(")"):
                pos += 1
            return value
        if pos >= len(items):
            return None
        first = items[pos]
        op_text = word_text(items[pos + 1]) if pos + 1 < len(items) else None
        if op_text in _STRING_OPS or op_text in _INT_OPS or op_text in ("=~", "-nt", "-ot", "-ef"):
            if pos + 2 >= len(items):
                return None
            right_item = items[pos + 2]
            pos += 3
            quoted = isinstance(right_item, Word) and any(isinstance(p, Lit) and p.quoted for p in right_item.parts)
            return _binary(op_text, operand(first), operand(right_item), env,
                           pattern=op_text in ("=", "==", "!=") and not quoted, arithmetic=True)
        first_text = word_text(first)
        if first_text and first_text.startswith("-") and len(first_text) == 2 and pos + 1 < len(items):
            pos += 2
            return _unary(first_text, operand(items[pos - 1]), env)
        pos += 1
        value = operand(first)
        return None if value.assumed is None else value.assumed != ""

    def conjunction() -> Truth:
        nonlocal pos
        value = primary()
        while is_op("&&"):
            pos += 1
            value = _and(value, primary())
        return value

    def disjunction() -> Truth:
        nonlocal pos
        value = conjunction()
        while is_op("||"):
            pos += 1
            value = _or(value, conjunction())
        return value

    return disjunction()
