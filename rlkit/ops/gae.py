"""PPO-with-a-critic math for RLHF: per-token rewards with a KL penalty, generalized advantage
estimation, whitening, the clipped value loss and the adaptive KL coefficient.

Token tensors are (B, T) over completion tokens only; `mask` (B, T) bool is True on the completion
tokens the policy sampled. Completions are left-aligned: a single-turn row's mask is True for positions
0..len-1, False after. A multi-turn row's mask also has holes: the tokens an environment appended between
turns (tool results, feedback) are not the policy's actions, so they are not time steps either: GAE steps
over them (verl's multi-turn GAE), the value and the advantage of the next sampled token flowing back
through them undiscounted, and whatever rewards or values sit there are never read.
Every (B, T) result is zero off the mask.
"""

from __future__ import annotations

import torch
from torch import Tensor


def kl_penalised_token_rewards(score: Tensor, kl: Tensor, mask: Tensor, beta: float,
                               token_rewards: Tensor | None = None) -> Tensor:
    """The InstructGPT per-token reward: -beta * kl on every completion token, plus the sequence's
    reward-model score at its last valid token. (B,), (B, T), (B, T) -> (B, T), zero off the mask.

    `token_rewards` (B, T), when given, are part of `score` (their row sums are in it): each value on the mask is
    placed at its own token and taken out of the last token's share, so a row's rewards still sum to its score
    (values off the mask, on an environment's tokens, stay in the last token's share).
    A row with no valid token gets nothing (its score is dropped).
    """
    m = mask.bool()
    rewards = torch.where(m, -beta * kl, torch.zeros_like(kl))
    if token_rewards is not None:
        placed = torch.where(m, token_rewards.to(rewards.dtype), 0)
        rewards = rewards + placed
        score = score - placed.sum(1)
    T = m.shape[1]
    pos = torch.arange(T, device=m.device).expand_as(m)
    last = torch.where(m, pos, torch.full_like(pos, -1)).max(1).values  # (B,), -1 for an empty row
    has = last >= 0
    add = torch.zeros_like(rewards).scatter_(
        1, last.clamp(min=0).unsqueeze(1), torch.where(has, score.to(rewards.dtype), 0).unsqueeze(1))
    return rewards + add


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) per completion token.

    rewards, values (B, T) float; mask (B, T) bool, left-aligned. The value after a row's last valid
    token is 0 (the episode ends there), so values past the end never leak in:
        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1}
    where t + 1 is the next token *on the mask*: positions off it inside a row (a multi-turn row's
    environment tokens) are skipped, V and A carried through them unchanged.
    -> (advantages (B, T), returns (B, T)) with returns = advantages + values; both zero off the mask,
    neither whitened (see `masked_whiten`). Vectorised over B, a backward loop over T.
    """
    on = mask.bool()
    m = on.to(values.dtype)
    v = values * m
    r = rewards * m
    B, T = values.shape
    adv = torch.zeros_like(v)
    last = torch.zeros(B, dtype=v.dtype, device=v.device)
    next_v = torch.zeros(B, dtype=v.dtype, device=v.device)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_v - v[:, t]
        last = torch.where(on[:, t], delta + gamma * lam * last, last)  # off the mask: carried through
        adv[:, t] = last * m[:, t]
        next_v = torch.where(on[:, t], v[:, t], next_v)
    returns = (adv + v) * m
    return adv, returns


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) with the mean and unbiased variance over the masked entries only.
    (B, T), (B, T) -> (B, T), zero off the mask.

    shift_mean=False adds the mean back (rescale only, as TRL does for rewards). With fewer than two
    masked entries the variance is taken as 0.
    """
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float) -> Tensor:
    """PPO's clipped value loss per token: 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2).
    (B, T), (B, T), (B, T) -> (B, T), no reduction (aggregate with a `losses.AGGREGATIONS` entry).
    """
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


class AdaptiveKLController:
    """The adaptive KL coefficient of Ziegler et al. 2019 (as in TRL / OpenRLHF): beta moves toward
    the value that keeps the measured KL near `target`, by at most 20% per `horizon` steps.

    Plain Python; `state_dict()` is JSON-able and `from_state` rebuilds it (saved beside checkpoints).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0, got target={target}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon; returns value."""
        proportional_error = min(max(float(current_kl) / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    @classmethod
    def from_state(cls, state: dict) -> AdaptiveKLController:
        return cls(init_kl_coef=state["value"], target=state["target"], horizon=state["horizon"])


def explained_variance(returns: Tensor, values: Tensor) -> float | None:
    """1 - Var(R - V) / Var(R) over the entries given (1-D, e.g. the masked tokens); None when it is
    undefined (fewer than two entries, or returns without variance). 1: the values explain the returns."""
    if returns.numel() > 1 and returns.var() > 0:
        ev = 1 - float((returns - values).var() / returns.var())
        return None if ev != ev else ev  # NaN values: undefined too
    return None
