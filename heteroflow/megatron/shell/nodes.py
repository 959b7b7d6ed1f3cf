"""The syntax tree of the bash subset: words, assignments, commands and compound commands."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Word:
    """A word as parsed: its parts (see `lexer.Part`) and the source text."""

    parts: tuple
    text: str
    line: int


@dataclass(frozen=True, slots=True)
class Assign:
    """`NAME=word`, `NAME+=word`, `NAME=(words)`, `NAME+=(words)` or `NAME[i]=word`."""

    name: str
    line: int
    value: Word | None = None
    array: tuple[Word, ...] | None = None
    append: bool = False
    index: str | None = None


@dataclass(frozen=True, slots=True)
class Simple:
    """A simple command: assignments, then words (the command and its arguments)."""

    assigns: tuple[Assign, ...]
    words: tuple[Word, ...]
    line: int
    decl_assigns: tuple[Assign, ...] = ()
    """Assignments given as arguments of export / declare / local / readonly / typeset."""
    heredoc: str | None = None
    """The text of a here-document fed to the command (`sbatch <<EOF ... EOF`)."""


@dataclass(frozen=True, slots=True)
class Pipeline:
    """`cmd | cmd ...`, optionally negated with `!`."""

    commands: tuple
    negate: bool = False


@dataclass(frozen=True, slots=True)
class AndOr:
    """`pipeline && pipeline || pipeline ...`."""

    first: Pipeline
    rest: tuple[tuple[str, Pipeline], ...]


@dataclass(frozen=True, slots=True)
class Sequence:
    """Commands run one after another."""

    items: tuple


@dataclass(frozen=True, slots=True)
class If:
    """`if c; then b; elif c; then b; else b; fi`."""

    branches: tuple[tuple[Sequence, Sequence], ...]
    else_body: Sequence | None
    line: int
    text: tuple[tuple[int, str], ...]
    """Line and source text of each condition, for reports."""


@dataclass(frozen=True, slots=True)
class For:
    """`for NAME in words; do body; done` (no `in` means "$@")."""

    var: str
    words: tuple[Word, ...] | None
    body: Sequence
    line: int


@dataclass(frozen=True, slots=True)
class While:
    """`while c; do b; done` or `until`."""

    cond: Sequence
    body: Sequence
    until: bool
    line: int
    text: str


@dataclass(frozen=True, slots=True)
class Case:
    """`case word in pat|pat) body;; ... esac`."""

    word: Word
    items: tuple[tuple[tuple[Word, ...], Sequence], ...]
    line: int


@dataclass(frozen=True, slots=True)
class Group:
    """`{ list; }` or a `( list )` subshell."""

    body: Sequence
    subshell: bool


@dataclass(frozen=True, slots=True)
class FuncDef:
    """`name() { ... }` or `function name { ... }`."""

    name: str
    body: object


@dataclass(frozen=True, slots=True)
class ArithCmd:
    """`(( expr ))`."""

    expr: tuple
    line: int
    text: str


@dataclass(frozen=True, slots=True)
class CondCmd:
    """`[[ ... ]]`: its items are words and the operators `&&`, `||`, `(`, `)`, `!`, `<`, `>`."""

    items: tuple
    line: int
    text: str
