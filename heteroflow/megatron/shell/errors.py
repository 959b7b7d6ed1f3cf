"""Errors of the shell reader."""

from __future__ import annotations

from heteroflow.errors import UserError


class ShellSyntaxError(UserError):
    """The script is not bash heteroflow can read (its message names the line)."""
