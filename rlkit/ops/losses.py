"""Policy losses: the clipped surrogate per token, kept apart from its aggregation (verl's
`agg_loss` pattern). Aggregation modes come from `AGGREGATIONS` by name.

`policy_token_loss` is the one per-token loss every ratio-based algorithm trains on
(`rlkit.algorithms.policy_gradient`); two parts of it are plug-ins: the importance ratio (`token_log_ratio` by
default; an algorithm module may pass its own, e.g. one per sequence) and the policy loss of that ratio, by name
from `POLICY_LOSSES` (the clipped surrogate, CISPO). Every function here selects padded positions away
before any exponential: masks are applied with `torch.where`, never by multiplying (an inf at a padded position
times 0 is NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from rlkit.ops.kl import LOG_RATIO_CLAMP, kl_per_token


def clipped_surrogate(logp: Tensor, old_logp: Tensor, adv: Tensor, clip_low: float = 0.2,
                      clip_high: float = 0.28, dual_clip: float | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PPO's clipped objective as a per-token loss, with asymmetric clipping (DAPO's clip-higher) and
    optionally dual clipping (Ye et al. 2020, "Mastering complex control in MOBA games"; verl's clip_ratio_c).

    logp, old_logp (B, T); adv (B,) or (B, T)
    -> (loss (B, T), clipped (B, T) bool, ratio (B, T), dual_clipped (B, T) bool).
    loss = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)), r = pi_theta / pi_old (log-ratio
    clamped to +-20 before exp). For A < 0 that is -A * max(r, 1 - clip_low), unbounded as r grows:
    `dual_clip` C caps it at -C * A (zero gradient there), so a token whose probability rose far
    under a negative advantage (an off-policy or stale sample) cannot dominate a minibatch. C must be
    > 1; None: no cap. Example: A = -1, r = 4 gives 4, capped to 3 at C = 3.
    """
    return surrogate(logp - old_logp, adv, clip_low, clip_high, dual_clip)


