"""The loss scale of a job that computes (some stages) in fp16: Megatron's grad scalers, torch-free.

One scale for the whole job. The last stage multiplies its loss by `scale` before backward, so every gradient,
the ones crossing stage boundaries included, carries it; the optimizer divides it out (with the clip
coefficient) before the update. A step whose gradients hold an inf or nan anywhere is skipped on every rank and
the scale backs off; the world all-reduce of the squared-norm shares already tells every rank.

`update(found_inf)` follows Megatron's `DynamicGradScaler` (megatron/core/optimizer/grad_scaler.py): an
overflow resets the growth tracker and takes one from the hysteresis tracker; once that is used up, every
overflow multiplies the scale by `backoff_factor` (not below `min_scale`). `growth_interval` clean steps in a
row multiply it by `growth_factor` and refill the hysteresis tracker. A static scale (Megatron's
`ConstantGradScaler`) never changes; its overflowing steps are still skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from heteroflow.errors import UserError

BACKOFF_FACTOR = 0.5
GROWTH_FACTOR = 2.0
_STATE_KEYS = ("scale", "growth_tracker", "hysteresis_tracker")


@dataclass(kw_only=True, slots=True)
class LossScaler:
    """The scale and its trackers; `dynamic=False` keeps `scale` fixed."""

    scale: float
    dynamic: bool = True
    min_scale: float = 1.0
    growth_interval: int = 1000
    """Megatron's `--loss-scale-window`: clean steps in a row before the scale grows."""
    hysteresis: int = 2
    """Overflows tolerated (since the last growth) before the scale backs off."""
    backoff_factor: float = BACKOFF_FACTOR
    growth_factor: float = GROWTH_FACTOR
    growth_tracker: int = 0
    """Clean steps since the last overflow or growth."""
    hysteresis_tracker: int | None = None
    """Overflows still tolerated before a back-off; starts at `hysteresis`."""
    stuck_overflows: int = 0
    """Overflowing steps in a row at a scale that cannot go lower (min scale, or a static scale)."""

    def __post_init__(self) -> None:
        if self.hysteresis_tracker is None:
            self.hysteresis_tracker = self.hysteresis

    @classmethod
    def for_job(cls, train, precisions) -> "LossScaler | None":
        """The scaler `train` (a `TrainSpec`) asks for when its stages compute in `precisions`: its
        `loss_scale` (`dynamic` or a number), else dynamic when any stage is fp16, else None (no scaling)."""
        setting = train.loss_scale
        if setting is None:
            setting = "dynamic" if "fp16" in precisions else None
        if setting is None:
            return None
        if setting == "dynamic":
            return cls(scale=float(train.initial_loss_scale), min_scale=float(train.min_loss_scale),
                       growth_interval=int(train.loss_scale_window), hysteresis=int(train.hysteresis))
        return cls(scale=float(setting), dynamic=False)

    @property
    def stuck(self) -> bool:
        """Whether the scale cannot back off any further."""
        return not self.dynamic or self.scale <= self.min_scale

    def update(self, found_inf: bool) -> None:
        """After a step: back off on an overflow (per hysteresis), grow after `growth_interval` clean steps."""
        self.stuck_overflows = self.stuck_overflows + 1 if found_inf and self.stuck else 0
        if not self.dynamic:
            return
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        """The state a checkpoint keeps (Megatron's keys), plain JSON."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from `state_dict()`'s output; a static scale keeps the job's own value."""
        bad = [k for k in _STATE_KEYS if not isinstance(state.get(k), (int, float)) or isinstance(state.get(k), bool)
               or not math.isfinite(state[k])]
        if bad or state["scale"] <= 0:
            raise UserError(f"checkpoint loss-scaler state is malformed: {dict(state)!r}")
        if not self.dynamic:
            return
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
