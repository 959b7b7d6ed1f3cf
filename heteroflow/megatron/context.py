"""State shared by the mapping steps: the parsed arguments, what each became, and what is wrong."""

from __future__ import annotations

from dataclasses import dataclass, field

from heteroflow.errors import UserError
from heteroflow.megatron.args import MegatronArgs, Setting
from heteroflow.megatron.versions import CURRENT, MegatronVersion
from heteroflow.megatron.argtable import FEATURE_GROUPS, IGNORED_GROUPS, MAPPED, UNMAPPED, by_dest
from heteroflow.megatron.report import Entry

NO_RULE = "no effect on the job with the other arguments given"


class MegatronRuleError(UserError):
    """The source breaks one of Megatron's own rules (Megatron would refuse to start)."""


@dataclass
class Context:
    """Arguments plus the decisions taken on them while mapping."""

    args: MegatronArgs
    decided: dict[int, Entry] = field(default_factory=dict)
    defaults: list[Entry] = field(default_factory=list)
    blockers: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    spelling: object = None
    """For YAML sources: destination -> the key the source would use (messages name keys, not flags)."""
    version: MegatronVersion = CURRENT
    """The Megatron-Core release whose rules apply (`--megatron-version`)."""

    # -- reading -------------------------------------------------------------------------------
    def get(self, dest: str):
        """The value Megatron uses for `dest` (given, else its default)."""
        return self.args.get(dest)

    def given(self, dest: str) -> bool:
        """Whether the source sets `dest`."""
        return self.args.given(dest)

    def key(self, dest: str) -> str:
        """How the source spells `dest` (its flag or YAML key), for messages."""
        setting = self.args.setting(dest)
        if setting is not None:
            return setting.key
        if self.spelling is not None:
            return self.spelling(dest)
        definition = by_dest().get(dest)
        return definition.flag if definition else dest

    def value(self, dest: str):
        """The value of `dest`; when the source gives it but the script leaves it unknown, an error."""
        setting = self.args.setting(dest)
        if setting is not None and setting.value is None and setting.unresolved:
            self.error(f"{_where(setting)}{setting.key} {setting.shown}: the value comes from "
                       f"{', '.join(setting.unresolved)}, which the script does not set; pass it with "
                       "--env NAME=VALUE or as a positional argument after the script")
            return None
        return self.get(dest)

    def required(self, dest: str, why: str = "Megatron requires it") -> object:
        """A value the import cannot do without."""
        value = self.value(dest)
        if value is None and not (self.args.setting(dest) and self.args.setting(dest).unresolved):
            self.error(f"{self.key(dest)} is missing: {why}")
        return value

    # -- deciding ------------------------------------------------------------------------------
    def mark(self, dest: str, disposition: str, detail: str) -> None:
        """Record what became of the source's setting for `dest` (nothing when it is not given)."""
        setting = self.args.setting(dest)
        if setting is not None:
            self.decided[setting.index] = _entry(setting, disposition, detail)

    def mark_setting(self, setting: Setting, disposition: str, detail: str) -> None:
        """Record what became of one particular setting."""
        self.decided[setting.index] = _entry(setting, disposition, detail)

    def default(self, dest: str, disposition: str, detail: str, value: object = None) -> None:
        """Record a Megatron default the job relies on (only when the source does not set `dest`)."""
        if self.given(dest):
            return
        definition = by_dest().get(dest)
        if value is not None:
            shown = _show(value)
        elif definition is not None and not definition.takes_value:
            shown = "(not given)"  # a switch left off: its Megatron default is in the detail
        else:
            shown = _show(self.get(dest))
        self.defaults.append(Entry(_flag(dest), shown, disposition, detail, None, "default"))

    def default_value(self, dest: str, value: object, detail: str) -> None:
        """Record a value Megatron derives when the source leaves `dest` unset (mapped into the job)."""
        self.defaults.append(Entry(_flag(dest), _show(value), "mapped", detail, None, "default"))

    def mark_or_default(self, dest: str, disposition: str, detail: str) -> None:
        """`mark` when given, else `default`."""
        if self.given(dest):
            self.mark(dest, disposition, detail)
        else:
            self.default(dest, disposition, detail)

    def error(self, message: str) -> None:
        """A Megatron rule the source breaks, or a value the import cannot determine."""
        if message not in self.errors:
            self.errors.append(message)

    def block(self, message: str) -> None:
        """A model feature heteroflow cannot represent."""
        if message not in self.blockers:
            self.blockers.append(message)

    def raise_errors(self, source: str) -> None:
        """Raise one `MegatronRuleError` listing every error found."""
        if self.errors:
            head = f"{source}: cannot import ({len(self.errors)} problem{'s' * (len(self.errors) != 1)})"
            raise MegatronRuleError("\n".join([head] + [f"  {e}" for e in self.errors]))

    # -- the report ----------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """One entry per setting in source order, then the defaults."""
        out = []
        for setting in self.args.settings:
            out.append(self.decided.get(setting.index) or self._undecided(setting))
        return out + self.defaults

    def _undecided(self, setting: Setting) -> Entry:
        effective = self.args.effective.get(setting.dest) if setting.dest else None
        if effective is not None and effective.index != setting.index:
            later = f"line {effective.line}" if effective.line else effective.key
            return _entry(setting, "ignored", f"given again later ({later}); Megatron uses the last value")
        group = setting.group
        definition = by_dest().get(setting.dest) if setting.dest else None
        if group in IGNORED_GROUPS:
            reason = (definition.reason if definition is not None and definition.reason else IGNORED_GROUPS[group])
            return _entry(setting, "ignored", reason)
        if group in FEATURE_GROUPS:
            return _entry(setting, "ignored", f"{FEATURE_GROUPS[group]} option without effect: the feature is off")
        if setting.dest is None:
            return _entry(setting, "unknown", "not a Megatron-LM argument heteroflow knows (a newer or a fork's "
                                              "flag?); it is not used")
        if group == UNMAPPED:
            return _entry(setting, "unknown", "a current Megatron-LM argument heteroflow has no rule for: not used; "
                                              "check that it does not change the model you want")
        assert group == MAPPED, setting
        return _entry(setting, "ignored", NO_RULE)


def _flag(dest: str) -> str:
    """Megatron's flag for `dest` (defaults are Megatron's, whatever the source's format)."""
    definition = by_dest().get(dest)
    return definition.flag if definition else dest


def _where(setting: Setting) -> str:
    return f"line {setting.line}: " if setting.line else ""


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return "" if value is None else str(value)


def _entry(setting: Setting, disposition: str, detail: str) -> Entry:
    return Entry(setting.key, setting.shown, disposition, detail, setting.line, setting.origin)
