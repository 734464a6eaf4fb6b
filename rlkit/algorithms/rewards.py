"""The reward a row trains on: its components (`reward/<name>` columns and the shaping ones) weighed and summed
(`combine_rewards`), shared by rollout, sft's rejection sampling and update.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkit.errors import RlkitError, non_finite_cause


def combine_rewards(columns: dict[str, list[float]], weights: dict[str, float] | None,
                    dtype: torch.dtype = torch.float32) -> tuple[Tensor, dict[str, float]]:
    """Weighted sum of reward components (default: each present component with weight 1), summed in float64 and
    returned as `dtype` (sft's --min-reward compares float64 totals: 0.7 in float32 is below 0.7)."""
    if not columns:
        raise RlkitError("the input has no reward/<component> columns; sample with a task that has a verifier")
    w = dict(weights) if weights else {name: 1.0 for name in columns}
    missing = sorted(set(w) - set(columns))
    if missing:
        raise RlkitError(f"--reward names {missing}, but the input only has components {sorted(columns)}")
    total = torch.zeros(len(next(iter(columns.values()))), dtype=torch.float64)
    for name, weight in w.items():
        if any(v is None for v in columns[name]):
            raise RlkitError(f"reward component {name!r} has missing values")
        vals = torch.tensor(columns[name], dtype=torch.float64)
        cause = non_finite_cause({f"the input table's reward/{name}": vals})
        if cause:  # an inf reward makes every advantage of its group NaN
            raise RlkitError(cause)
        total += weight * vals
    return total.to(dtype), w
