"""The reward combination, a torch-free leaf module: a row's total reward is the weighted sum of its reward
components (the `reward/<name>` columns). rollout sums them for its progress line and for DAPO's dynamic sampling,
sft's rejection sampling filters on the totals, update trains on them (`rlkit.algorithms.inputs`)."""

from __future__ import annotations

import math

from rlkit.errors import RlkitError


def combine_rewards(columns: dict[str, list[float]],
                    weights: dict[str, float] | None) -> tuple[list[float], dict[str, float]]:
    """Weighted sum of reward components (default: each present component with weight 1), summed in float64
    (sft's --min-reward compares float64 totals: 0.7 in float32 is below 0.7). -> (one total a row, the weights
    used)."""
    if not columns:
        raise RlkitError("the input has no reward/<component> columns; sample with a task that has a verifier")
    w = dict(weights) if weights else {name: 1.0 for name in columns}
    missing = sorted(set(w) - set(columns))
    if missing:
        raise RlkitError(f"--reward names {missing}, but the input only has components {sorted(columns)}")
    total = [0.0] * len(next(iter(columns.values())))
    for name, weight in w.items():
        if any(v is None for v in columns[name]):
            raise RlkitError(f"reward component {name!r} has missing values")
        vals = [float(v) for v in columns[name]]
        cause = _non_finite_cause(f"the input table's reward/{name}", vals)
        if cause:  # an inf reward makes every advantage of its group NaN
            raise RlkitError(cause)
        total = [t + weight * v for t, v in zip(total, vals, strict=True)]
    return total, w


def _non_finite_cause(what: str, vals: list[float]) -> str | None:
    """`rlkit.errors.non_finite_cause`'s line for one column of floats: "WHAT holds NaN in 3 of 64 rows"."""
    found = [k for k, bad in (("NaN", any(math.isnan(v) for v in vals)), ("inf", any(math.isinf(v) for v in vals)))
             if bad]
    if not found:
        return None
    rows = sum(not math.isfinite(v) for v in vals)
    return f"{what} holds {' and '.join(found)} in {rows} of {len(vals)} rows"
