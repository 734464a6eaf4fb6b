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
from rlkit.algorithms.batch import PrefBatch
from rlkit.algorithms.config import RLConfig
from rlkit.algorithms.inputs import Prefs
from rlkit.errors import RlkitError
from rlkit.ops.logprobs import completion_logprobs
from rlkit.ops.packing import from_padded
from rlkit.ops.preference import dpo_loss

if TYPE_CHECKING:
    from rlkit.training.engine import Engine as Trainer

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
        P = len(host.heldout)
        lengths = host.attn.sum(1)
        return Plan(cfg=cfg, batch=batch, ctx=ctx, rows=train, weights={"loss": len}, lengths=lengths[:P] + lengths[P:],
                    source=from_padded(host.input_ids, host.attn, host.start),
                    metrics={"algo": self.name, "beta": cfg.beta, "pairs_trained": len(train)})

    def step(self, trainer: Trainer, plan: Plan, mb: Minibatch) -> StepOut:
        b, idx, P = plan.batch, mb.idx, len(plan.batch.heldout)
        pi, tokens = _pair_logps(trainer, plan.source, mb.rows if mb.rows is not None else idx, P)
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
        with torch.no_grad(), trainer.prec.autocast():
            pi = _both_sides(trainer, plan.source, P, cfg.minibatch_size, plan.lengths)
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


def _pair_logps(engine, source: tuple[list[list[int]], list[int]], pairs: Tensor, P: int) -> tuple[Tensor, int]:
    """Summed policy log-probs (2p,) of the chosen then rejected responses of `pairs` (p,) (host indices into
    P pairs; `source`: the 2P sequences on the host, chosen then rejected), and the tokens run forward.
    Both sides of the pairs run in one forward pass, laid out by the engine (packed unless --no-packing)."""
    rows = torch.cat([pairs, pairs + P]).tolist()
    tokens, plens = source
    seqs = engine.layout([tokens[i] for i in rows], [plens[i] for i in rows])
    with engine.prec.autocast():
        lp, _ = completion_logprobs(engine.model, seqs)
    return lp.sum(1), seqs.tokens


def _pref_inputs(b: PrefBatch, model=None) -> dict:
    """What a DPO step reads, for `non_finite_error` (`model` on an update's first step only)."""
    P = len(b.heldout)
    return {"the input table's ref_chosen_logp/ref_rejected_logp": torch.stack([b.ref_logp[:P], b.ref_logp[P:]], 1),
            "the starting weights": model}


def _both_sides(engine, source: tuple[list[list[int]], list[int]], P: int, chunk: int, lengths: Tensor) -> Tensor:
    """Summed policy log-probs (2P,) of every chosen then every rejected response, no grad: `chunk` pairs (or
    the engine's micro-batches) at a time; `lengths` (P,): the tokens of each pair."""
    def run(pairs: Tensor) -> Tensor:  # (p, 2): each pair's chosen and rejected
        return _pair_logps(engine, source, pairs, P)[0].view(2, len(pairs)).T

    # data-parallel: each rank its share of the pairs, then gathered
    out = engine.forward_rows(torch.arange(P), lengths, chunk, run, torch.zeros((P, 2), device=engine.device))
    return torch.cat([out[:, 0], out[:, 1]])
