"""The allowed range of every number heteroflow reads from a config file or a command-line flag.

Every number must be finite (no NaN, no infinity) and inside its range; a YAML float such as `1e30` is
never taken as an integer beyond the range. The limits are generous: far above any real cluster, model
or run, but low enough that a typo cannot make the planner loop for hours or build 1e30 device entries.
They live here, in one place, so the config reader, the CLI flags and the Megatron importer agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Range:
    """Allowed values of one number: finite, within `[minimum, maximum]` (either end may be open)."""

    minimum: float | None = None
    maximum: float | None = None
    min_exclusive: bool = False
    """True: the value must be above `minimum` (e.g. a learning rate above 0)."""
    max_exclusive: bool = False
    """True: the value must be below `maximum` (e.g. an Adam beta below 1)."""

    def describe(self) -> str:
        """`between 1 and 1024`, `above 0 and at most 10`, `at least 0`, ..."""
        low = None if self.minimum is None else f"{'above' if self.min_exclusive else 'at least'} {_show(self.minimum)}"
        high = None if self.maximum is None else f"{'below' if self.max_exclusive else 'at most'} {_show(self.maximum)}"
        if low and high and not (self.min_exclusive or self.max_exclusive):
            return f"between {_show(self.minimum)} and {_show(self.maximum)}"
        return " and ".join(p for p in (low, high) if p) or "finite"

    def problem(self, value: float) -> str | None:
        """What is wrong with `value` (a number, not a boolean), or None when it is allowed."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number {self.describe()}, got {_show(value)}"
        too_low = self.minimum is not None and (value <= self.minimum if self.min_exclusive else value < self.minimum)
        too_high = self.maximum is not None and (value >= self.maximum if self.max_exclusive else value > self.maximum)
        if too_low or too_high:
            return f"must be {self.describe()}, got {_show(value)}"
        return None


