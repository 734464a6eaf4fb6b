"""KL estimators of KL(pi_theta || pi_ref) per token, from log-probs of the sampled tokens
(Schulman, "Approximating KL divergence"). Chosen by name from `KL_ESTIMATORS`.

An estimator has a *value* (what it reports, in expectation over tokens sampled from pi) and, when it
sits in the loss, a *gradient* (what it pulls the policy toward). They are not the same thing. With
x ~ pi and d = log pi(x) - log pi_ref(x):

    name  value                 E_pi[value]          E_pi[gradient] in the loss
    k1    d                     KL(pi || pi_ref)     0                       (regularises nothing)
    k2    d^2 / 2               ~KL (biased, >= 0)   grad KL(pi || pi_ref)   (the forward KL's)
    k3    e^-d - 1 + d          KL(pi || pi_ref)     grad KL(pi_ref || pi)   (the reverse KL's)
    k3+   k3's value            KL(pi || pi_ref)     grad KL(pi || pi_ref)   (k2's gradient; verl's low_var_kl+)

Which belongs where (see `DEFAULT_KL_ESTIMATOR` in `rl_config`):
- In the reward (`--kl-in reward`) the penalty is part of the return, so only its value matters and
  the policy-gradient theorem supplies the gradient: k1 makes that gradient exactly grad KL(pi||pi_ref).
  k2/k3 there penalise ~d^2/2, which pulls back only at second order near the reference.
- In the loss (`--kl-in loss`) the estimator is differentiated directly: use k3+ (default) or k2. k3
  there converges to the reverse-KL-regularised optimum (it keeps mass on actions pi_ref likes, e.g.
  [0.872, 0.084, 0.044] instead of the optimum [0.964, 0.029, 0.007] in the test's three-action
  example), and k1 has zero expected gradient, so `RLConfig.check` refuses it.

Numerics: the log-ratio is clamped to [-20, 20] before any exponential (as verl does; e^20 ~ 5e8 is
finite in fp32), and `kl_per_token` selects padded positions away *before* the estimator runs, so a
pad token's log-prob of -100 against a reference padded with 0 never becomes inf (and inf x 0 = NaN).
verl also clamps k3's value to [-10, 10]; rlkit does not: in a loss that clamp zeroes the gradient of
exactly the tokens farthest from the reference (it binds in recipes/rlvr.sh, whose k3 runs it changed:
seed 0's gain fell from +17.0 to +15.3 points), and the log-ratio clamp already keeps everything finite.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0  # |log pi - log pi_ref| before exp: e^20 ~ 5e8, finite in fp32


def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """log(pi/pi_ref): unbiased value, high variance, can be negative; zero expected gradient in a loss.
    (B, T) -> (B, T)."""
    return logp - ref_logp


def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """0.5 * log(pi/pi_ref)^2: biased value, low variance, >= 0; in a loss its expected gradient is
    grad KL(pi || pi_ref). (B, T) -> (B, T)."""
    return 0.5 * (logp - ref_logp) ** 2


def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """pi_ref/pi - 1 - log(pi_ref/pi): an unbiased, low-variance estimate of the *value* KL(pi || pi_ref),
    >= 0; in a loss its expected gradient is grad KL(pi_ref || pi), the reverse KL. The log-ratio is
    clamped to +-20 before exp. (B, T) -> (B, T)."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return d.exp() - d - 1


def k3_plus(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3's value with k2's gradient (straight-through; verl's low_var_kl+): reports the unbiased
    low-variance estimate of KL(pi || pi_ref) and, in a loss, descends that same forward KL.
    (B, T) -> (B, T)."""
    g = k2(logp, ref_logp)
    return k3(logp, ref_logp).detach() + (g - g.detach())


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": k1, "k2": k2, "k3": k3, "k3+": k3_plus}

# One line per estimator for `--kl-estimator`'s help and error messages.
KL_HELP = ("k1 (log-ratio; the one for the reward), k2 (forward KL's gradient in the loss), "
           "k3 (unbiased value; in the loss it descends the reverse KL), "
           "k3+ (k3's value, k2's gradient; the one for the loss)")


def kl_per_token(estimator: str, logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """The named estimator per token, exactly 0 off the mask. (B, T), (B, T), (B, T) bool -> (B, T).

    Padded positions are replaced by 0 on both sides *before* the estimator (select, not multiply), so
    whatever log-probs the padding carries, nothing non-finite reaches the value or the gradient.
    """
    m = mask.bool()
    zero = torch.zeros_like(logp)
    kl = KL_ESTIMATORS[estimator](torch.where(m, logp, zero), torch.where(m, ref_logp.to(logp.dtype), zero))
    return torch.where(m, kl, zero)