def surrogate(log_ratio: Tensor, adv: Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
              dual_clip: float | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`clipped_surrogate` on a given log importance ratio (B, T) (clamped to +-20 before exp), whatever
    ratio the algorithm takes (per token, per sequence). -> (loss, clipped, ratio, dual_clipped), (B, T) each."""
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    return loss, clipped > unclipped, ratio, dual


def cispo(log_ratio: Tensor, adv: Tensor, clip_low: float = 1.0, clip_high: float = 0.28,
          dual_clip: float | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # noqa: ARG001
    """CISPO's per-token loss (MiniMax-M1, Chen et al. 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently
    with Lightning Attention"): the importance weight is clipped and detached, and every token keeps the gradient
    of its own log-prob, however far its ratio moved (the clipped surrogate zeroes the gradient of a token clipped
    on its advantage's side).

    log_ratio (B, T) = log pi_theta - log pi_old, with the gradient of log pi_theta; adv (B,) or (B, T)
    -> (loss (B, T), clipped (B, T) bool: the weight was clipped, ratio (B, T), no dual clip (all False)).
    loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * (1 + log r): its gradient is the paper's
    -sg(r_hat) * A * grad log pi_theta (log r and log pi_theta differ by the constant log pi_old; the 1 is a
    constant too), and its value is the clipped surrogate's -A * r to first order near r = 1 (-A on-policy), so
    the logged loss reads as the other algorithms' does. `dual_clip` does not apply (the weight is bounded by
    clip_high already). Example: A = 1, r = 2 with clip_high 0.28 gives the weight 1.28 and
    d loss / d log pi_theta = -1.28.
    """
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()
    loss = -weight * adv * (1 + log_ratio)
    clipped = (ratio > 1 + clip_high) | (ratio < 1 - clip_low)
    return loss, clipped, ratio, torch.zeros_like(clipped)


# The per-token policy losses an algorithm names (`PolicyGradient.policy_loss`; verl's `register_policy_loss`):
# (log_ratio (B, T), adv (B,) or (B, T), clip_low, clip_high, dual_clip) -> (loss, clipped, ratio, dual_clipped).
POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]] = {
    "clipped": surrogate,  # PPO's clipped surrogate, clip-higher and dual clip (the GRPO family, PPO, GSPO)
    "cispo": cispo,  # the clipped importance weight, detached (MiniMax-M1)
}


def truncated_is_weights(old_logp: Tensor, engine_logp: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weight per token, min(pi_old / pi_engine, cap), correcting for the
    rollout engine's log-probs differing from the trainer's (TIS, Yao et al. 2025; verl's `tis_imp_ratio_cap`).

    old_logp: the trainer's own log-prob of the sampled tokens (recomputed, no grad); engine_logp:
    what the engine reported. (B, T), (B, T) -> (B, T), detached.
    """
    return torch.exp((old_logp - engine_logp).clamp(max=LOG_RATIO_CLAMP)).clamp(max=cap).detach()


def importance_ess(old_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> float:
    """Normalised effective sample size of the per-token importance weights w = pi_old / pi_engine
    (uncapped): (sum w)^2 / (n * sum w^2) over the n masked tokens, in (0, 1]. 1 when the behaviour
    policy that sampled equals the proximal one the loss clips against; it falls as they drift apart
    (policy lag, engine mismatch), and 1/ESS is roughly the variance inflation of the weighted loss.
    (B, T), (B, T), (B, T) bool -> float (1.0 for no tokens)."""
    w = torch.exp((old_logp - engine_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))[mask].double()
    if w.numel() == 0:
        return 1.0
    return float(w.sum() ** 2 / (w.numel() * (w * w).sum()))


def token_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:  # noqa: ARG001
    """PPO's per-token log importance ratio log(pi_theta / pi_old). (B, T), (B, T), (B, T) -> (B, T)."""
    return logp - old_logp


class TokenLoss(NamedTuple):
    """`policy_token_loss`'s result; every (B, T) tensor is zero / False off the mask."""

    loss: Tensor  # (B, T) per-token loss to aggregate
    clipped: Tensor  # (B, T) bool: the ratio clip bound
    dual_clipped: Tensor  # (B, T) bool: the dual-clip cap bound
    ratio: Tensor  # (B, T) pi_theta / pi_old (1 off the mask)


def policy_token_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float,
                      clip_high: float, dual_clip: float | None = None, tis: Tensor | None = None,
                      ref_logp: Tensor | None = None, kl_estimator: str = "k3+", kl_coef: float = 0.0,
                      log_ratio: Callable[[Tensor, Tensor, Tensor], Tensor] = token_log_ratio,
                      policy_loss: str = "clipped") -> TokenLoss:
    """The per-token RL policy loss: the `policy_loss` of `POLICY_LOSSES` (default the clipped surrogate,
    dual-clipped with `dual_clip`) of the importance ratio `log_ratio(logp, old_logp, mask)` (default per token),
    weighted by the truncated IS weights `tis` when given, plus `kl_coef` x the `kl_estimator` KL to `ref_logp`
    when the KL sits in the loss (`kl_coef` > 0).

    logp (B, T) with grad; old_logp, ref_logp, tis (B, T); adv (B,) or (B, T); mask (B, T) bool.
    Off the mask every input is replaced by 0 before anything is exponentiated, so padded positions
    cannot make the loss or its gradient non-finite, whatever log-probs they carry.
    """
    m = mask.bool()
    zero = torch.zeros_like(logp)
    lp = torch.where(m, logp, zero)
    old = torch.where(m, old_logp.to(logp.dtype), zero)
    pg, clipped, ratio, dual = POLICY_LOSSES[policy_loss](log_ratio(lp, old, m), adv, clip_low, clip_high, dual_clip)
    if tis is not None:
        pg = pg * torch.where(m, tis.to(pg.dtype), zero)
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        pg = pg + kl_coef * kl_per_token(kl_estimator, lp, ref_logp, m)
    return TokenLoss(torch.where(m, pg, zero), clipped & m, dual & m, ratio)


def token_mean(x: Tensor, mask: Tensor, norm: float | None = None) -> Tensor:  # noqa: ARG001
    """Mean over every unmasked token of the batch (long answers weigh more). (B, T) -> ()."""
    m = mask.bool()
    return torch.where(m, x, 0).sum() / m.sum().clamp(min=1)


def seq_mean_token_mean(x: Tensor, mask: Tensor, norm: float | None = None) -> Tensor:  # noqa: ARG001
    """Mean over sequences of each sequence's token mean (original GRPO). (B, T) -> ().

    A row with no valid token (an empty response) has no token mean and is left out of the mean over
    sequences, as verl does: the divisor is the number of non-empty rows, not B, so an empty row
    never dilutes the others.
    """
    m = mask.bool()
    n_tok = m.sum(1)
    per_seq = torch.where(m, x, 0).sum(1) / n_tok.clamp(min=1)
    return per_seq.sum() / (n_tok > 0).sum().clamp(min=1)


def seq_mean_token_sum_norm(x: Tensor, mask: Tensor, norm: float | None = None) -> Tensor:
    """Token sums divided by B x a constant `norm` (Dr. GRPO: no length bias). (B, T) -> ().

    `norm` must be the same constant for every minibatch and data-parallel rank (rlkit passes the
    rollout's `max_new_tokens`, times `max_turns` and at most `max_total_tokens` under --env:
    `rlkit.algorithms.shaping.length_norm`); a per-minibatch length would make the weights drift, so there is no
    default. Every row counts in B, empty ones included: the divisor is a constant by design.
    """
    if norm is None or norm <= 0:
        raise ValueError("seq-mean-token-sum-norm needs a constant normaliser > 0 (the rollout's max_new_tokens)")
    return torch.where(mask.bool(), x, 0).sum() / (x.shape[0] * norm)


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}

# What each aggregation averages over in a minibatch: a data-parallel rank weighs its part of the loss by
# its share of this, so the ranks' losses sum to the one-process loss. mask (B, T) -> ().
AGG_WEIGHTS: dict[str, Callable[[Tensor], Tensor]] = {
    "token-mean": lambda mask: mask.sum(),
    "seq-mean-token-mean": lambda mask: (mask.sum(1) > 0).sum(),
    "seq-mean-token-sum-norm": lambda mask: torch.tensor(mask.shape[0]),
}
