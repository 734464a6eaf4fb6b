"""Advantage estimators for outcome rewards, chosen by name from `ADVANTAGES`.

Each takes per-sequence rewards (N,) and group ids (N,) (the samples of one prompt share a group)
and returns per-sequence advantages (N,), broadcast over tokens by the loss. A group whose rewards
are all equal carries no signal and gets advantage 0 from every group-based estimator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _group_stats(rewards: Tensor, groups: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sequence (group mean, group unbiased std, group size, group sum), each (N,)."""
    _, inv = torch.unique(groups, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    r = rewards.double()
    size = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, torch.ones_like(r))
    total = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, r)
    mean = total / size
    sq = torch.zeros(G, dtype=torch.float64).index_add_(0, inv, (r - mean[inv]) ** 2)
    std = (sq / (size - 1).clamp(min=1)).sqrt()
    return mean[inv], std[inv], size[inv], total[inv]


def grpo(rewards: Tensor, groups: Tensor, eps: float = 1e-6) -> Tensor:
    """(r - group mean) / (group std + eps)  (DeepSeekMath GRPO). (N,), (N,) -> (N,)."""
    mean, std, _, _ = _group_stats(rewards, groups)
    return ((rewards.double() - mean) / (std + eps)).float()


def dr_grpo(rewards: Tensor, groups: Tensor, eps: float = 1e-6) -> Tensor:  # noqa: ARG001
    """r - group mean: no std division (Dr. GRPO, "Understanding R1-Zero-like training"). (N,) -> (N,)."""
    mean, _, _, _ = _group_stats(rewards, groups)
    return (rewards.double() - mean).float()


def rloo(rewards: Tensor, groups: Tensor, eps: float = 1e-6) -> Tensor:  # noqa: ARG001
    """r - mean of the *other* samples of the group (REINFORCE leave-one-out). (N,) -> (N,).

    A group of one has no baseline; its advantage is 0.
    """
    _, _, size, total = _group_stats(rewards, groups)
    r = rewards.double()
    base = (total - r) / (size - 1).clamp(min=1)
    return torch.where(size > 1, r - base, torch.zeros_like(r)).float()


def reinforce_pp(rewards: Tensor, groups: Tensor, eps: float = 1e-6) -> Tensor:  # noqa: ARG001
    """(r - batch mean) / (batch std + eps): REINFORCE++'s global batch normalisation. (N,) -> (N,)."""
    r = rewards.double()
    std = r.std() if r.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return ((r - r.mean()) / (std + eps)).float()


ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo, "dr-grpo": dr_grpo, "rloo": rloo, "reinforce-pp": reinforce_pp,
}


def degenerate_groups(rewards: Tensor, groups: Tensor) -> tuple[Tensor, int, int]:
    """(per-sequence mask of rows in all-equal groups (N,) bool, degenerate group count, group count)."""
    _, std, _, _ = _group_stats(rewards, groups)
    mask = std == 0
    uniq, inv = torch.unique(groups, return_inverse=True)
    per_group = torch.zeros(len(uniq), dtype=torch.bool).index_put_((inv,), mask)
    return mask, int(per_group.sum()), len(uniq)
