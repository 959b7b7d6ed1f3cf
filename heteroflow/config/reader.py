"""A strict reader over parsed YAML: typed getters that record every problem with its path.

Loading never stops at the first problem: each getter records what is wrong and returns None, so the
user sees all problems at once. `Section.finish()` reports keys that nobody read (unknown keys). Numbers are
finite and inside the ranges of `heteroflow.config.limits`.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from heteroflow.config.limits import MAX_EXACT_INT, Range
from heteroflow.errors import ConfigError, Problem, did_you_mean

REQUIRED = object()  # default meaning "the key must be present"


class Problems:
    """Collects `Problem`s; `raise_if_any()` turns them into one `ConfigError`."""

    def __init__(self, source: str | None = None):
        self.items: list[Problem] = []
        self.source = source

    def add(self, path: str, message: str) -> None:
        """Record one problem at `path`."""
        self.items.append(Problem(path, message))

    def raise_if_any(self) -> None:
        """Raise a `ConfigError` listing every recorded problem, if there are any."""
        if self.items:
            raise ConfigError(self.items, self.source)


def type_name(value: Any) -> str:
    """The YAML-ish name of a value's type, for error messages."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def join_path(path: str, key: str | int) -> str:
    """`cluster` + `nodes` -> `cluster.nodes`; `cluster.nodes` + 1 -> `cluster.nodes[1]`."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


class Section:
    """A mapping from the YAML, read key by key with types checked; unknown keys are reported."""

    def __init__(self, data: Any, path: str, problems: Problems, *, allow_extra: Iterable[str] = ()):
        self.path = path
        self.problems = problems
        self.valid = isinstance(data, dict)
        if not self.valid:
            problems.add(path or "(top level)", f"expected a mapping, got {type_name(data)}")
            data = {}
        self.data: dict = data
        self.read: set[str] = set(allow_extra)

    def at(self, key: str) -> str:
        """The path of `key` inside this section."""
        return join_path(self.path, key)

    def has(self, key: str) -> bool:
        """Whether `key` is present (and not null)."""
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = REQUIRED) -> Any:
        """The value as parsed, with no type check; a missing required key is reported."""
        self.read.add(key)
        if key in self.data and self.data[key] is not None:
            return self.data[key]
        if default is REQUIRED:
            self.problems.add(self.at(key), "required field is missing")
            return None
        return default

    def integer(self, key: str, default: Any = REQUIRED, *, minimum: int | None = 1, maximum: int | None = None,
                limit: Range | None = None) -> int | None:
        """An integer (booleans refused) in `limit`, else from `minimum` to `maximum` when given.

        A float is taken only when it is a whole number inside the range: `1e30` is not a count.
        """
        value = self.raw(key, default)
        if value is None or value is default:
            return value
        allowed = limit or Range(minimum, MAX_EXACT_INT if maximum is None else maximum)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and math.isfinite(value) and not value.is_integer()):
            self.problems.add(self.at(key), f"expected an integer, got {type_name(value)} {value!r}")
            return None
        problem = allowed.problem(value)
        if problem is not None:
            self.problems.add(self.at(key), problem)
            return None
        return int(value)

    def number(self, key: str, default: Any = REQUIRED, *, minimum: float | None = None,
               maximum: float | None = None, positive: bool = False, limit: Range | None = None) -> float | None:
        """A finite number (integers accepted, booleans refused) in `limit`, else above 0 with `positive`, at
        least `minimum` and at most `maximum` when given."""
        value = self.raw(key, default)
        if value is None or value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.problems.add(self.at(key), f"expected a number, got {type_name(value)} {value!r}")
            return None
        allowed = limit or (Range(0.0, maximum, min_exclusive=True) if positive else Range(minimum, maximum))
        problem = allowed.problem(value)
        if problem is not None:
            self.problems.add(self.at(key), problem)
            return None
        return float(value)

    def boolean(self, key: str, default: Any = REQUIRED) -> bool | None:
        """A YAML boolean (`true` / `false`)."""
        value = self.raw(key, default)
        if value is None or value is default:
            return value
        if not isinstance(value, bool):
            self.problems.add(self.at(key), f"expected true or false, got {type_name(value)} {value!r}")
            return None
        return value

    def string(self, key: str, default: Any = REQUIRED, *, choices: Sequence[str] | None = None) -> str | None:
        """A string, one of `choices` when given."""
        value = self.raw(key, default)
        if value is None or value is default:
            return value
        if not isinstance(value, str):
            self.problems.add(self.at(key), f"expected a string, got {type_name(value)} {value!r}")
            return None
        if choices is not None and value not in choices:
            self.problems.add(self.at(key), f"must be one of {', '.join(choices)}; got {value!r}"
                              + did_you_mean(value, choices))
            return None
        return value

    def sequence(self, key: str, default: Any = REQUIRED) -> list | None:
        """A YAML sequence."""
        value = self.raw(key, default)
        if value is None or value is default:
            return value
        if not isinstance(value, list):
            self.problems.add(self.at(key), f"expected a list, got {type_name(value)}")
            return None
        return value

    def mapping(self, key: str, default: Any = REQUIRED, **kwargs: Any) -> "Section | None":
        """A nested mapping as its own `Section`, or None when absent and optional."""
        value = self.raw(key, default)
        if value is None or value is default:
            return None
        return Section(value, self.at(key), self.problems, **kwargs)

    def finish(self) -> None:
        """Report every key present in the mapping that no getter asked for."""
        known = sorted(self.read)
        for key in self.data:
            if key not in self.read:
                hint = did_you_mean(str(key), known) if known else ""
                self.problems.add(self.at(str(key)), "unknown key" + hint)
