"""Expansion of parsed words: parameters, arrays, arithmetic, then word splitting, as bash does them.

A value the script does not determine (a variable it never sets, a positional parameter not given,
a command substitution) is kept as its source text and marked unknown instead of becoming an empty
string: the importer can then say exactly which value is missing and how to supply it.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from dataclasses import dataclass, field

from heteroflow.megatron.shell import arith
from heteroflow.megatron.shell.errors import ShellSyntaxError
from heteroflow.megatron.shell.lexer import Arith, CmdSub, Lit, Param
from heteroflow.megatron.shell.nodes import Simple
from heteroflow.megatron.shell.parser import parse_script

_BLANKS = re.compile(r"[ \t\n]+")
MAX_WORD_CHARS = 131_072
"""The longest word or variable value kept: Linux's MAX_ARG_STRLEN, the longest argument a program takes."""


_OPEN, _CLOSE, _BLANK, _UNSET = "\ue000", "\ue001", "\ue002", "\ue003"
_UNSET_SPAN = re.compile("\ue003[^\ue001]*\ue001")


@dataclass(frozen=True, slots=True)
class Field:
    """One expanded word. An unknown value inside it is kept as its source text between private
    markers, so known text around it still splits on blanks while the unknown part stays whole.
    Two kinds of unknown: a variable the script never sets (empty in a clean environment, which is
    how tests read it) and a value nothing determines (a command substitution)."""

    raw: str

    @classmethod
    def unknown(cls, source: str) -> "Field":
        """A value the script does not determine, shown as `source`."""
        return cls(_mark(source))

    @property
    def known(self) -> bool:
        """Whether no part of the word is unknown."""
        return _OPEN not in self.raw and _UNSET not in self.raw

    @property
    def assumed(self) -> str | None:
        """The text in a clean environment (never-set variables empty); None when truly unknown."""
        return None if _OPEN in self.raw else _UNSET_SPAN.sub("", self.raw)

    @property
    def text(self) -> str:
        """The word as shown to people: unknown parts appear as their source text."""
        return self.raw.replace(_OPEN, "").replace(_UNSET, "").replace(_CLOSE, "").replace(_BLANK, " ")


def _mark(source: str, opening: str = _OPEN) -> str:
    return opening + re.sub(r"[ \t\n]", _BLANK, source) + _CLOSE


@dataclass(slots=True)
class Var:
    """A shell variable: a scalar is an array of one element that is not marked `is_array`."""

    fields: list[Field]
    is_array: bool = False

    @property
    def scalar(self) -> Field:
        """`$NAME` of this variable: element 0, or an empty string."""
        return self.fields[0] if self.fields else Field("")


@dataclass
class Env:
    """Variables, positional parameters and the notes expansions leave for the report."""

    vars: dict[str, Var] = field(default_factory=dict)
    positionals: list[Field] = field(default_factory=list)
    script_name: str = "script.sh"
    cwd: str = "."
    """The directory the script is taken to run in (`pwd`): the script's own directory."""
    last_status: int | None = 0
    """`$?`: the status of the last command; None when not known (a program that is not run)."""
    notes: list[str] = field(default_factory=list)
    missing: dict[str, int] = field(default_factory=dict)
    """Unset variables / positional parameters that were expanded, with the first line."""
    unset_read: list[str] = field(default_factory=list)
    """Unset names expanded since the interpreter last cleared it (to explain decided tests)."""
    line: int = 0
    arith_depth: int = 0
    """How many variables deep the arithmetic being evaluated has looked (`int_value`)."""

    def note(self, message: str) -> None:
        """Record a note once."""
        text = f"line {self.line}: {message}" if self.line else message
        if text not in self.notes:
            self.notes.append(text)

    def get(self, name: str) -> Var | None:
        """The variable or parameter `name`, or None when unset."""
        if name.isdigit():
            k = int(name)
            if k == 0:
                return Var([Field(self.script_name)])
            return Var([self.positionals[k - 1]]) if k <= len(self.positionals) else None
        if name in ("@", "*"):
            return Var(list(self.positionals), is_array=True)
        if name == "#":
            return Var([Field(str(len(self.positionals)))])
        if name == "?":
            known = self.last_status is not None
            return Var([Field(str(self.last_status)) if known else Field.unknown("$?")])
        return self.vars.get(name)

    def set_scalar(self, name: str, value: Field) -> None:
        """`NAME=value` (on an array: sets element 0, as bash does)."""
        check_size(value.raw, f"the value of {name}")
        var = self.vars.get(name)
        if var is not None and var.is_array:
            var.fields[0:1] = [value]
        else:
            self.vars[name] = Var([value])

    def int_value(self, name: str) -> int | None:
        """A variable's value as an arithmetic operand (None when unknown); a value that names another
        variable, or holds an expression, is evaluated in turn, at most `arith.MAX_DEPTH` deep."""
        self.arith_depth += 1
        try:
            if self.arith_depth > arith.MAX_DEPTH:
                raise arith.ArithError(f"variables refer to each other in arithmetic more than {arith.MAX_DEPTH} "
                                       f"deep (at {name}; a loop such as A=B B=A?)")
            return self._int_value(name)
        finally:
            self.arith_depth -= 1

    def _int_value(self, name: str) -> int | None:
        var = self.get(name)
        if var is None:
            self.missing.setdefault(name, self.line)
            return None
        value = var.scalar
        if not value.known:
            return None
        text = value.raw.strip()
        if not text:
            return 0
        if (number := arith.integer(text)) is not None:
            return number
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text) and text != name:
            return self.int_value(text)
        return arith.evaluate(text, self.int_value, None)


