"""Advantage estimators for outcome rewards, chosen by name from `ADVANTAGES`.

Each takes per-sequence rewards (N,), group ids (N,) (the samples of one prompt share a group) and
optionally the number of completion tokens per sequence `lengths` (N,), and returns per-sequence
advantages (N,), broadcast over tokens by the loss.

Edge cases, decided:
- A group whose rewards are all equal carries no signal and gets advantage 0 from every group-based
  estimator (grpo, dr-grpo, rloo).
- A group of one sample has no baseline to compare with and also gets advantage 0 from every
  group-based estimator. verl hands it its raw reward instead (mean 0, std 1), which pushes every
  singleton up or down by the reward's own scale (a reward model's score of -1.7 becomes a strong
  push down whatever the answer), on another scale than its neighbours' normalised advantages. rlkit
  counts singleton groups (`degenerate_groups`) and `update` warns when a batch has them; sample
  `--n` >= 2 or use reinforce-pp, whose baseline is the whole batch.
- reinforce-pp whitens over *tokens*: each sequence weighs as many times as it has completion tokens,
  as in REINFORCE++'s own code (OpenRLHF) and verl, so the advantage is centred under the same
  token weights its default `token-mean` loss uses. Without `lengths` every sequence weighs once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor


def _group_stats(rewards: Tensor, groups: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sequence (group mean, group unbiased std, group size, group sum), each (N,)."""
    _, inv = torch.unique(groups, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    r = rewards.double()
    size = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, inv, torch.ones_like(r))
    total = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, inv, r)
    mean = total / size
    sq = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, inv, (r - mean[inv]) ** 2)
    std = (sq / (size - 1).clamp(min=1)).sqrt()
    return mean[inv], std[inv], size[inv], total[inv]


def grpo(rewards: Tensor, groups: Tensor, lengths: Tensor | None = None, eps: float = 1e-6) -> Tensor:  # noqa: ARG001
    """(r - group mean) / (group std + eps)  (DeepSeekMath GRPO). (N,), (N,) -> (N,).

    A group of one gets 0 (its r - mean is 0): no baseline, no signal."""
    mean, std, _, _ = _group_stats(rewards, groups)
    return ((rewards.double() - mean) / (std + eps)).float()


def dr_grpo(rewards: Tensor, groups: Tensor, lengths: Tensor | None = None, eps: float = 1e-6) -> Tensor:  # noqa: ARG001
    """r - group mean: no std division (Dr. GRPO, "Understanding R1-Zero-like training"). (N,) -> (N,).

    A group of one gets 0."""
    mean, _, _, _ = _group_stats(rewards, groups)
    return (rewards.double() - mean).float()


def rloo(rewards: Tensor, groups: Tensor, lengths: Tensor | None = None, eps: float = 1e-6) -> Tensor:  # noqa: ARG001
    """r - mean of the *other* samples of the group (REINFORCE leave-one-out). (N,) -> (N,).

    A group of one has no baseline; its advantage is 0.
    """
    _, _, size, total = _group_stats(rewards, groups)
    r = rewards.double()
    base = (total - r) / (size - 1).clamp(min=1)
    return torch.where(size > 1, r - base, torch.zeros_like(r)).float()


def reinforce_pp(rewards: Tensor, groups: Tensor, lengths: Tensor | None = None, eps: float = 1e-6) -> Tensor:  # noqa: ARG001
    """REINFORCE++'s global batch normalisation, over tokens: (r - mean) / (std + eps) where the mean
    and the unbiased std are taken over every completion token of the batch, each carrying its
    sequence's reward (so a sequence weighs `lengths` times; REINFORCE++'s code and verl do this).
    lengths None: every sequence weighs once. Rows of length 0 get an advantage but weigh nothing.
    (N,), (N,), (N,) -> (N,).
    """
    r = rewards.double()
    w = torch.ones_like(r) if lengths is None else lengths.double()
    n = w.sum()
    if n <= 0:
        return torch.zeros_like(rewards, dtype=torch.float32)
    mean = (w * r).sum() / n
    var = (w * (r - mean) ** 2).sum() / (n - 1) if n > 1 else torch.zeros((), dtype=torch.float64, device=r.device)
    return ((r - mean) / (var.sqrt() + eps)).float()


def teacher_advantage(old_logp: Tensor, teacher_logp: Tensor, mask: Tensor, coef: float) -> Tensor:
    """On-policy distillation's per-token advantage (Agarwal et al. 2024, GKD; Thinking Machines' on-policy
    distillation, tinker's `kl_penalty_coef`, discount 0): -coef * (log pi_old - log pi_teacher) on each sampled
    token, so the policy gradient descends the reverse KL(pi || pi_teacher) on the policy's own samples; each
    token is judged alone (no return over later tokens). 0 off the mask.
    (N, C), (N, C), (N, C) bool -> (N, C). Example: coef 1, log pi_old -2, log pi_teacher -0.5 gives +1.5."""
    gap = torch.where(mask.bool(), old_logp.float() - teacher_logp.float(), 0.0)
    return -coef * gap


def teacher_kl(old_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> float:
    """The reverse KL to the teacher per sampled token, k1 on the policy's own samples:
    mean of log pi_old - log pi_teacher over the mask. (N, C), (N, C), (N, C) bool -> float (0.0 for no tokens)."""
    m = mask.bool()
    n = int(m.sum())
    return float(torch.where(m, old_logp.double() - teacher_logp.double(), 0.0).sum() / n) if n else 0.0


ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo, "dr-grpo": dr_grpo, "rloo": rloo, "reinforce-pp": reinforce_pp,
}
# Estimators whose baseline is the sample's own group (a group of one gets advantage 0).
GROUP_BASELINE = ("grpo", "dr-grpo", "rloo")


class GroupCounts(NamedTuple):
    degenerate_mask: Tensor  # (N,) bool: rows in all-equal groups (groups of one included)
    degenerate: int  # all-equal groups, groups of one included
    singletons: int  # groups of one sample
    groups: int


def degenerate_groups(rewards: Tensor, groups: Tensor) -> GroupCounts:
    """Rows in all-equal groups (N,) bool, and the counts of degenerate groups, groups of one, groups."""
    _, std, size, _ = _group_stats(rewards, groups)
    mask = std == 0
    uniq, inv = torch.unique(groups, return_inverse=True)
    per_group = torch.zeros(len(uniq), dtype=torch.bool, device=mask.device).index_put_((inv,), mask)
    single = torch.zeros(len(uniq), dtype=torch.bool, device=mask.device).index_put_((inv,), size == 1)
    return GroupCounts(mask, int(per_group.sum()), int(single.sum()), len(uniq))
