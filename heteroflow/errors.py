"""User-facing errors.

`UserError` is anything the user can fix (bad YAML, an impossible plan, a missing file). The CLI prints
it and exits 2, never with a traceback. Internal invariants use `assert` instead.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Sequence


class UserError(Exception):
    """An error the user can fix; its message says what is wrong and how to fix it."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One problem in a config, located by its YAML path (`cluster.nodes[1].count`)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(UserError):
    """Every problem found in a config, one `path: message` line each."""

    def __init__(self, problems: Sequence[Problem], source: str | None = None):
        assert problems, "ConfigError needs at least one problem"
        self.problems = tuple(problems)
        self.source = source
        super().__init__("\n".join(str(p) for p in self.problems))


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A ` (did you mean 'x'?)` suffix naming the closest choices, or '' when none is close."""
    choices = list(choices)
    lowered = name.lower()
    # Substrings first: 'a100' should find 'nvidia-a100-80g', which difflib alone scores too low.
    close = [c for c in choices if lowered and lowered in c.lower()]
    close += [c for c in difflib.get_close_matches(name, choices, n=3, cutoff=0.6) if c not in close]
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close[:3]) + "?)"


class StateCorrupted(UserError):
    """Training state held outside the process (a swap file block) changed behind heteroflow's back.

    The run cannot go on from it, but it can restart from the last checkpoint: unlike other user errors,
    an elastic restart (`--max-restarts`) is the right answer to this one.
    """
