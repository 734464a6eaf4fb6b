"""Pairwise preference losses: the Bradley-Terry reward-model loss and DPO.

Every function works on one score or summed sequence log-prob per pair member, (P,) each, and
returns per-pair values (P,) without reduction; the caller aggregates. `PAIR_LOSSES` names the
reward-model losses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, margin: float | Tensor = 0.0) -> Tensor:
    """-log sigmoid(s_chosen - s_rejected - margin) per pair (Bradley-Terry; InstructGPT's RM loss,
    with Llama 2's optional margin). (P,), (P,) [, () or (P,)] -> (P,).

    Computed with `logsigmoid`, so a large score gap neither overflows nor loses the gradient.
    """
    return -F.logsigmoid(chosen - rejected - margin)


def pair_accuracy(chosen: Tensor, rejected: Tensor) -> float:
    """Fraction of pairs with s_chosen > s_rejected; a tie counts as wrong. (P,), (P,) -> float.

    No pairs -> nan (there is nothing to be right about).
    """
    if chosen.numel() == 0:
        return float("nan")
    return float((chosen > rejected).float().mean())


def dpo_loss(pi_chosen: Tensor, pi_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
             beta: float, label_smoothing: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Direct Preference Optimization loss (Rafailov et al. 2023), with conservative-DPO label smoothing.

    Inputs are summed sequence log-probs of each completion, (P,) each, under the policy (pi_*) and
    the frozen reference (ref_*). With h = (pi_c - ref_c) - (pi_r - ref_r) and ls = label_smoothing:
        loss = -(1 - ls) * log sigmoid(beta * h) - ls * log sigmoid(-beta * h)
    ls is the assumed probability that a label is flipped (cDPO); ls = 0 is plain DPO.
    -> (loss (P,), chosen_reward (P,), rejected_reward (P,)); the implicit rewards
    beta * (pi - ref) are detached (for logging: reward margin and accuracy).
    """
    h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    logits = beta * h
    loss = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    chosen_reward = (beta * (pi_chosen - ref_chosen)).detach()
    rejected_reward = (beta * (pi_rejected - ref_rejected)).detach()
    return loss, chosen_reward, rejected_reward


PAIR_LOSSES: dict[str, Callable[..., Tensor]] = {"bradley-terry": bradley_terry_loss}
