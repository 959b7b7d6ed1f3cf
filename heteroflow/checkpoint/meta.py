"""Checkpoint metadata: what wrote it (model, train, plan), where training stands, RNG states.

All plain JSON: RNG states as lists, or base64 for torch's byte state.
"""

from __future__ import annotations

import base64
import random
from pathlib import Path

import numpy as np
import torch

from heteroflow.checkpoint.files import FORMAT, METADATA, READABLE_VERSIONS, read_checkpoint_json
from heteroflow.errors import UserError


def rng_state() -> dict:
    """This process's host RNG states (torch CPU, Python, NumPy) as JSON-able data."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss = random.getstate()
    return {"torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
            "python": {"version": version, "state": list(state), "gauss_next": gauss},
            "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)}}


def restore_rng(state: dict) -> None:
    """Set the host RNGs to a state from `rng_state()`."""
    try:
        raw = base64.b64decode(state["torch_cpu"], validate=True)
        torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        n = state["numpy"]
        np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise UserError(f"checkpoint RNG state is malformed: {exc}") from None


def read_metadata(step_dir: str | Path) -> dict:
    """The checkpoint's metadata, after checking its format and version."""
    step_dir = Path(step_dir)
    meta = read_checkpoint_json(step_dir, METADATA)
    if meta.get("format") != FORMAT:
        raise UserError(f"{step_dir} is not a heteroflow checkpoint ({METADATA} has format {meta.get('format')!r})")
    if meta.get("version") not in READABLE_VERSIONS:
        raise UserError(f"checkpoint {step_dir} has format version {meta.get('version')!r}; this heteroflow reads "
                        f"versions {', '.join(map(str, READABLE_VERSIONS))}")
    for key, kind in (("step", int), ("optimizer_steps", int), ("model", dict)):
        if not isinstance(meta.get(key), kind):
            raise UserError(f"checkpoint {step_dir}: {METADATA} lacks {key!r}")
    return meta


def model_differences(saved: dict, current: dict) -> list[str]:
    """`field: checkpoint X, job Y` for every model field that differs."""
    keys = sorted(set(saved) | set(current))
    return [f"{k}: checkpoint {saved.get(k)!r}, job {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]


def check_model(step_dir: str | Path, meta: dict, model: dict) -> None:
    """Refuse a checkpoint written for another model (a `UserError` listing every differing field)."""
    diffs = model_differences(meta["model"], model)
    if diffs:
        raise UserError(f"checkpoint {step_dir} was written for another model; its model spec differs from the "
                        "job's:\n  " + "\n  ".join(diffs) + "\nresume with the job that wrote it, or point "
                        "train.checkpoint.dir at another directory")


def train_differences(meta: dict, train: dict) -> list[str]:
    """Train settings that differ from the checkpoint's (allowed, but reported: they change the run)."""
    saved = meta.get("train") or {}
    keys = ("global_batch_size", "seed", "data", "lr", "min_lr", "warmup_steps", "steps", "weight_decay",
            "grad_clip", "adam_beta1", "adam_beta2", "adam_eps", "precision", "loss_scale")
    return [f"train.{k}: checkpoint {saved.get(k)!r}, job {train.get(k)!r}"
            for k in keys if saved.get(k) != train.get(k)]
