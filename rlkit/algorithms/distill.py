"""On-policy distillation, `update --algo distill`: the policy samples, a teacher scores every sampled token
(`score-ref --teacher DIR`), and each token's advantage is -teacher_coef * (log pi_old - log pi_teacher), the
reverse KL to the teacher minimised on the policy's own samples (Agarwal et al. 2024, "On-Policy Distillation of
Language Models: Learning from Self-Generated Mistakes" (GKD, lambda = 1); Thinking Machines 2025, "On-Policy
Distillation": tinker's `kl_penalty_coef` with discount 0). Every token is judged alone, so one sample a prompt
is enough (no group baseline), and the teacher is the leash (no reference: --beta 0).

The task reward is not used: to add it, train a group algorithm with the teacher term beside its advantages
(`--algo grpo --teacher-coef C`, `rlkit.algorithms.policy_gradient`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlkit.algorithms.batch import RLBatch
from rlkit.algorithms.config import RLConfig
from rlkit.algorithms.policy_gradient import PolicyGradient
from rlkit.errors import RlkitError

if TYPE_CHECKING:
    from rlkit.training.engine import Engine as Trainer


class Distill(PolicyGradient):
    name = "distill"
    uses_reward = False  # the reward is logged, not trained on
    shown = (*PolicyGradient.shown, "teacher_advantage_abs_mean")

    @classmethod
    def check(cls, cfg: RLConfig) -> None:
        super().check(cfg)
        if cfg.teacher_coef <= 0:
            raise RlkitError(f"--algo distill learns from the teacher alone: --teacher-coef must be > 0 (got "
                             f"{cfg.teacher_coef:g}; its default is 1)")
        if cfg.drop_degenerate:
            raise RlkitError("--drop-degenerate leaves out groups with all-equal rewards, but --algo distill does not "
                             "use the reward: every sampled token has the teacher's signal")

    def advantages(self, trainer: Trainer, batch: RLBatch, old_logp: Tensor, kl_tok: Tensor | None, kl_coef: float,
                   cfg: RLConfig, metrics: dict, host: RLBatch | None = None) -> tuple[Tensor, dict[str, Any]]:
        """No reward term: the teacher's per-token advantage is added by `PolicyGradient.prepare`."""
        return torch.zeros(len(batch.rewards), device=batch.rewards.device), {}
