"""A safe interpreter for the bash subset: it follows the script without running any program.

Assignments, arrays, `if` / `case` / `for` / `while`, functions, `eval` and `bash -c` strings are
interpreted; every other command is recorded (with its expanded words) and assumed to succeed.

Policy for conditions, each case noted with its line so the user can change the outcome with `--env`:
- a variable the script never sets (and the user did not give) reads as empty in tests, as in a clean
  environment; as a value it stays visible as unknown (`$DATA_PATH`), never silently empty;
- a test nothing in the script decides (a file test, a command substitution) counts as false: the
  `then` branch is skipped and `elif` / `else` are considered.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Callable

from heteroflow.megatron.shell import arith
from heteroflow.megatron.shell.builtins import BUILTINS, Exit, LoopControl, Return
from heteroflow.megatron.shell.conditions import Truth, evaluate_cond
from heteroflow.megatron.shell.errors import ShellSyntaxError
from heteroflow.megatron.shell.expand import Env, Field, Var, expand_scalar, expand_words
from heteroflow.megatron.shell.nodes import (AndOr, ArithCmd, Assign, Case, CondCmd, For, FuncDef, Group, If,
                                             Pipeline, Sequence, Simple, While)
from heteroflow.megatron.shell.parser import parse_script

MAX_STEPS = 200_000
MAX_LOOP_ITERATIONS = 10_000
MAX_EVAL_DEPTH = 16
MAX_SOURCED = 64
_SBATCH_FLAGS = {"--exclusive", "--overcommit", "-O", "--parsable", "--requeue", "--no-requeue", "-H", "--hold",
                 "-W", "--wait", "--test-only", "-v", "--verbose", "-Q", "--quiet", "--contiguous", "--spread-job"}
"""sbatch options without a value."""
_WRAPPERS = {"srun", "mpirun", "mpiexec", "env", "nohup", "time", "exec", "numactl", "taskset", "nice", "timeout",
             "stdbuf", "docker", "singularity", "apptainer", "enroot", "pdsh", "ssh", "sudo"}
"""Commands that run another command; `WRAPPER ... bash -c STRING` has STRING read as script text."""
_NOT_RUN_QUIETLY = {"echo", "printf", "mkdir", "cd", "pushd", "popd", "set", "date", "sleep", "wait", "trap",
                    "ulimit", "umask", "hostname", "nvidia-smi", "rocm-smi", "npu-smi", "touch", "ls", "pwd",
                    "module", "conda", "tee", "cat", "rm", "cp", "mv", "ln", "chmod", "which", "env"}


@dataclass(frozen=True, slots=True)
class Command:
    """An external command the script would run, with its words expanded."""

    fields: tuple[Field, ...]
    line: int
    prefix_assigns: tuple[tuple[str, Field], ...] = ()
    """`NAME=value` words in front of the command (its private environment)."""

    @property
    def name(self) -> str:
        """The program name as written (may be unknown text like `$LAUNCHER`)."""
        return self.fields[0].text if self.fields else ""


@dataclass(frozen=True, slots=True)
class ScriptRun:
    """What interpreting a script found: the commands it would run, notes, and its final variables."""

    commands: tuple[Command, ...]
    notes: tuple[str, ...]
    missing: dict[str, int]
    """Unset variables / positional parameters the script expanded, with the first line."""
    variables: dict[str, Var] = field(default_factory=dict)
    exited_at: int | None = None
    """Line of an `exit` the interpretation stopped at."""
    exit_status: int | None = 0
    exit_unset: tuple[str, ...] = ()
    """Never-set variables read by the conditions that led to the `exit`."""
    sourced: tuple[str, ...] = ()
    """Files read by `source`, `.` and `sbatch`."""


class Interpreter:
    """Walks the syntax tree, keeping variables in an `Env`."""

    def __init__(self, env: Env, read_file: Callable[[str], tuple[str, str] | None] | None = None):
        self.env = env
        self.read_file = read_file
        """Finds a file a script names (`source`, `sbatch`): (path, text), or None."""
        self.sourced: list[str] = []
        self.commands: list[Command] = []
        self.functions: dict[str, object] = {}
        self.steps = 0
        self.in_condition = 0
        self.eval_depth = 0
        self.command_prefix: tuple[Field, ...] = ()
        """Words of a wrapper (`srun ...`) whose `bash -c` string is being read."""
        self.line_override: int | None = None
        """Inside `eval` / `bash -c` strings: the line of the outer command, for reports."""

    def run_script(self, text: str) -> ScriptRun:
        """Interpret a whole script. Its errors name the line; one nested deeper than Python's stack allows
        (parentheses, groups, substitutions thousands deep) is a `ShellSyntaxError` too."""
        exited, status, unset = None, 0, ()
        try:
            tree, notes = parse_script(text)
            self.env.notes.extend(notes)
            self.run(tree)
        except Exit as stop:
            exited, status, unset = stop.line, stop.status, stop.unset
        except Return:
            pass
        except LoopControl:
            pass
        except RecursionError:
            where = f"line {self.env.line}: " if self.env.line else ""
            raise ShellSyntaxError(f"{where}the script nests too deeply to read (thousands of levels of "
                                   "parentheses, groups or substitutions)") from None
        except ShellSyntaxError as error:
            if self.env.line and not str(error).startswith("line "):
                raise ShellSyntaxError(f"line {self.env.line}: {error}") from None
            raise
        return ScriptRun(tuple(self.commands), tuple(self.env.notes), dict(self.env.missing), dict(self.env.vars),
                         exited, status, unset, tuple(self.sourced))

    # -- dispatch --------------------------------------------------------------------------------
    def run(self, node) -> Truth:
        """Interpret one node; its exit status as True (0), False (non-zero) or None (unknown)."""
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise ShellSyntaxError(f"the script takes more than {MAX_STEPS} steps to interpret (an endless loop?)")
        method = getattr(self, "_" + type(node).__name__.lower())
        return method(node)

    def _sequence(self, node: Sequence) -> Truth:
        status: Truth = True
        for item in node.items:
            status = self.run(item)
        return status

    def _andor(self, node: AndOr) -> Truth:
        if not node.rest:
            return self.run(node.first)
        status = self._condition(Sequence((AndOr(node.first, ()),)), self.env.line, _source_of(node))
        for op, pipeline in node.rest:
            if status is None:
                self.env.note(f"undecided test before `{op}`: taken as false")
                status = False
            if (op == "&&") == status:
                status = self.run(pipeline)
        return status

    def _pipeline(self, node: Pipeline) -> Truth:
        status: Truth = True
        for command in node.commands:
            status = self.run(command)
        return (None if status is None else not status) if node.negate else status

    def _condition(self, cond: Sequence, line: int, text: str) -> Truth:
        self.in_condition += 1
        self.env.unset_read.clear()
        try:
            status = self.run(cond)
        finally:
            self.in_condition -= 1
        if status is not None and self.env.unset_read:
            names = ", ".join(f"${n}" for n in dict.fromkeys(self.env.unset_read))
            self.env.line = line
            self.env.note(f"`{text}` reads {names}, which the script does not set: taken as empty, as in a clean "
                          f"environment (pass --env NAME=VALUE to change it)")
        return status

    def _if(self, node: If) -> Truth:
        read: list[str] = []
        for (cond, body), (line, text) in zip(node.branches, node.text):
            status = self._condition(cond, line, text)
            read += self.env.unset_read
            if status is None:
                self.env.line = line
                self.env.note(f"undecided condition `{text}`: taken as false (pass --env NAME=VALUE to decide it)")
                continue
            if status:
                try:
                    return self.run(body)
                except Exit as stop:
                    stop.unset = tuple(dict.fromkeys(stop.unset + tuple(read)))
                    raise
        if node.else_body is not None:
            return self.run(node.else_body)
        return True

    def _while(self, node: While) -> Truth:
        for _ in range(MAX_LOOP_ITERATIONS):
            status = self._condition(node.cond, node.line, node.text)
            if status is None:
                self.env.line = node.line
                self.env.note(f"undecided loop condition `{node.text}`: the loop body is skipped")
                return True
            if status == node.until:
                return True
            try:
                self.run(node.body)
            except LoopControl as control:
                if control.levels > 1:
                    raise LoopControl(control.kind, control.levels - 1) from None
                if control.kind == "break":
                    return True
        self.env.line = node.line
        self.env.note(f"loop `{node.text}` stopped after {MAX_LOOP_ITERATIONS} iterations")
        return True

    def _for(self, node: For) -> Truth:
        self.env.line = node.line
        values = list(self.env.positionals) if node.words is None else expand_words(node.words, self.env)
        for value in values[:MAX_LOOP_ITERATIONS]:
            self.env.set_scalar(node.var, value)
            try:
                self.run(node.body)
            except LoopControl as control:
                if control.levels > 1:
                    raise LoopControl(control.kind, control.levels - 1) from None
                if control.kind == "break":
                    break
        return True

    def _case(self, node: Case) -> Truth:
        self.env.line = node.line
        self.env.unset_read.clear()
        value = expand_scalar(node.word.parts, self.env).assumed
        if value is not None and self.env.unset_read:
            self.env.note(f"`case {node.word.text}` reads ${self.env.unset_read[0]}, which the script does not set: "
                          "taken as empty, as in a clean environment")
        for patterns, body in node.items:
            for pattern in patterns:
                pat = expand_scalar(pattern.parts, self.env)
                if value is None:
                    if pat.text == "*":
                        self.env.note(f"`case {node.word.text}`: value unknown, took the `*)` branch")
                        return self.run(body)
                    continue
                if pat.known and fnmatch.fnmatchcase(value, pat.text):
                    return self.run(body)
        if value is None:
            self.env.note(f"`case {node.word.text}`: value unknown and no `*)` branch; no branch taken")
        return True

    def _group(self, node: Group) -> Truth:
        if not node.subshell:
            return self.run(node.body)
        saved = (copy.deepcopy(self.env.vars), list(self.env.positionals))
        try:
            return self.run(node.body)
        finally:
            self.env.vars, self.env.positionals = saved

    def _funcdef(self, node: FuncDef) -> Truth:
        self.functions[node.name] = node.body
        return True

    def _arithcmd(self, node: ArithCmd) -> Truth:
        self.env.line = node.line
        text = expand_scalar(node.expr, self.env)
        if not text.known:
            return None
        value = arith.evaluate(text.raw, self.env.int_value, self._store_int)
        return None if value is None else value != 0

    def _condcmd(self, node: CondCmd) -> Truth:
        self.env.line = node.line
        return evaluate_cond(node.items, self.env)

    def _store_int(self, name: str, value: int) -> None:
        self.env.set_scalar(name, Field(str(value)))

    # -- simple commands -------------------------------------------------------------------------
    def _simple(self, node: Simple) -> Truth:
        line = node.line if self.line_override is None else self.line_override
        self.env.line = line
        fields = expand_words(node.words, self.env)
        if not fields:
            for assign in node.assigns:
                self._assign(assign)
            return True
        prefix = tuple((a.name, expand_scalar(a.value.parts, self.env)) for a in node.assigns
                       if a.value is not None)
        name = fields[0].text if fields[0].known else None
        args = fields[1:]
        if name in ("export", "declare", "local", "readonly", "typeset"):
            for assign in node.decl_assigns:
                self._assign(assign)
            return True
        if name in self.functions:
            return self._call(name, args)
        handler = BUILTINS.get(name or "")
        if handler is not None:
            status = handler(self, args, node)
            self.env.last_status = None if status is None else int(not status)
            return status
        self.env.last_status = 0
        if name is not None and name.rsplit("/", 1)[-1] == "sbatch":
            followed = self._sbatch(fields, line, node.heredoc)
            if followed is not None:
                return followed
        shell_at = None
        if fields[0].text.rsplit("/", 1)[-1] in _WRAPPERS:
            shell_at = next((j for j, f in enumerate(fields[1:], 1) if f.text.rsplit("/", 1)[-1] in ("bash", "sh")
                             and _runs_string(fields[j + 1:])), None)
        if shell_at is not None:
            # `srun ... bash -c "torchrun ..."`: read the string, keeping the wrapper's words in front of
            # every command it runs so the launcher still sees `srun -N 4`.
            saved = self.command_prefix
            self.command_prefix = saved + tuple(fields[:shell_at])
            try:
                return BUILTINS["bash"](self, fields[shell_at + 1:], node)
            finally:
                self.command_prefix = saved
        self.commands.append(Command(self.command_prefix + tuple(fields), line, prefix))
        if self.in_condition and name not in _NOT_RUN_QUIETLY:
            self.env.note(f"`{' '.join(f.text for f in fields)[:80]}` is not run; assumed to succeed")
        return True

    def _sbatch(self, fields: list[Field], line: int, heredoc: str | None) -> Truth:
        """`sbatch [OPTIONS] SCRIPT [ARGS]` (or `sbatch <<EOF`): read the script with its `#SBATCH` lines as
        options of the launch; None when it cannot be read (the command is then recorded as it is)."""
        k = 1
        while k < len(fields) and fields[k].text.startswith("-"):
            text = fields[k].text
            takes_value = "=" not in text and text not in _SBATCH_FLAGS
            k += 2 if takes_value else 1
        if k >= len(fields) and heredoc is not None:
            path, text = "a here-document", heredoc
        else:
            if k >= len(fields) or not fields[k].known or self.read_file is None:
                return None
            found = self.read_file(fields[k].text)
            if found is None:
                return None
            path, text = found
            self.sourced.append(path)
        directives = [w for d in re.findall(r"^#SBATCH[ \t]+(.*)$", text, re.M) for w in d.split("#")[0].split()]
        saved = self.command_prefix, self.env.positionals
        self.command_prefix = saved[0] + (Field("sbatch"),) + tuple(Field(w) for w in directives) + tuple(fields[1:k])
        self.env.positionals = list(fields[k + 1:])
        try:
            return self._run_file(path, text, line, "sbatch")
        finally:
            self.command_prefix, self.env.positionals = saved

    def source_file(self, name: str, args: list[Field], line: int) -> Truth:
        """`source NAME ARGS`: interpret the file in this shell; None when it cannot be found."""
        found = self.read_file(name) if self.read_file is not None else None
        if found is None:
            return None
        path, text = found
        self.sourced.append(path)
        saved = self.env.positionals
        if args:
            self.env.positionals = list(args)
        try:
            return self._run_file(path, text, line, "source")
        except Return:
            return True
        finally:
            self.env.positionals = saved

    def _run_file(self, path: str, text: str, line: int, what: str) -> Truth:
        if len(self.sourced) > MAX_SOURCED:
            raise ShellSyntaxError(f"line {line}: more than {MAX_SOURCED} files sourced (a file sourcing itself?)")
        saved = self.env.vars.get("BASH_SOURCE")
        self.env.vars["BASH_SOURCE"] = Var([Field(path)], is_array=True)
        try:
            return self.run_text(text, line, f"{what} {path}")
        finally:
            if saved is None:
                self.env.vars.pop("BASH_SOURCE", None)
            else:
                self.env.vars["BASH_SOURCE"] = saved

    def _assign(self, assign: Assign) -> None:
        self.env.line = assign.line if self.line_override is None else self.line_override
        env = self.env
        if assign.array is not None:
            values = expand_words(assign.array, env)
            old = env.vars.get(assign.name)
            if assign.append and old is not None:
                env.vars[assign.name] = Var(list(old.fields) + values, is_array=True)
            else:
                env.vars[assign.name] = Var(values, is_array=True)
            return
        value = expand_scalar(assign.value.parts, env) if assign.value is not None else Field("")
        old = env.vars.get(assign.name)
        if assign.index is not None and assign.index not in ("@", "*"):
            index_text = expand_scalar(_parts_of(assign.index), env)
            index = arith.evaluate(index_text.raw, env.int_value, None) if index_text.known else None
            var = old if old is not None else Var([], is_array=True)
            var.is_array = True
            if index is None or index < 0:
                env.note(f"array index `{assign.index}` of {assign.name} is unknown; assignment skipped")
                return
            while len(var.fields) <= index:
                var.fields.append(Field(""))
            var.fields[index] = value
            env.vars[assign.name] = var
            return
        if assign.append and old is not None:
            value = Field(old.scalar.raw + value.raw)
        env.set_scalar(assign.name, value)

    def _call(self, name: str, args: list[Field]) -> Truth:
        saved = self.env.positionals
        self.env.positionals = list(args)
        try:
            return self.run(self.functions[name])
        except Return:
            return True
        finally:
            self.env.positionals = saved

    def run_text(self, text: str, line: int, what: str) -> Truth:
        """Interpret a string as script text (`eval`, `bash -c`)."""
        if self.eval_depth >= MAX_EVAL_DEPTH:
            raise ShellSyntaxError(f"line {line}: {what} nested more than {MAX_EVAL_DEPTH} deep")
        self.eval_depth += 1
        saved = self.line_override
        self.line_override = line if saved is None else saved
        try:
            try:
                tree, notes = parse_script(text)
            except ShellSyntaxError as exc:
                raise ShellSyntaxError(f"line {line} ({what} of {text[:60]!r}): {exc}") from None
            self.env.notes.extend(f"line {line} ({what}): {n}" for n in notes)
            return self.run(tree)
        finally:
            self.eval_depth -= 1
            self.line_override = saved


def _runs_string(words: list[Field]) -> bool:
    """Whether the words after `bash` are options ending in `-c STRING` (`bash -x -c "..."`)."""
    for k, word in enumerate(words):
        if word.text == "-c":
            return k + 1 < len(words)
        if not word.text.startswith("-"):
            return False
    return False


def _source_of(node: AndOr) -> str:
    """A short text for notes about an and-or list."""
    try:
        return " ".join(w.text for w in node.first.commands[0].words)[:80]
    except AttributeError:
        return "test"


def _parts_of(text: str) -> tuple:
    from heteroflow.megatron.shell.lexer import _parse_inner
    return _parse_inner(text, 0)


def run_script(text: str, *, args: list[str] | tuple[str, ...] = (), env: dict[str, str] | None = None,
               script_name: str = "script.sh", cwd: str = ".",
               read_file: Callable[[str], tuple[str, str] | None] | None = None) -> ScriptRun:
    """Interpret `text` with positional parameters `args` and variables `env` (nothing else is known).

    `cwd` is what `pwd` gives; `read_file(name)` finds the files `source` and `sbatch` name.
    """
    state = Env(script_name=script_name, positionals=[Field(a) for a in args], cwd=cwd)
    state.vars["BASH_SOURCE"] = Var([Field(script_name)], is_array=True)
    for name, value in (env or {}).items():
        state.vars[name] = Var([Field(value)])
    return Interpreter(state, read_file).run_script(text)
