"""KL estimators of KL(pi_theta || pi_ref) per token, from log-probs of the sampled tokens
(Schulman, "Approximating KL divergence"). Chosen by name from `KL_ESTIMATORS`."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor


def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """log(pi/pi_ref): unbiased, high variance, can be negative. (B, T) -> (B, T)."""
    return logp - ref_logp


def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """0.5 * log(pi/pi_ref)^2: biased, low variance, always >= 0. (B, T) -> (B, T)."""
    return 0.5 * (logp - ref_logp) ** 2


def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """pi_ref/pi - 1 - log(pi_ref/pi): unbiased, low variance, always >= 0. (B, T) -> (B, T)."""
    d = ref_logp - logp
    return d.exp() - d - 1


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": k1, "k2": k2, "k3": k3}
