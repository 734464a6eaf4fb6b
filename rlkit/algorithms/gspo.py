"""GSPO, Group Sequence Policy Optimization (Zheng et al. 2025, "Group Sequence Policy Optimization").

GRPO's group-normalised advantages, but the importance ratio is the sequence's, not each token's:
s_i = (pi_theta(y_i | x) / pi_old(y_i | x))^(1 / |y_i|) = exp(mean_t(log pi_theta - log pi_old)), the
geometric mean of the token ratios, clipped as a whole, so one off-policy token cannot get its own clip
decision and the noise of per-token ratios does not add up over long responses. The clip range is
therefore tiny (3e-4 below, 4e-4 above, the paper's), the loss is a mean over sequences of each one's
token mean, and the paper's objective has no KL term (beta 0; --beta adds rlkit's usual one).

Implemented as GSPO-token: every token carries the value s_i and the gradient of its own log-prob,
sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t)), which with equal advantages over a sequence and the
sequence-mean aggregation has exactly the gradient of the sequence-level objective.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkit.algorithms.grpo import GroupAdvantage


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's log importance ratio per token: value mean_t(logp - old_logp) over the row's masked tokens
    (log s_i; the tokens the policy sampled, so |y_i| leaves out a multi-turn row's environment tokens),
    gradient that of the token's own logp. (B, T), (B, T), (B, T) bool -> (B, T).

    Example: log-ratios [0.3, 0.1] give log s = 0.2 at both tokens (s = e^0.2 = 1.2214), and
    d/d logp_t of exp(that) is s, for each t."""
    m = mask.bool()
    seq = torch.where(m, logp - old_logp, 0).sum(1) / m.sum(1).clamp(min=1)  # (B,)
    return logp - logp.detach() + seq.detach().unsqueeze(1)


class GSPO(GroupAdvantage):
    name = "gspo"
    estimator = "grpo"
    log_ratio = staticmethod(sequence_log_ratio)
    # its defaults (the paper's clip range, beta 0, seq-mean-token-mean): its line in rlkit.algorithms.REGISTRY
