"""A small, safe reader of the bash that Megatron launch scripts are written in: it interprets
variables, arrays, arithmetic and decidable conditions, and never runs a program."""

from heteroflow.megatron.shell.errors import ShellSyntaxError
from heteroflow.megatron.shell.expand import Field, Var
from heteroflow.megatron.shell.interp import Command, ScriptRun, run_script

__all__ = ["Command", "Field", "ScriptRun", "ShellSyntaxError", "Var", "run_script"]