@dataclass(slots=True)
class _Piece:
    text: str
    """Raw text (unknown parts marked)."""
    split: bool
    new_field: bool = False


def _unknown_piece(source: str) -> _Piece:
    return _Piece(_mark(source), split=False)


def _unset_piece(part: Param, env: Env) -> _Piece:
    env.missing.setdefault(part.name, env.line)
    env.unset_read.append(part.name)
    return _Piece(_mark(part.source, _UNSET), split=False)


def expand_words(words, env: Env) -> list[Field]:
    """Expand and split a command's words into fields."""
    out: list[Field] = []
    for word in words:
        out.extend(expand_word(word.parts, env))
    return out


def check_size(text: str, what: str) -> None:
    """A `ShellSyntaxError` when `text` is longer than `MAX_WORD_CHARS`."""
    if len(text) > MAX_WORD_CHARS:
        raise ShellSyntaxError(f"{what} grows to {len(text):,} characters; at most {MAX_WORD_CHARS:,} are kept (no "
                               "program could take a longer argument; a variable doubling in a loop?)")


def expand_word(parts, env: Env) -> list[Field]:
    """Fields of one word after expansion and word splitting."""
    pieces = _pieces(parts, env)
    check_size("".join(p.text for p in pieces), "an expanded word" + (f" at line {env.line}" if env.line else ""))
    return _split(pieces)


def expand_scalar(parts, env: Env) -> Field:
    """One word expanded without splitting (assignment values, `case` words, `[[` operands)."""
    pieces = _pieces(parts, env)
    text = "".join(p.text if not p.new_field else " " + p.text for p in pieces)
    check_size(text, "an expanded word" + (f" at line {env.line}" if env.line else ""))
    return Field(text)


def _pieces(parts, env: Env) -> list[_Piece]:
    pieces: list[_Piece] = []
    for part in parts:
        if isinstance(part, Lit):
            pieces.append(_Piece(part.text, split=not part.quoted))
        elif isinstance(part, Param):
            pieces.extend(_param(part, env))
        elif isinstance(part, Arith):
            pieces.append(_arith(part, env))
        elif isinstance(part, CmdSub):
            value = path_substitution(part.source, env)
            if value is not None:
                pieces.append(_Piece(value, split=not part.quoted))
                continue
            env.note(f"command substitution {part.source} is never run; its value is unknown")
            pieces.append(_unknown_piece(part.source))
    return pieces


def _inner_text(source: str) -> str:
    return source[2:-1] if source.startswith("$(") else source.strip("`")


