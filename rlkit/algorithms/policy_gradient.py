"""What every rollout algorithm with a clipped importance ratio shares (the GRPO family, PPO, ...):
pi_old (the engine's, or the trainer's own with truncated IS weights), the KL to the reference as a
metric, a loss term or a reward penalty, the group counts and --drop-degenerate, the per-minibatch
policy loss, and the ratio, clip, entropy and mismatch metrics. A subclass supplies the advantages
(`advantages`), may swap the importance ratio (`log_ratio`: e.g. one per sequence) and the per-token loss of it
(`policy_loss`, a name in `rlkit.ops.losses.POLICY_LOSSES`: the clipped surrogate by default, CISPO), and may
add loss terms for its own models (`extra_terms`, PPO's value loss). Per-token signals reach it through the batch
(`RLBatch.teacher_logp`, `RLBatch.token_rewards`): with --teacher-coef > 0 the teacher's per-token advantage
(on-policy distillation) is added to the subclass's, and `teacher_kl` is logged whenever the input has a teacher's
log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from rlkit.algorithms.base import Algorithm, Context, Minibatch, Plan, StepOut
from rlkit.algorithms.batch import RLBatch
from rlkit.algorithms.config import RLConfig
from rlkit.algorithms.inputs import NO_TEACHER, Rollouts
from rlkit.algorithms.pi_old import batch_inputs, mismatch_metrics, recompute_logprobs
from rlkit.errors import RlkitError
from rlkit.ops.advantages import GroupCounts, degenerate_groups, teacher_advantage, teacher_kl
from rlkit.ops.kl import kl_per_token
from rlkit.ops.logprobs import completion_logprobs
from rlkit.ops.losses import (
    AGG_WEIGHTS,
    AGGREGATIONS,
    policy_token_loss,
    token_log_ratio,
    truncated_is_weights,
)
from rlkit.ops.packing import Seqs, from_padded

if TYPE_CHECKING:
    from rlkit.training.engine import Engine as Trainer

SUMS = ("clipped", "dual_clipped", "policy_tokens", "ratio_sum", "entropy_sum", "entropy_tokens")
MAXES = ("ratio_max", "ratio_neg_min")


@dataclass(kw_only=True)
class PGPlan(Plan):
    old_logp: Tensor  # (N, C) pi_old the ratio is taken against (recomputed or the engine's)
    tis: Tensor | None  # (N, C) truncated IS weights, or None
    kl_coef: float  # the KL coefficient of this update (PPO's adaptive one moves between updates)
    adv: Tensor  # (N,) per sequence or (N, C) per token
    extra: dict[str, Any] = field(default_factory=dict)  # the subclass's own (PPO: values, returns)


class PolicyGradient(Algorithm):
    input = Rollouts
    log_ratio: ClassVar = staticmethod(token_log_ratio)  # (logp, old_logp, mask) -> the log importance ratio
    policy_loss: ClassVar[str] = "clipped"  # its per-token loss of that ratio: a name in rlkit.ops.losses.POLICY_LOSSES
    shown = ("kl_per_token", "kl_per_seq", "entropy", "clip_fraction", "dual_clip_fraction", "ratio_min",
             "ratio_mean", "ratio_max", "logprob_mismatch", "logprob_mismatch_max", "tis_weight_mean",
             "tis_capped_fraction", "is_ess", "mean_response_tokens", "degenerate_group_fraction", "teacher_kl")
    extra_sums: ClassVar[tuple[str, ...]] = ()  # names of the counts `extra_terms` returns
    # --teacher-coef: False, the teacher's per-token advantage (`rlkit.ops.advantages.teacher_advantage`) is added
    # to what `advantages` returns; True, the subclass puts it into its per-token rewards itself (PPO, before GAE)
    teacher_in_rewards: ClassVar[bool] = False

    @classmethod
    def check(cls, cfg: RLConfig) -> None:
        if cfg.kl_in == "loss" and cfg.kl_estimator == "k1" and cfg.beta > 0:
            raise RlkitError("--kl-estimator k1 in the loss has zero expected gradient (E_pi[grad log pi] = 0), so it "
                             "would regularise nothing: use k3+ or k2 with --kl-in loss, or k1 with --kl-in reward")

    # -- what subclasses supply
    def kl_coef(self, cfg: RLConfig) -> float:
        return cfg.beta

    def advantages(self, trainer: Trainer, batch: RLBatch, old_logp: Tensor, kl_tok: Tensor | None, kl_coef: float,
                   cfg: RLConfig, metrics: dict, host: RLBatch | None = None) -> tuple[Tensor, dict[str, Any]]:
        """-> (advantages (N,) or (N, C), the subclass's own tensors for `PGPlan.extra`); may add to `metrics`.
        `kl_tok` (N, C): the --kl-estimator per token of pi_old vs pi_ref, None without reference log-probs.
        `batch` is on the trainer's device; `host` is the same batch on the CPU (sizes without a sync)."""
        raise NotImplementedError

    def extra_terms(self, trainer: Trainer, plan: PGPlan, mb: Minibatch, seqs: Seqs,
                    mask: Tensor) -> tuple[dict[str, Tensor], dict[str, float]]:
        """Loss terms beside the policy's for this micro-batch (name -> () tensor) and their counts (`extra_sums`).
        seqs: the rows' sequences as the policy ran them (`rlkit.ops.packing`); mask (r, C): their completion
        tokens trained on."""
        return {}, {}

    def step_inputs(self, plan: PGPlan, first: bool) -> dict:
        """The derived tensors a step reads beyond `batch_inputs`, for non_finite_error."""
        return {"the advantage": plan.adv}

    # -- the Algorithm interface
    def prepare(self, trainer: Trainer, batch: RLBatch, cfg: RLConfig, ctx: Context) -> PGPlan:
        mask, host = batch.mask, ctx.host if ctx.host is not None else batch
        if cfg.beta > 0 and batch.ref_logp is None:
            raise RlkitError("--beta > 0 needs reference log-probs: pipe the rollouts through `rlkit score-ref --ref REF` "
                             "(or pass --beta 0)")
        if cfg.tis_cap is not None and not ctx.recompute:
            raise RlkitError("--tis-cap needs the recomputed pi_old (--old-logprobs recompute)")
        metrics: dict[str, Any] = {"old_logprobs": "recompute" if ctx.recompute else "engine"}
        old_logp, tis = batch.old_logp, None
        source = from_padded(host.input_ids, host.attn, host.start)  # the sequences each micro-batch lays out
        if ctx.recompute:
            old_logp = recompute_logprobs(trainer.model, batch, ctx.temperature, cfg.minibatch_size, host=host,
                                          engine=trainer)
            metrics["recompute_rows"] = trainer.forward_rows_run  # this process's share under torchrun
            metrics.update(mismatch_metrics(old_logp, batch.old_logp, mask, ctx.lags))
            if cfg.tis_cap is not None:
                tis = truncated_is_weights(old_logp, batch.old_logp, cfg.tis_cap)
                metrics.update(tis_weight_mean=float(tis[mask].mean()),
                               tis_capped_fraction=float((tis[mask] >= cfg.tis_cap).float().mean()))
        kl_tok = None
        if batch.ref_logp is not None:
            kl_tok = kl_per_token(cfg.kl_estimator, old_logp, batch.ref_logp, mask)
            metrics["kl_per_token"] = float(kl_tok.sum() / mask.sum().clamp(min=1))
            metrics["kl_per_seq"] = float(kl_tok.sum(1).mean())
        kl_coef = self.kl_coef(cfg)
        if batch.teacher_logp is not None:  # on every update whose input has a teacher's log-probs
            metrics["teacher_kl"] = teacher_kl(old_logp, batch.teacher_logp, mask)
        if cfg.teacher_coef > 0 and batch.teacher_logp is None:
            raise RlkitError(NO_TEACHER.format(flag=f"--algo {self.name}" if self.name == "distill"
                                               else f"--teacher-coef {cfg.teacher_coef:g}"))
        adv, extra = self.advantages(trainer, batch, old_logp, kl_tok, kl_coef, cfg, metrics, host)
        if cfg.teacher_coef > 0 and not self.teacher_in_rewards:  # the teacher's per-token term beside the reward's
            t_adv = teacher_advantage(old_logp, batch.teacher_logp, mask, cfg.teacher_coef)
            adv = t_adv + (adv.unsqueeze(1) if adv.dim() == 1 else adv)
            metrics["teacher_advantage_abs_mean"] = float(t_adv.abs().sum() / mask.sum().clamp(min=1))
        counts = degenerate_groups(host.rewards, host.groups)
        rows = torch.arange(len(adv))  # on the host: the trainer shuffles them there
        if cfg.drop_degenerate:
            rows = rows[~counts.degenerate_mask]
        metrics.update(degenerate_group_fraction=counts.degenerate / max(1, counts.groups),
                       singleton_groups=counts.singletons, sequences=len(adv), sequences_trained=len(rows),
                       mean_response_tokens=float(host.mask.sum(1).float().mean()))
        self.check_signal(counts)
        agg_weight = AGG_WEIGHTS[cfg.loss_agg]
        hmask = host.mask
        return PGPlan(cfg=cfg, batch=batch, ctx=ctx, rows=rows, weights={"loss": lambda r: agg_weight(hmask[r]),
                      **self.extra_weights(host)}, lengths=host.attn.sum(1), source=source, metrics=metrics,
                      sums=SUMS + self.extra_sums, maxes=MAXES, old_logp=old_logp, tis=tis, kl_coef=kl_coef, adv=adv,
                      extra=extra)

    def check_signal(self, counts: GroupCounts) -> None:
        """Hook, called with the batch's group counts: an algorithm whose advantages need reward differences
        inside a group warns when most groups have none."""

    def extra_weights(self, host: RLBatch) -> dict:
        """Per extra loss term: what it averages over (see `Plan.weights`), read from the batch on the host."""
        return {}

    def step(self, trainer: Trainer, plan: PGPlan, mb: Minibatch) -> StepOut:
        b, cfg, ctx, idx = plan.batch, plan.cfg, plan.ctx, mb.idx
        rows = (mb.rows if mb.rows is not None else mb.idx).tolist()
        share = mb.shares["loss"]
        tokens, plens = plan.source
        seqs = trainer.layout([tokens[i] for i in rows], [plens[i] for i in rows])
        C = seqs.completion
        m = b.mask[idx, :C] if share else torch.zeros_like(b.mask[idx, :C])
        with trainer.prec.autocast():
            logp, ent = completion_logprobs(trainer.model, seqs, temperature=ctx.temperature, with_entropy=mb.epoch == 0)
        in_loss = cfg.kl_in == "loss" and plan.kl_coef > 0
        adv = plan.adv[idx] if plan.adv.dim() == 1 else plan.adv[idx, :C]
        tl = policy_token_loss(logp, plan.old_logp[idx, :C], adv, m, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                               dual_clip=cfg.dual_clip, tis=None if plan.tis is None else plan.tis[idx, :C],
                               ref_logp=b.ref_logp[idx, :C] if in_loss else None, kl_estimator=cfg.kl_estimator,
                               kl_coef=plan.kl_coef if in_loss else 0.0, log_ratio=self.log_ratio,
                               policy_loss=self.policy_loss)
        loss = AGGREGATIONS[cfg.loss_agg](tl.loss, m, ctx.length_norm) * share
        extra, extra_sums = self.extra_terms(trainer, plan, mb, seqs, m)
        total = loss
        for term in extra.values():
            total = total + term
        with torch.no_grad():  # () tensors on the device: the trainer reads them with the loss, in one sync
            r = tl.ratio.detach()
            n = m.sum()
            sums = {"clipped": tl.clipped.sum(), "dual_clipped": tl.dual_clipped.sum(), "policy_tokens": n,
                    "ratio_sum": torch.where(m, r, 0).sum(), **extra_sums}
            if ent is not None:
                sums.update(entropy_sum=torch.where(m, ent, 0).sum(), entropy_tokens=n)
            neg_inf = torch.full((), -math.inf, device=r.device)
            maxes = {"ratio_max": torch.where(m, r, neg_inf).max(), "ratio_neg_min": torch.where(m, -r, neg_inf).max()} \
                if m.numel() else {}
        uses_ref = plan.kl_coef > 0 and b.ref_logp is not None

        def inputs() -> dict:
            return {**batch_inputs(b, plan.old_logp, ctx.recompute, plan.tis, uses_ref, trainer.model if mb.first else None),
                    **self.step_inputs(plan, mb.first)}

        return StepOut(total, {"loss": loss, **extra}, sums, maxes, seqs.tokens if share else 0, inputs)

    def finish(self, trainer: Trainer, plan: PGPlan, sums: dict[str, float], maxes: dict[str, float]) -> dict[str, Any]:
        n = sums["policy_tokens"]
        return {"clip_fraction": sums["clipped"] / max(1, n), "dual_clip_fraction": sums["dual_clipped"] / max(1, n),
                "ratio_min": -maxes["ratio_neg_min"] if n else None, "ratio_max": maxes["ratio_max"] if n else None,
                "ratio_mean": sums["ratio_sum"] / max(1, n),
                "entropy": sums["entropy_sum"] / sums["entropy_tokens"] if sums["entropy_tokens"] else None}

