"""`DataSpec` (`train.data`): a flat token file, or Megatron indexed datasets with blend weights and a split."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from heteroflow.config.reader import Problems, Section, join_path, type_name

TOKEN_DTYPES = ("uint16", "uint32", "int32")
DEFAULT_SPLIT = "969,30,1"
"""Megatron-LM's `--split` default."""
MID_LEVEL_SURPLUS = 0.005
"""Megatron's `mid_level_dataset_surplus` default: each blended dataset builds this share more samples."""
_SPLIT = re.compile(r"^\s*[0-9.]+(\s*[,/ ]\s*[0-9.]+){0,2}\s*$")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec:
    """Training tokens: `path` (a flat token file) or `prefixes` (Megatron `.bin`/`.idx` datasets)."""

    path: str | None = None
    """Flat token file: sample i is tokens [i*S, i*S + S + 1); resolved relative to the job file."""
    prefixes: tuple[str, ...] = ()
    """Megatron dataset prefixes (PREFIX.bin + PREFIX.idx), resolved relative to the job file."""
    weights: tuple[float, ...] | None = None
    """Blend weights, one per prefix (Megatron's `--data-path w1 p1 w2 p2`); None: one prefix, or each
    prefix weighted by its size."""
    split: str = DEFAULT_SPLIT
    """Megatron's `--split` train,valid,test shares of each prefix's documents; heteroflow trains on the first."""
    dtype: str | None = "uint16"
    """Token width of `path` (uint16, uint32, int32); for prefixes None (the .idx says) or a check of it."""
    shuffle: bool = True
    """Flat file only: visit samples in a seeded random order (Megatron datasets always shuffle by the seed)."""

    @property
    def indexed(self) -> bool:
        """Whether this is Megatron indexed data."""
        return bool(self.prefixes)

    def prefix_path(self, k: int) -> str:
        """The YAML path of prefix `k` (for error messages)."""
        if self.weights is not None:
            return f"train.data.prefixes[{2 * k + 1}]"
        return f"train.data.prefixes[{k}]" if len(self.prefixes) > 1 else "train.data.prefixes"

    def megatron_data_path(self) -> list:
        """`prefixes` as Megatron's `--data-path` writes it: `[w1, p1, w2, p2, ...]` or the prefixes."""
        if self.weights is None:
            return list(self.prefixes)
        return [x for w, p in zip(self.weights, self.prefixes) for x in (w, p)]

    def to_dict(self) -> dict:
        """Plain data in the job YAML's schema."""
        if not self.indexed:
            return {"path": self.path, "dtype": self.dtype, "shuffle": self.shuffle}
        out = {"prefixes": self.megatron_data_path(), "split": self.split}
        return out if self.dtype is None else {**out, "dtype": self.dtype}


def parse_data(sec: Section, problems: Problems) -> DataSpec | None:
    """Build a `DataSpec` from `train.data`; every problem is recorded with its path."""
    path = sec.string("path", None)
    raw_prefixes = sec.raw("prefixes", None)
    dtype = sec.string("dtype", None, choices=TOKEN_DTYPES)
    shuffle = sec.boolean("shuffle", None)
    split = _split(sec, problems) if sec.has("split") else DEFAULT_SPLIT
    sec.finish()
    if path is None and raw_prefixes is None:
        if sec.valid and not sec.has("path"):
            problems.add(sec.path, "set path (a flat token file) or prefixes (Megatron .bin/.idx datasets)")
        return None
    if raw_prefixes is None:
        if sec.has("split"):
            problems.add(sec.at("split"), "applies to Megatron datasets (prefixes) only, not to a token file")
            return None
        if not sec.valid:
            return None
        return DataSpec(path=path, dtype=dtype or "uint16", shuffle=True if shuffle is None else shuffle)
    if path is not None:
        problems.add(sec.at("prefixes"), "set either path (a flat token file) or prefixes (Megatron datasets), "
                                         "not both")
        return None
    if shuffle is not None:
        problems.add(sec.at("shuffle"), "Megatron datasets are always shuffled by train.seed (as GPTDataset "
                                        "does); remove it")
        return None
    blend = parse_blend(raw_prefixes, sec.at("prefixes"), problems)
    if blend is None or split is None or not sec.valid:
        return None
    prefixes, weights = blend
    return DataSpec(prefixes=prefixes, weights=weights, split=split, dtype=dtype)


def parse_blend(raw: object, path: str, problems: Problems) -> tuple[tuple[str, ...], tuple[float, ...] | None] | None:
    """Megatron's `--data-path` value: one prefix, prefixes, or `[w1, p1, w2, p2, ...]` (weights above 0)."""
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        problems.add(path, f"expected a prefix or a list [w1, prefix1, w2, prefix2, ...], got {type_name(raw)}"
                     if not isinstance(raw, list) else "is empty")
        return None
    numeric = [_number(x) for x in raw]
    weighted = len(raw) % 2 == 0 and all(n is not None for n in numeric[0::2])
    if not weighted and len(raw) % 2 == 0 and any(n is not None for n in numeric[0::2]):
        problems.add(path, "mixes weights and prefixes: write [w1, prefix1, w2, prefix2, ...] or prefixes only")
        return None
    ok, prefixes, weights = True, [], []
    for i, item in enumerate(raw):
        where = join_path(path, i) if len(raw) > 1 else path
        if weighted and i % 2 == 0:
            weight = numeric[i]
            if not math.isfinite(weight) or weight <= 0:
                problems.add(where, f"a blend weight must be a finite number above 0, got {item!r}")
                ok = False
            weights.append(weight)
            continue
        if not isinstance(item, str) or numeric[i] is not None or not item.strip():
            problems.add(where, f"expected a dataset prefix (PREFIX names PREFIX.bin and PREFIX.idx), got "
                                f"{type_name(item)} {item!r}" + ("; weights come first in each pair: [w1, prefix1, "
                                                                 "...]" if numeric[i] is not None else ""))
            ok = False
            continue
        prefix = item.strip()
        if prefix.endswith((".bin", ".idx")):
            problems.add(where, f"a prefix names the files without their suffix: use {prefix[:-4]!r}")
            ok = False
        prefixes.append(prefix)
    if not ok:
        return None
    return tuple(prefixes), (tuple(weights) if weighted else None)


def _number(item: object) -> float | None:
    """A weight as Megatron reads one (`float(x)`), or None when `item` is not a number."""
    if isinstance(item, bool):
        return None
    if isinstance(item, (int, float)):
        return float(item)
    if isinstance(item, str):
        try:
            return float(item)
        except ValueError:
            return None
    return None


def _split(sec: Section, problems: Problems) -> str | None:
    raw = sec.raw("split", None)
    text = str(raw) if isinstance(raw, (str, int, float)) and not isinstance(raw, bool) else None
    if text is None or not _SPLIT.match(text):
        problems.add(sec.at("split"), f"expected train,valid,test shares such as '969,30,1', got {type_name(raw)} "
                                      f"{raw!r}")
        return None
    try:
        shares = [float(x) for x in re.findall(r"[0-9.]+", text)]
    except ValueError:
        problems.add(sec.at("split"), f"expected train,valid,test shares such as '969,30,1', got {raw!r}")
        return None
    if not all(math.isfinite(s) for s in shares) or sum(shares) <= 0:
        problems.add(sec.at("split"), f"the shares must add up to more than 0, got {raw!r}")
        return None
    if shares[0] <= 0:
        problems.add(sec.at("split"), f"the train share is 0 in {raw!r}: nothing to train on")
        return None
    return text.strip()
