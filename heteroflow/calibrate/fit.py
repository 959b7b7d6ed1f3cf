"""Fitting calibration factors to measured runs: damped Gauss-Newton on log step times with a ridge prior.

The unknowns are the log of each factor (`stagemap.calibration.FACTORS`) of each device type the runs'
plans use. With `r_i(theta) = log(predicted_i(theta)) - log(measured_i)` the fit minimizes

    sum_i r_i(theta)^2 + prior_weight^2 * theta' P theta

(the prior pulls every factor toward 1.0, the uncalibrated model). The prior is hierarchical: each log factor of
a device type is that type's common log factor plus its own deviation, both centred on 0, the common one with
`COMMON_SHARE` times the variance of the other (P = `prior_precision`). A factor of a time (`TIME_FACTORS`: the
host overhead) takes the common log factor with the opposite sign: a slow stack has slow rates and a large
overhead. A stack whose runs show slow GEMMs is then taken to be somewhat slow in what the runs cannot separate
too (its collectives, its host overhead), instead of exactly as fast there as the catalog says, which made a fit
from few runs push the whole misfit into the factor the runs are most sensitive to (the GEMM rate) and misorder
held-out plans that differ in their share of communication.
The Jacobian is taken numerically on the cost model itself (`evaluate_plan`), so whatever the model does with a
rate, the fit sees. A factor is "not pinned down" when the runs do not determine it: its diagonal entry of the
resolution matrix `(J'J + w^2 P)^-1 J'J` is below `PINNED_RESOLUTION` (no sensitivity at all, or one that other
factors can trade against, as in a rank-deficient Jacobian); it then stays near its prior: between 1.0 and where
the device type's pinned factors went (in log, `COMMON_SHARE / (1 + COMMON_SHARE)` of the way; the other way for
a time factor).

With `stage_parts`, the residuals also hold `PART_WEIGHT * (log(predicted) - log(measured))` of each stage's
measured parts (`calibrate.runs.FIT_PARTS`) against the cost model's split of the same step
(`stagemap.breakdown`).
Emulated runs fit one set of factors (`emulated.gemm`, ...), written for every device type of the cluster:
an emulated rank is a local CPU process whatever its label, so what one label's stages measured holds for all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from heteroflow.calibrate.runs import Run, part_seconds
from heteroflow.errors import UserError
from heteroflow.stagemap.calibration import FACTOR_LIMIT, FACTORS, TIME_FACTORS, Calibration, DeviceFactors
from heteroflow.stagemap.estimate import UNCALIBRATED, evaluate_plan, resolve_profile

PRIOR_WEIGHT = 0.05
"""Weight of the prior in log space: a factor of 2 costs as much as a 3.5% misfit of one run."""
PINNED_RESOLUTION = 0.5
STEP_LOG = 1e-3
"""Finite-difference step on a log-factor."""
MAX_ITERATIONS = 50
COMMON_SHARE = 0.5
"""Prior variance of a device type's common log factor, relative to each factor's own deviation from it: a
stack is expected to be somewhat slow (or fast) across the board, more in some rates than in others."""
PART_WEIGHT = 0.5
"""With `stage_parts`, weight of one stage part's log misfit relative to a run's step time."""
EMULATED = "emulated"
"""The name of the one set of factors of emulated runs (every device type is the local CPU there)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """The fitted calibration and how well it explains each run."""

    calibration: Calibration
    params: tuple[str, ...]
    """`DEVICE_TYPE.factor` of every fitted unknown."""
    sensitivity: tuple[float, ...]
    """Per unknown, the largest |d log(step time) / d log(factor)| over the runs."""
    resolution: tuple[float, ...]
    """Per unknown, how much the runs (not the prior) determine it (0 to 1)."""
    predicted_before_s: tuple[float, ...]
    predicted_after_s: tuple[float, ...]
    runs: tuple[Run, ...]


