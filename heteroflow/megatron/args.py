"""Megatron's arguments as the source gave them: parsed like Megatron's argparse parser would.

`parse_argv` reads the words after `pretrain_gpt.py` (flags, `--flag=value`, lists); the YAML readers
build the same `Setting`s from their keys. `MegatronArgs` answers "what value does Megatron use for
this destination": the last value given, else Megatron's default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from heteroflow.megatron.argtable import ArgDef, by_dest, group_of_unknown, lookup
from heteroflow.megatron.shell import Field

_NUMBER = re.compile(r"^-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


@dataclass(frozen=True, slots=True)
class Setting:
    """One argument as written in the source."""

    key: str
    """`--num-layers`, or a YAML path such as `model.encoder_seq_length`."""
    dest: str | None
    """Megatron's destination name; None for an argument heteroflow does not know."""
    raw: tuple[str, ...]
    """Values as written (after shell expansion)."""
    value: object
    """Typed value; None when a value could not be determined."""
    line: int | None = None
    origin: str = "script"
    unresolved: tuple[str, ...] = ()
    """Values the script does not determine, as their source text (`$DATA_PATH`)."""
    group: str | None = None
    """Argument group (see `argtable`), also for unknown flags with a known prefix."""
    index: int = 0
    """Position among all settings (identifies it in the report)."""

    @property
    def shown(self) -> str:
        """The value as written, for the report."""
        return " ".join(self.raw)


@dataclass(frozen=True)
class MegatronArgs:
    """Settings in source order and the effective one for each destination."""

    settings: tuple[Setting, ...]
    effective: dict[str, Setting] = field(default_factory=dict)
    stray: tuple[tuple[str, int | None, bool], ...] = ()
    """Words not attached to any flag: (text, line, known)."""
    problems: tuple[str, ...] = ()
    """What Megatron's parser itself would reject."""

    def given(self, dest: str) -> bool:
        """Whether the source sets `dest`."""
        return dest in self.effective

    def get(self, dest: str) -> object:
        """The value Megatron uses: the last one given, else its default."""
        if dest in self.effective:
            return self.effective[dest].value
        definition = by_dest().get(dest)
        return None if definition is None else definition.default

    def setting(self, dest: str) -> Setting | None:
        """The setting that decides `dest`, if the source gives one."""
        return self.effective.get(dest)


def _convert(kind: str, text: str, definition: ArgDef) -> object:
    """`text` as Megatron's argparse type would convert it; raises ValueError like argparse does."""
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    if kind == "bool":
        return bool(text)
    if definition.choices and text not in definition.choices:
        raise ValueError(f"invalid choice {text!r} (choose from {', '.join(definition.choices)})")
    return text


def _looks_like_flag(f: Field) -> bool:
    return f.known and f.text.startswith("-") and len(f.text) > 1 and not _NUMBER.match(f.text)


def make_setting(key: str, definition: ArgDef | None, values: list[Field], line: int | None, origin: str,
                 problems: list[str], index: int) -> Setting:
    """A `Setting` for `key` with its values typed per `definition`; conversion errors go to `problems`."""
    raw = tuple(v.text for v in values)
    unresolved = tuple(v.text for v in values if not v.known)
    where = f"line {line}: " if line else ""
    if definition is None:
        return Setting(key, None, raw, raw[0] if len(raw) == 1 else list(raw), line, origin, unresolved,
                       group_of_unknown(key), index)
    value: object = None
    if not definition.takes_value:
        value = not definition.default if definition.kind in ("true", "false") else True
    elif unresolved:
        value = None
    elif definition.kind == "list":
        try:
            value = [_convert(definition.elem, v.text, definition) for v in values]
        except ValueError as exc:
            problems.append(f"{where}{key}: {exc}")
    else:
        try:
            value = _convert(definition.kind, values[0].text, definition)
        except ValueError as exc:
            problems.append(f"{where}{key}: {exc if 'choice' in str(exc) else f'invalid {definition.kind} value {values[0].text!r}'}")
    return Setting(key, definition.dest, raw, value, line, origin, unresolved, definition.group, index)


def parse_argv(argv: tuple[Field, ...] | list[Field], line: int | None = None) -> MegatronArgs:
    """Parse the words after the entry point the way Megatron's parser would (allow_abbrev=False)."""
    settings: list[Setting] = []
    stray: list[tuple[str, int | None, bool]] = []
    problems: list[str] = []
    where = f"line {line}: " if line else ""
    i = 0
    words = list(argv)
    while i < len(words):
        word = words[i]
        if not _looks_like_flag(word):
            stray.append((word.text, line, word.known))
            if word.known:
                problems.append(f"{where}unrecognized argument {word.text!r} (not after a flag that takes values)")
            i += 1
            continue
        name, eq, inline = word.text.partition("=")
        definition = lookup(name)
        values: list[Field] = [Field(inline)] if eq else []
        i += 1
        if definition is not None and not definition.takes_value:
            if eq:
                problems.append(f"{where}{name} takes no value, got {inline!r}")
        elif definition is not None and definition.kind != "list":
            if not eq:
                if i >= len(words) or _looks_like_flag(words[i]):
                    problems.append(f"{where}{name} expects one value")
                    settings.append(Setting(name, definition.dest, (), None, line, "script", (), definition.group,
                                            len(settings)))
                    continue
                values = [words[i]]
                i += 1
        else:
            while not eq and i < len(words) and not _looks_like_flag(words[i]):
                values.append(words[i])
                i += 1
            if definition is not None and definition.nargs == "+" and not values:
                problems.append(f"{where}{name} expects at least one value")
        settings.append(make_setting(name, definition, values, line, "script", problems, len(settings)))
    return build_args(settings, stray, problems)


def build_args(settings: list[Setting], stray=(), problems=()) -> MegatronArgs:
    """`MegatronArgs` from settings in source order (the last setting of a destination wins)."""
    effective: dict[str, Setting] = {}
    for setting in settings:
        if setting.dest is not None:
            effective[setting.dest] = setting
    return MegatronArgs(tuple(settings), effective, tuple(stray), tuple(problems))