def path_substitution(source: str, env: Env) -> str | None:
    """The value of a command substitution that only computes a path (`pwd`, `dirname X`, `basename X`,
    `realpath X`, `readlink -f X`, `cd X && pwd`), None for any other: those never touch the disk."""
    inner = _inner_text(source).strip()
    match = re.fullmatch(r"cd\s+(.+?)\s*(&&|;)\s*pwd(\s+-P)?", inner, re.S)
    if match:
        target = _words_of(match.group(1), env)
        return None if target is None or len(target) != 1 else posixpath.normpath(
            posixpath.join(env.cwd, target[0]))
    words = _words_of(inner, env)
    if not words:
        return None
    name, args = words[0], [w for w in words[1:] if not w.startswith("-")]
    if name == "pwd" and not args:
        return env.cwd
    if len(args) != 1:
        return None
    if name == "dirname":
        return posixpath.dirname(args[0].rstrip("/")) or "."
    if name == "basename":
        return posixpath.basename(args[0].rstrip("/"))
    if name in ("realpath", "readlink") and (name == "realpath" or "-f" in words):
        return posixpath.normpath(posixpath.join(env.cwd, args[0]))
    return None


def _words_of(text: str, env: Env) -> list[str] | None:
    """The words of a one-command text, expanded; None when it is not one known simple command."""
    if any(c in text for c in ";|&<>\n"):
        return None
    try:
        tree, _ = parse_script(text)
    except ShellSyntaxError:
        return None
    items = getattr(tree, "items", ())
    if len(items) != 1 or getattr(items[0], "rest", None) or len(getattr(items[0].first, "commands", ())) != 1:
        return None
    command = items[0].first.commands[0]
    if not isinstance(command, Simple) or command.assigns:
        return None
    fields = expand_words(command.words, env)
    return [f.text for f in fields] if all(f.known for f in fields) else None


def _arith(part: Arith, env: Env) -> _Piece:
    text = expand_scalar(part.expr, env)
    if not text.known:
        return _unknown_piece(part.source)
    value = arith.evaluate(text.raw, env.int_value, lambda n, v: env.set_scalar(n, Field(str(v))))
    if value is None:
        return _unknown_piece(part.source)
    return _Piece(str(value), split=not part.quoted)


def _param(part: Param, env: Env) -> list[_Piece]:
    """The pieces of one parameter expansion."""
    pieces = _param_pieces(part, env)
    all_elements = part.index in ("@", "*") or (part.name in ("@", "*") and part.index is None)
    if not pieces and part.quoted and not all_elements:
        return [_Piece("", split=False)]  # "${X:+y}" with X unset is one empty word, not none
    return pieces


def _param_pieces(part: Param, env: Env) -> list[_Piece]:
    split = not part.quoted
    if part.indirect:
        env.note(f"indirect expansion {part.source} is not supported; its value is unknown")
        return [_unknown_piece(part.source)]
    var = env.get(part.name)
    all_elements = part.index in ("@", "*") or (part.name in ("@", "*") and part.index is None)
    if part.length:
        if var is None:
            return [_unset_piece(part, env)]
        n = len(var.fields) if all_elements else len(var.scalar.text)
        return [_Piece(str(n), split=split)]
    values = _select(var, part, env, all_elements)
    if part.op:
        return _operator(part, var, values, env, split)
    if values is None:
        return [_unset_piece(part, env)]
    return _as_pieces(values, part, split)


def _select(var: Var | None, part: Param, env: Env, all_elements: bool) -> list[Field] | None:
    if var is None:
        return None
    if all_elements:
        return list(var.fields)
    if part.index is None:
        return [var.scalar]
    index_text = expand_scalar(_index_parts(part.index), env)
    index = arith.evaluate(index_text.raw, env.int_value, None) if index_text.known else None
    if index is None:
        return [Field.unknown(part.source)]
    if index < 0:
        index += len(var.fields)
    return [var.fields[index]] if 0 <= index < len(var.fields) else [Field("")]


def _index_parts(index: str) -> tuple:
    from heteroflow.megatron.shell.lexer import _parse_inner
    return _parse_inner(index, 0)


def _as_pieces(values: list[Field], part: Param, split: bool) -> list[_Piece]:
    if (part.index == "*" or part.name == "*") and part.quoted:
        return [_Piece(" ".join(v.raw for v in values), split=False)]
    return [_Piece(v.raw, split=split, new_field=i > 0) for i, v in enumerate(values)]


