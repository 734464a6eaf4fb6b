"""Policy losses: the clipped surrogate per token, kept apart from its aggregation (verl's
`agg_loss` pattern). Aggregation modes come from `AGGREGATIONS` by name."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def clipped_surrogate(logp: Tensor, old_logp: Tensor, adv: Tensor, clip_low: float = 0.2,
                      clip_high: float = 0.28) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped objective as a per-token loss, with asymmetric clipping (DAPO's clip-higher).

    logp, old_logp (B, T); adv (B,) or (B, T) -> (loss (B, T), clipped (B, T) bool, ratio (B, T)).
    loss = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)), r = pi_theta / pi_old.
    """
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, clipped > unclipped, ratio


def truncated_is_weights(old_logp: Tensor, engine_logp: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weight per token, min(pi_old / pi_engine, cap), correcting for the
    rollout engine's log-probs differing from the trainer's (TIS, Yao et al. 2025; verl's `tis_imp_ratio_cap`).

    old_logp: the trainer's own log-prob of the sampled tokens (recomputed, no grad); engine_logp:
    what the engine reported. (B, T), (B, T) -> (B, T), detached.
    """
    return torch.exp(old_logp - engine_logp).clamp(max=cap).detach()


def token_mean(x: Tensor, mask: Tensor, norm: float | None = None) -> Tensor:  # noqa: ARG001
    """Mean over every unmasked token of the batch (long answers weigh more). (B, T) -> ()."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def seq_mean_token_mean(x: Tensor, mask: Tensor, norm: float | None = None) -> Tensor:  # noqa: ARG001
    """Mean over sequences of each sequence's token mean (original GRPO). (B, T) -> ()."""
    m = mask.to(x.dtype)
    return ((x * m).sum(1) / m.sum(1).clamp(min=1)).mean()


def seq_mean_token_sum_norm(x: Tensor, mask: Tensor, norm: float | None = None) -> Tensor:
    """Token sums divided by a constant length `norm` (Dr. GRPO: no length bias). (B, T) -> ()."""
    m = mask.to(x.dtype)
    return (x * m).sum() / (x.shape[0] * (norm or x.shape[1]))


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}

# What each aggregation averages over in a minibatch: a data-parallel rank weighs its part of the loss by
# its share of this, so the ranks' losses sum to the one-process loss. mask (B, T) -> ().
AGG_WEIGHTS: dict[str, Callable[[Tensor], Tensor]] = {
    "token-mean": lambda mask: mask.sum(),
    "seq-mean-token-mean": lambda mask: torch.tensor(mask.shape[0]),
    "seq-mean-token-sum-norm": lambda mask: torch.tensor(mask.shape[0]),
}