def fit_calibration(runs: list[Run], *, factors: tuple[str, ...] = FACTORS,
                    prior_weight: float = PRIOR_WEIGHT, stage_parts: bool = False) -> Fit:
    """Fit `factors` of every device type the runs use, from their measured step times and, with `stage_parts`,
    also each stage's measured parts (`Run.measured_parts`, weighted `PART_WEIGHT`): a run then pins down the
    compute, collective and dp factors of each device type separately instead of one combination of them."""
    modes = {run.emulate for run in runs}
    if len(modes) > 1:
        emulated = [r.source for r in runs if r.emulate][:3]
        raise UserError("the runs mix emulated and real runs (emulated: " + ", ".join(emulated) + "); "
                        "calibrate each kind separately: an emulated rank is a CPU process, whatever its label")
    emulate = modes.pop()
    unknown = [f for f in factors if f not in FACTORS]
    if unknown:
        raise UserError(f"--factors: unknown factor {unknown[0]!r}; choose among {', '.join(FACTORS)}")
    if emulate:
        # Every emulated rank is the same local CPU whatever its label: one set of factors, shared by every
        # device type of the cluster (a label the runs did not use is still this CPU).
        device_types = sorted({n.device for run in runs for n in run.job.cluster.nodes})
        params = [(EMULATED, f) for f in factors]
    else:
        device_types = sorted({stage.device_type for run in runs for stage in run.plan.stages})
        params = [(d, f) for d in device_types for f in factors]
    profiles = [resolve_profile(run.job, None) for run in runs]  # read once, not at every evaluation
    parts = [run.measured_parts if stage_parts else () for run in runs]
    if stage_parts:  # a part the uncalibrated model does not price (no tp collective) cannot be fitted
        priced = [evaluate_plan(run.job, run.plan, profile=profile, emulate=run.emulate, calibration=UNCALIBRATED)
                  for run, profile in zip(runs, profiles)]
        parts = [tuple((k, part, v) for k, part, v in found if part_seconds(est.stages[k].times.to_dict(), part) > 0)
                 for found, est in zip(parts, priced)]
    measured = np.concatenate([np.log([run.measured_step_time_s for run in runs]),
                               PART_WEIGHT * np.log([v for found in parts for _, _, v in found] or np.ones(0))])

    def calibration_of(theta: np.ndarray) -> Calibration:
        values: dict[str, dict[str, float]] = {d: {} for d in device_types}
        for (d, f), t in zip(params, theta):
            for name in device_types if d == EMULATED else (d,):
                values[name][f] = math.exp(t)
        return Calibration(factors={d: DeviceFactors(**v) for d, v in values.items()}, num_runs=len(runs),
                           emulate=emulate)

    def log_predicted(theta: np.ndarray) -> np.ndarray:
        calibration = calibration_of(theta) if len(theta) else UNCALIBRATED
        estimates = [evaluate_plan(run.job, run.plan, profile=profile, emulate=run.emulate, calibration=calibration)
                     for run, profile in zip(runs, profiles)]
        part_values = [part_seconds(est.stages[k].times.to_dict(), part)
                       for est, found in zip(estimates, parts) for k, part, _ in found]
        return np.concatenate([np.log([est.step_time_s for est in estimates]),
                               PART_WEIGHT * np.log(part_values or np.ones(0))])

    def jacobian(theta: np.ndarray, base: np.ndarray) -> np.ndarray:
        columns = []
        for j in range(len(theta)):
            shifted = theta.copy()
            shifted[j] += STEP_LOG
            columns.append((log_predicted(shifted) - base) / STEP_LOG)
        return np.stack(columns, axis=1) if columns else np.zeros((len(base), 0))

    start = log_predicted(np.zeros(len(params)))  # all factors 1.0: the uncalibrated model
    prior = prior_weight ** 2 * prior_precision(params)
    theta, prediction = _solve(log_predicted, jacobian, measured, prior, start)
    jac = jacobian(theta, prediction)
    gram = jac.T @ jac
    resolution = np.diag(np.linalg.solve(gram + prior, gram)) if params else []
    names = tuple(f"{d}.{f}" for d, f in params)
    not_pinned = tuple(n for n, r in zip(names, resolution) if r < PINNED_RESOLUTION)
    before = start[:len(runs)].tolist()  # the step times; the parts follow them
    after = np.exp(prediction[:len(runs)]).tolist()
    records = tuple({"source": run.source, "measured_step_time_s": _g(run.measured_step_time_s),
                     "predicted_before_s": _g(math.exp(b)), "predicted_after_s": _g(a),
                     "ratio_before": round(math.exp(b) / run.measured_step_time_s, 4),
                     "ratio_after": round(a / run.measured_step_time_s, 4)}
                    for run, b, a in zip(runs, before, after))
    calibration = calibration_of(theta)
    calibration = Calibration(factors=calibration.factors, num_runs=len(runs), emulate=emulate,
                              not_pinned_down=not_pinned, runs=records)
    return Fit(calibration=calibration, params=names, sensitivity=tuple(float(np.abs(c).max()) for c in jac.T),
               resolution=tuple(float(r) for r in resolution), predicted_before_s=tuple(math.exp(b) for b in before),
               predicted_after_s=tuple(after), runs=tuple(runs))


def prior_precision(params: list[tuple[str, str]]) -> np.ndarray:
    """The prior's precision matrix over the log factors `params` (`(device type, factor)` pairs), in units of
    `prior_weight ** 2`: the inverse of the covariance `I + COMMON_SHARE * S`, where `S[i, j]` is `s_i * s_j`
    when factors i and j belong to one device type and 0 otherwise, `s` being -1 for a factor of a time
    (`TIME_FACTORS`) and 1 for one of a rate (see the module docstring)."""
    sign = [-1.0 if f in TIME_FACTORS else 1.0 for _, f in params]
    same = np.array([[float(d == e) * si * sj for (e, _), sj in zip(params, sign)]
                     for (d, _), si in zip(params, sign)]).reshape(len(params), len(params))
    return np.linalg.inv(np.eye(len(params)) + COMMON_SHARE * same)


def _solve(log_predicted, jacobian, measured: np.ndarray, prior: np.ndarray,
           start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Levenberg-Marquardt on `|log_predicted(theta) - measured|^2 + theta' prior theta` from theta = 0;
    returns theta and log_predicted(theta)."""
    k = len(prior)
    theta, prediction = np.zeros(k), start
    if k == 0:
        return theta, prediction
    low, high = math.log(FACTOR_LIMIT[0]), math.log(FACTOR_LIMIT[1])

    def cost(t: np.ndarray, p: np.ndarray) -> float:
        return float(np.sum((p - measured) ** 2) + t @ prior @ t)

    damping, current = 1e-3, cost(theta, prediction)
    for _ in range(MAX_ITERATIONS):
        jac = jacobian(theta, prediction)
        gram = jac.T @ jac + prior
        gradient = jac.T @ (prediction - measured) + prior @ theta
        improved = False
        while damping < 1e8:
            step = np.linalg.solve(gram + damping * np.diag(np.diag(gram)), gradient)
            trial = np.clip(theta - step, low, high)
            trial_prediction = log_predicted(trial)
            trial_cost = cost(trial, trial_prediction)
            if trial_cost < current:
                theta, prediction, current = trial, trial_prediction, trial_cost
                damping = max(damping / 10, 1e-9)
                improved = True
                break
            damping *= 10
        if not improved or np.max(np.abs(step)) < 1e-7:
            break
    return theta, prediction


def _g(value: float) -> float:
    return float(f"{value:.6g}")