def _operator(part: Param, var: Var | None, values: list[Field] | None, env: Env, split: bool) -> list[_Piece]:
    op = part.op
    value = None if values is None else Field(" ".join(v.raw for v in values))
    assumed = None if value is None else value.assumed
    unset = var is None
    if unset:
        env.unset_read.append(part.name)
    empty = unset or assumed == ""
    if op in (":-", "-", ":=", "=", ":+", "+", ":?", "?"):
        if value is not None and assumed is None:
            return [_unknown_piece(part.source)]
        use_word = (empty if op.startswith(":") else unset)
        if op in (":-", "-"):
            return _word_pieces(part, env, split) if use_word else _as_pieces(values, part, split)
        if op in (":=", "="):
            if use_word:
                assigned = expand_scalar(part.arg, env)
                env.set_scalar(part.name, assigned)
                return [_Piece(assigned.raw, split=split)]
            return _as_pieces(values, part, split)
        if op in (":+", "+"):
            return [] if use_word else _word_pieces(part, env, split)
        if use_word:
            message = expand_scalar(part.arg, env).text or "parameter null or not set"
            env.note(f"the script requires {part.name} ({message}); its value is unknown")
            env.missing.setdefault(part.name, env.line)
            return [_unknown_piece(part.source)]
        return _as_pieces(values, part, split)
    if value is None or not value.known:
        if value is None or assumed is not None:
            return [_unset_piece(part, env)]
        return [_unknown_piece(part.source)]
    arg = expand_scalar(part.arg, env)
    if not arg.known:
        return [_unknown_piece(part.source)]
    text = _string_operation(op, value.raw, arg.raw, env)
    if text is None:
        env.note(f"expansion {part.source} is not supported; its value is unknown")
        return [_unknown_piece(part.source)]
    return [_Piece(text, split=split)]


def _word_pieces(part: Param, env: Env, split: bool) -> list[_Piece]:
    pieces = _pieces(part.arg, env)
    if split:
        return pieces
    return [_Piece(p.text, split=False) for p in pieces]


def _string_operation(op: str, text: str, arg: str, env: Env) -> str | None:
    """`#`, `##`, `%`, `%%`, `/`, `//`, `^^`, `,,`, `^`, `,` and `:offset:length` on a known value."""
    if op in ("#", "##"):
        cuts = range(len(text) + 1) if op == "#" else range(len(text), -1, -1)
        for k in cuts:
            if fnmatch.fnmatchcase(text[:k], arg):
                return text[k:]
        return text
    if op in ("%", "%%"):
        cuts = range(len(text), -1, -1) if op == "%" else range(len(text) + 1)
        for k in cuts:
            if fnmatch.fnmatchcase(text[k:], arg):
                return text[:k]
        return text
    if op in ("/", "//"):
        pattern, _, replacement = arg.partition("/")
        regex = fnmatch.translate(pattern).removeprefix("(?s:").removesuffix(")\\Z")
        return re.sub(regex, lambda _m: replacement, text, count=0 if op == "//" else 1) if pattern else text
    if op == "^^":
        return text.upper()
    if op == ",,":
        return text.lower()
    if op == "^":
        return text[:1].upper() + text[1:]
    if op == ",":
        return text[:1].lower() + text[1:]
    if op == ":":
        offset_text, _, length_text = arg.partition(":")
        offset = arith.evaluate(offset_text, env.int_value, None)
        length = arith.evaluate(length_text, env.int_value, None) if length_text else None
        if offset is None or (length_text and length is None):
            return None
        start = offset if offset >= 0 else max(len(text) + offset, 0)
        end = len(text) if length is None else (start + length if length >= 0 else len(text) + length)
        return text[start:end]
    return None


def _split(pieces: list[_Piece]) -> list[Field]:
    """Join pieces into fields, splitting unquoted expansion results on blanks."""
    fields: list[Field] = []
    text: list[str] = []
    present = False

    def flush() -> None:
        nonlocal text, present
        if present:
            fields.append(Field("".join(text)))
        text, present = [], False

    for piece in pieces:
        if piece.new_field:
            flush()
        if not piece.split:
            text.append(piece.text)
            present = True
            continue
        chunks = _BLANKS.split(piece.text)
        for k, chunk in enumerate(chunks):
            if k > 0:
                flush()
            if chunk:
                text.append(chunk)
                present = True
    flush()
    return fields