def _show(value: float) -> str:
    """A number as a user wrote it: integers in full (unless absurdly long), floats in %g."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value) if abs(value) < 10**30 else f"{value:.3e}"
    if math.isfinite(value) and value.is_integer() and abs(value) < 1e7:
        return str(int(value))
    return f"{value:g}"


def integers(minimum: int, maximum: int) -> Range:
    """Whole numbers from `minimum` to `maximum`, both included."""
    return Range(minimum, maximum)


def positive(maximum: float) -> Range:
    """Numbers above 0, at most `maximum`."""
    return Range(0.0, maximum, min_exclusive=True)


MAX_EXACT_INT = 2**53
"""Bound of an integer read without a range of its own: past it a float such as 1e30 is not an exact count."""

# --- cluster -----------------------------------------------------------------------------------------
MAX_NODES = 100_000
"""Nodes in one cluster (`cluster.nodes`, `--nnodes`)."""
DEVICES_PER_NODE = integers(1, 1024)
"""`cluster.nodes[i].count`, `--nproc-per-node`: real nodes have 1 to 16 accelerators."""
NUM_NODES = integers(1, MAX_NODES)
"""`import-megatron --nnodes`."""
NETWORK_GB_PER_S = positive(100_000.0)
"""`inter_node_gb_per_s`, device link bandwidths in GB/s (an 8x400 Gb/s node has 400 GB/s)."""
MEMORY_GIB = positive(65_536.0)
"""`memory_gib` of a device (the largest HBM today is under 300 GiB) or a host."""
TFLOPS = positive(1_000_000.0)
"""Peak TFLOP/s of one device (today's largest dense peaks are a few thousand)."""
MEMORY_GB_PER_S = positive(1_000_000.0)
"""`hbm_gb_per_s` and other memory bandwidths in GB/s."""
MAX_PARALLEL_DEGREE = MAX_NODES * 1024
"""Largest tp, dp, cp, ep of a stage: every device of the largest cluster."""
PARALLEL_DEGREE = integers(1, MAX_PARALLEL_DEGREE)

# --- model -------------------------------------------------------------------------------------------
NUM_LAYERS = integers(1, 10_000)
"""`model.num_layers` (the deepest published decoders have about 130)."""
HIDDEN_SIZE = integers(1, 1 << 20)
"""`model.hidden_size`, `ffn_hidden_size` (the widest published ones are under 100k)."""
NUM_HEADS = integers(1, 1 << 16)
"""`model.num_attention_heads`, `num_kv_heads`, `head_dim`."""
VOCAB_SIZE = integers(1, 1 << 26)
"""`model.vocab_size`, `--vocab-size` (published vocabularies are under 300k)."""
SEQ_LENGTH = integers(1, 1 << 26)
"""`model.seq_length` in tokens (64M; the longest trained contexts are about 10M)."""
ROPE_THETA = positive(1e12)
"""`model.rope_theta` (published bases go up to about 1e8)."""
NORM_EPS = positive(1.0)
"""`model.norm_eps` (1e-5 or 1e-6 in practice)."""

# --- train -------------------------------------------------------------------------------------------
GLOBAL_BATCH_SIZE = integers(1, 1 << 24)
"""`train.global_batch_size` in samples (16M)."""
MICRO_BATCH_SIZE = integers(1, 1 << 16)
"""`train.micro_batch_size`, `plan.micro_batch_size`, `--max-micro-batch-size`."""
STEPS = integers(1, 1_000_000_000)
"""`train.steps`, `--steps`, `train.checkpoint.interval`."""
WARMUP_STEPS = integers(0, 1_000_000_000)
"""`train.warmup_steps`."""
SEED = integers(0, 2**32 - 1)
"""`train.seed`: what numpy and Megatron accept as a seed."""
CHECKPOINTS_KEPT = integers(1, 1_000_000)
"""`train.checkpoint.keep`."""
LEARNING_RATE = positive(10.0)
"""`train.lr` (AdamW peaks are about 1e-4 to 1e-2)."""
MIN_LEARNING_RATE = Range(0.0, 10.0)
"""`train.min_lr` (and never above `lr`)."""
WEIGHT_DECAY = Range(0.0, 10.0)
"""`train.weight_decay`."""
GRAD_CLIP = Range(0.0, 1e9)
"""`train.grad_clip` (0 disables clipping)."""
ADAM_BETA = Range(0.0, 1.0, max_exclusive=True)
"""`train.adam_beta1`, `adam_beta2`."""
ADAM_EPS = positive(1.0)
"""`train.adam_eps`."""
LOSS_SCALE = positive(1e30)
"""`train.loss_scale` (a static scale), `initial_loss_scale`, `min_loss_scale` (Megatron starts at 2**32)."""
LOSS_SCALE_WINDOW = integers(1, 10**9)
"""`train.loss_scale_window`: overflow-free steps before the dynamic scale grows."""
HYSTERESIS = integers(1, 10**6)
"""`train.hysteresis`: overflows tolerated before the dynamic scale backs off."""

# --- plan --------------------------------------------------------------------------------------------
FILE_VERSION = integers(1, 1_000_000)
"""`plan.version`, `profile.version` (a version newer than this heteroflow's is reported on its own)."""

# --- profile (measured figures, `heteroflow profile`) -------------------------------------------------
MEASURED_GB_PER_S = Range(0.0, MEMORY_GB_PER_S.maximum)
"""Measured bandwidths in GB/s (0: not measured)."""
MEASURED_S = Range(0.0, 86_400.0)
"""Measured latencies and overheads in seconds."""
MEASURED_GIB = Range(0.0, MEMORY_GIB.maximum)
"""Measured memory sizes in GiB (0: not measured)."""
CPU_CORES = integers(1, 1 << 20)
"""`profile.host.cpu_cores`."""

# --- command-line flags ------------------------------------------------------------------------------
TIMEOUT_S = Range(1.0, 30 * 86_400.0)
"""`train --timeout`, `--join-timeout`, `--rejoin-timeout` in seconds: 1 s to 30 days."""
MAX_RESTARTS = integers(0, 10_000)
"""`train --max-restarts`."""
