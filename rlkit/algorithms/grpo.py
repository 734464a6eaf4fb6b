"""The group-advantage policy gradients: grpo, dr-grpo, rloo, reinforce-pp, cispo.

Same shape for all four: per-sequence advantages from the outcome rewards (an estimator from
`rlkit.ops.advantages.ADVANTAGES`; with `--kl-in reward` the reward first pays beta x the sequence's KL to
the reference), broadcast over the completion's tokens into the clipped surrogate, with the KL to the
reference as a loss term by default. They differ in the estimator and in the default aggregation
(Dr. GRPO: token sums over a constant, no length bias); CISPO takes GRPO's advantages into its own per-token
loss (`rlkit.ops.losses.cispo`: the clipped importance weight, detached, so no token loses its gradient).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

from rlkit import console
from rlkit.algorithms.batch import RLBatch
from rlkit.algorithms.config import RLConfig
from rlkit.algorithms.policy_gradient import PGPlan, PolicyGradient
from rlkit.ops.advantages import ADVANTAGES, GROUP_BASELINE, GroupCounts

if TYPE_CHECKING:
    from rlkit.training.engine import Engine as Trainer


class GroupAdvantage(PolicyGradient):
    estimator: ClassVar[str]  # its name in rlkit.ops.advantages.ADVANTAGES
    shown = (*PolicyGradient.shown, "advantage_abs_mean")

    def advantages(self, trainer: Trainer, batch: RLBatch, old_logp: Tensor, kl_tok: Tensor | None, kl_coef: float,
                   cfg: RLConfig, metrics: dict, host: RLBatch | None = None) -> tuple[Tensor, dict[str, Any]]:
        rewards = batch.rewards
        if kl_tok is not None and cfg.kl_in == "reward" and kl_coef > 0:
            rewards = rewards - kl_coef * kl_tok.sum(1)
        adv = ADVANTAGES[self.estimator](rewards, batch.groups, lengths=batch.mask.sum(1))
        metrics["advantage_abs_mean"] = float(adv.abs().mean())
        return adv, {}

    def check_signal(self, counts: GroupCounts) -> None:
        """At least 90% of the groups of two or more samples with all-equal rewards: their advantages are 0,
        so the batch teaches (almost) nothing. One line, with what to change."""
        multi, flat = counts.groups - counts.singletons, counts.degenerate - counts.singletons
        if self.estimator in GROUP_BASELINE and multi > 0 and flat >= 0.9 * multi:
            console.warn(f"update: {flat} of {multi} groups ({flat / multi:.0%}) have all-equal rewards and give no "
                         f"learning signal under --algo {self.name}; sample more varied completions (rollout "
                         "--temperature, a larger --n) or use an easier task")

    def finish(self, trainer: Trainer, plan: PGPlan, sums: dict[str, float], maxes: dict[str, float]) -> dict[str, Any]:
        singletons = plan.metrics["singleton_groups"]
        if singletons and self.estimator in GROUP_BASELINE:
            console.warn(f"update: {singletons} groups have one sample and get advantage 0 under --algo "
                         f"{self.name} (no group baseline); sample --n >= 2 or use --algo reinforce-pp")
        return super().finish(trainer, plan, sums, maxes)


class GRPO(GroupAdvantage):
    name = estimator = "grpo"


class DrGRPO(GroupAdvantage):
    name = estimator = "dr-grpo"


class RLOO(GroupAdvantage):
    name = estimator = "rloo"


class ReinforcePP(GroupAdvantage):
    name = estimator = "reinforce-pp"


class CISPO(GroupAdvantage):
    """CISPO (MiniMax-M1): GRPO's advantages, the clipped and detached importance weight times the log-prob of every
    token (`rlkit.ops.losses.cispo`); its defaults (no lower bound on the weight, no KL term) in the registry."""

    name = "cispo"
    estimator = "grpo"
    policy_loss = "cispo"
