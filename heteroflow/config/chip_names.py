"""Did-you-mean for device type names: the chip family and generation the user typed rank first.

A name is read as a vendor and the runs of letters and digits after it: `nvidia-a100-80g` is vendor
`nvidia` with `a`, `100`, `80`, `g`; `ascend-910b2` is `ascend` with `910`, `b`, `2`; `amd-mi300x` is
`amd` with `mi`, `300`, `x`. A candidate that agrees with more of the typed runs from the start (the
family, then the generation, then the variant) ranks higher, whatever plain string similarity says:
`nvidia-a100` suggests the A100s before the A800 and never the H100, `nvidia-a100-80` the A100 80 GB first.
The vendor (when typed, allowing a typo) breaks ties, then string similarity, then the order of the choices.
"""

from __future__ import annotations

import difflib
import re
from typing import Iterable, Mapping

_RUNS = re.compile(r"[a-z]+|[0-9]+")
MAX_SUGGESTIONS = 3


def _vendor_and_runs(name: str, vendors: set[str]) -> tuple[str, list[str]]:
    """(`vendor` or '', the letter and digit runs after it) of a lower-cased device type name."""
    runs = _RUNS.findall(name.lower())
    if runs and runs[0].isalpha():
        if runs[0] in vendors:
            return runs[0], runs[1:]
        close = difflib.get_close_matches(runs[0], sorted(vendors), n=1, cutoff=0.75)
        if close and len(runs) > 1:  # `nvida-h800`: a vendor with a typo, then the model
            return close[0], runs[1:]
    return "", runs


def _agreement(typed: list[str], candidate: list[str]) -> int:
    """How many runs from the start the two agree on (the family, then the generation, ...)."""
    count = 0
    for a, b in zip(typed, candidate):
        if a != b:
            break
        count += 1
    return count


def device_type_hint(name: str, choices: Iterable[str], aliases: Mapping[str, str] | None = None) -> str:
    """A ` (did you mean 'x' or 'y'?)` suffix for an unknown device type `name`, or '' when nothing is close.

    `choices` are the accepted names; `aliases` maps accepted shorthands to their canonical names (a
    shorthand is not suggested next to the name it stands for).
    """
    aliases = {k.lower(): v for k, v in (aliases or {}).items()}
    choices = list(dict.fromkeys([*choices, *aliases]))
    typed_name = name.strip().lower()
    if not typed_name:
        return ""
    vendors = {c.split("-", 1)[0].lower() for c in choices if "-" in c}
    vendor, typed = _vendor_and_runs(typed_name, vendors)
    ratio = {c: difflib.SequenceMatcher(None, typed_name, c.lower()).ratio() for c in choices}
    scored = []
    for order, choice in enumerate(choices):
        their_vendor, runs = _vendor_and_runs(choice.lower(), vendors)
        agree = _agreement(typed, runs)
        if agree == 0 and typed_name not in choice.lower() and ratio[choice] < 0.6:
            continue
        scored.append(((-agree, -(vendor != "" and vendor == their_vendor), -ratio[choice], order), choice))
    picked: list[str] = []
    for _, choice in sorted(scored):
        target = aliases.get(choice.lower())
        if target is not None and target in picked or choice in aliases.values() and any(
                aliases.get(p.lower()) == choice for p in picked):
            continue  # a shorthand and the name it stands for: one of them
        picked.append(choice)
        if len(picked) == MAX_SUGGESTIONS:
            break
    return " (did you mean " + " or ".join(repr(c) for c in picked) + "?)" if picked else ""
