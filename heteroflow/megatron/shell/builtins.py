"""Shell builtins the interpreter understands (test, set, shift, eval, bash -c, exit, ...), and the
exceptions that carry `exit`, `return`, `break` and `continue` out of nested nodes."""

from __future__ import annotations

from typing import Protocol

from heteroflow.megatron.shell import arith
from heteroflow.megatron.shell.conditions import Truth, evaluate_test
from heteroflow.megatron.shell.errors import ShellSyntaxError
from heteroflow.megatron.shell.expand import Env, Field
from heteroflow.megatron.shell.nodes import Simple


class Shell(Protocol):
    """What a builtin may use of the interpreter running it (`interp.Interpreter` is the one)."""

    env: Env

    def run_text(self, text: str, line: int, what: str) -> Truth:
        """Interpret a string as script text (`eval`, `bash -c`)."""

    def source_file(self, name: str, args: list[Field], line: int) -> Truth:
        """Read the file `source NAME` names and interpret it in this shell; None when it cannot be read."""


class Exit(Exception):
    """`exit`: stop reading the script."""

    def __init__(self, line: int, status: int | None = 0):
        self.line = line
        self.status = status
        self.unset: tuple[str, ...] = ()
        """Never-set variables the `if` conditions around the `exit` read: what the user should pass."""


class Return(Exception):
    """`return` from a function."""


class LoopControl(Exception):
    """`break` / `continue` out of `levels` loops."""

    def __init__(self, kind: str, levels: int):
        self.kind = kind
        self.levels = levels


def _b_true(interp: Shell, args: list[Field], node: Simple) -> Truth:
    return True


def _b_false(interp: Shell, args: list[Field], node: Simple) -> Truth:
    return False


def _b_test(interp: Shell, args: list[Field], node: Simple) -> Truth:
    return evaluate_test(args, interp.env)


def _b_bracket(interp: Shell, args: list[Field], node: Simple) -> Truth:
    if not args or args[-1].text != "]":
        raise ShellSyntaxError(f"line {node.line}: `[` without its closing `]`")
    return evaluate_test(args[:-1], interp.env)


def _b_set(interp: Shell, args: list[Field], node: Simple) -> Truth:
    texts = [a.text for a in args]
    if "--" in texts:
        interp.env.positionals = list(args[texts.index("--") + 1:])
    elif args and not texts[0].startswith(("-", "+")):
        interp.env.positionals = list(args)
    return True


def _b_shift(interp: Shell, args: list[Field], node: Simple) -> Truth:
    n = _count(args[0]) if args and args[0].known else 1
    interp.env.positionals = interp.env.positionals[n:]
    return True


def _b_unset(interp: Shell, args: list[Field], node: Simple) -> Truth:
    for arg in args:
        if not arg.text.startswith("-"):
            interp.env.vars.pop(arg.text, None)
    return True


def _b_eval(interp: Shell, args: list[Field], node: Simple) -> Truth:
    return interp.run_text(" ".join(a.raw for a in args), node.line, "eval")


def _b_shell(interp: Shell, args: list[Field], node: Simple) -> Truth:
    texts = [a.text for a in args]
    if "-c" in texts and texts.index("-c") + 1 < len(args):
        k = texts.index("-c")
        script = args[k + 1]
        saved = interp.env.positionals
        interp.env.positionals = list(args[k + 3:])
        try:
            # The raw text keeps unknown parts marked, so they stay unknown words inside the string.
            return interp.run_text(script.raw, node.line, "bash -c")
        finally:
            interp.env.positionals = saved
    interp.env.note(f"`{' '.join(texts)}` runs another script, which is not followed")
    return True


def _b_source(interp: Shell, args: list[Field], node: Simple) -> Truth:
    target = args[0].text if args else ""
    if args and args[0].known:
        status = interp.source_file(target, args[1:], node.line)
        if status is not None:
            return status
    interp.env.note(f"`source {target}` is not followed (the file cannot be found or read); variables it sets "
                    "are unknown here (pass them with --env NAME=VALUE)")
    return True


def _b_exit(interp: Shell, args: list[Field], node: Simple) -> Truth:
    status = interp.env.last_status
    if args:
        status = arith.integer(args[0].text) if args[0].known else None
    raise Exit(node.line, status)


def _b_which(interp: Shell, args: list[Field], node: Simple) -> Truth:
    # `which srun` decides batch or interactive mode: read as run outside Slurm, where it is not found.
    names = " ".join(a.text for a in args if not a.text.startswith("-"))
    interp.env.note(f"`which {names}` is taken as not found (the script is read as run interactively, "
                    "outside a scheduler)")
    return False


def _b_return(interp: Shell, args: list[Field], node: Simple) -> Truth:
    raise Return()


def _b_break(interp: Shell, args: list[Field], node: Simple) -> Truth:
    raise LoopControl("break", _count(args[0]) if args else 1)


def _b_continue(interp: Shell, args: list[Field], node: Simple) -> Truth:
    raise LoopControl("continue", _count(args[0]) if args else 1)


def _count(arg: Field) -> int:
    """`shift N`, `break N`: a count of at least 0 (1 when not a number)."""
    value = arith.integer(arg.text)
    return value if value is not None and value >= 0 else 1


def _b_read(interp: Shell, args: list[Field], node: Simple) -> Truth:
    for arg in args:
        if not arg.text.startswith("-"):
            interp.env.set_scalar(arg.text, Field.unknown(f"$(read {arg.text})"))
    return None


BUILTINS = {
    "true": _b_true, ":": _b_true, "false": _b_false, "test": _b_test, "[": _b_bracket, "set": _b_set,
    "shift": _b_shift, "unset": _b_unset, "eval": _b_eval, "bash": _b_shell, "sh": _b_shell,
    "source": _b_source, ".": _b_source, "exit": _b_exit, "return": _b_return, "break": _b_break,
    "continue": _b_continue, "read": _b_read, "which": _b_which,
}
