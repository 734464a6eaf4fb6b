"""DPO (Rafailov et al. 2023), `update --algo dpo`: offline, on a prefs table that `score-ref --ref`
has scored with the reference's summed log-probs of each chosen and rejected response.

The train pairs are shuffled into minibatches like rollouts are; each step's loss is the mean over
its pairs of -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))) (`rlkit.ops.preference.dpo_loss`,
beta 0.1 by default). After the epochs, the implicit rewards and log-probs of every pair are reported
per split, train and held out: reward margin and accuracy, and how far the chosen and the rejected
log-probs moved from the reference's (both falling is likelihood displacement).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlkit.algorithms.base import Algorithm, Context, Minibatch, Plan, StepOut
from rlkit.algorithms.config import RLConfig
from rlkit.algorithms.inputs import PrefBatch, Prefs
from rlkit.errors import RlkitError
from rlkit.ops.logprobs import completion_logprobs
from rlkit.ops.preference import dpo_loss
from rlkit.training import Precision

if TYPE_CHECKING:
    from rlkit.training.trainer import Trainer

_SPLIT_METRICS = ("reward_margin", "reward_accuracy", "logp_chosen", "logp_rejected", "logp_chosen_delta",
                  "logp_rejected_delta")


class DPO(Algorithm):
    name = "dpo"
    input = Prefs
    shown = ("loss", *(f"{s}_{k}" for s in ("train", "heldout") for k in _SPLIT_METRICS))

    def prepare(self, trainer: Trainer, batch: PrefBatch, cfg: RLConfig, ctx: Context) -> Plan:
        host = ctx.host if ctx.host is not None else batch
        train = torch.arange(len(host.heldout))[~host.heldout]  # on the host: the trainer shuffles them there
        if len(train) == 0:
            raise RlkitError("the prefs table has no train pairs (every pair is split=heldout)")
        return Plan(cfg=cfg, batch=batch, ctx=ctx, rows=train, weights={"loss": len},
                    metrics={"algo": self.name, "beta": cfg.beta, "pairs_trained": len(train)})

    def step(self, trainer: Trainer, plan: Plan, mb: Minibatch) -> StepOut:
        b, idx, P = plan.batch, mb.idx, len(plan.batch.heldout)
        host = plan.ctx.host if plan.ctx.host is not None else b
        pi, tokens = _pair_logps(trainer.model, b, idx, trainer.prec, host, mb.rows)
        p = len(idx)
        loss, _, _ = dpo_loss(pi[:p], pi[p:], b.ref_logp[idx], b.ref_logp[idx + P], plan.cfg.beta)
        loss = loss.mean() * mb.shares["loss"]
        model = trainer.model if mb.first else None
        return StepOut(loss, {"loss": loss}, tokens=tokens if mb.shares["loss"] else 0,
                       inputs=lambda: _pref_inputs(b, model))

    def finish(self, trainer: Trainer, plan: Plan, sums: dict[str, float], maxes: dict[str, float]) -> dict[str, Any]:
        b, cfg = plan.batch, plan.cfg
        P = len(b.heldout)
        trainer.model.eval()
        with torch.no_grad():
            pi = _both_sides(trainer.model, b, cfg.minibatch_size, trainer.prec,
                             plan.ctx.host if plan.ctx.host is not None else b)
        metrics: dict[str, Any] = {}
        for name, sel in (("train", ~b.heldout), ("heldout", b.heldout)):
            if not bool(sel.any()):
                continue
            pc, pr = pi[:P][sel], pi[P:][sel]
            rc, rr = b.ref_logp[:P][sel], b.ref_logp[P:][sel]
            _, cr, rj = dpo_loss(pc, pr, rc, rr, cfg.beta)
            metrics.update({
                f"{name}_reward_margin": float((cr - rj).mean()),
                f"{name}_reward_accuracy": float((cr > rj).float().mean()),
                f"{name}_logp_chosen": float(pc.mean()), f"{name}_logp_rejected": float(pr.mean()),
                f"{name}_logp_chosen_delta": float((pc - rc).mean()), f"{name}_logp_rejected_delta": float((pr - rr).mean()),
            })
        return metrics


def _pair_logps(model, b: PrefBatch, pairs: Tensor, prec: Precision | None = None, host: PrefBatch | None = None,
                host_pairs: Tensor | None = None) -> tuple[Tensor, int]:
    """Summed policy log-probs (2p,) of the chosen then rejected responses of `pairs` (p,) (on `b`'s
    device), and the number of tokens run forward. `host`, `host_pairs`: the batch and the pairs on the
    CPU, which size the forward pass without a device sync (default: `b` and `pairs`)."""
    host = b if host is None else host
    host_pairs = pairs if host_pairs is None else host_pairs
    P = len(b.heldout)
    rows, hrows = torch.cat([pairs, pairs + P]), torch.cat([host_pairs, host_pairs + P])
    L = int(host.attn[hrows].sum(1).max())
    C = int(host.mask[hrows].sum(1).max())
    with (prec or Precision()).autocast():
        lp, _ = completion_logprobs(model, b.input_ids[rows, :L], b.attn[rows, :L], b.targets[rows, :C], b.start[rows])
    return (lp * b.mask[rows, :C]).sum(1), int(host.attn[hrows, :L].sum())


def _pref_inputs(b: PrefBatch, model=None) -> dict:
    """What a DPO step reads, for `non_finite_error` (`model` on an update's first step only)."""
    P = len(b.heldout)
    return {"the input table's ref_chosen_logp/ref_rejected_logp": torch.stack([b.ref_logp[:P], b.ref_logp[P:]], 1),
            "the starting weights": model}


def _both_sides(model, b: PrefBatch, chunk: int, prec: Precision | None = None, host: PrefBatch | None = None) -> Tensor:
    """Summed policy log-probs (2P,) of every chosen then every rejected response, no grad."""
    P = len(b.heldout)
    dev = b.input_ids.device
    parts = [_pair_logps(model, b, c.to(dev), prec, host, c)[0] for c in torch.arange(P).split(chunk)]
    chosen = torch.cat([x[: len(x) // 2] for x in parts])
    rejected = torch.cat([x[len(x) // 2:] for x in parts])
    return torch.cat([chosen, rejected])
