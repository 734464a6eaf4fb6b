"""pi_old, what every rollout algorithm reads besides the batch's tensors: the trainer's own log-probs of the
sampled tokens (`recompute_logprobs`), how far they are from the engine's (`mismatch_metrics`), and the inputs a
policy step names when its loss turns non-finite (`batch_inputs`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlkit.algorithms.batch import RLBatch
from rlkit.ops.logprobs import completion_logprobs
from rlkit.ops.losses import importance_ess
from rlkit.training import Precision


def recompute_logprobs(model, batch: RLBatch, temperature: float, chunk_rows: int, prec: Precision | None = None,
                       host: RLBatch | None = None, *, engine=None) -> Tensor:
    """Log-probs of the completion tokens under `model` in precision `prec`, no grad: (N, C) on the batch's
    device, 0 past each completion (a multi-turn row's environment tokens included: they are off `mask`, not
    off this); `chunk_rows` rows per forward pass, packed (`rlkit.ops.packing`). `host`: the same batch on the
    CPU, which sizes the passes without a device sync (default `batch`). `engine`
    (`rlkit.training.engine.Engine`): its model, precision, micro-batches and layout (--no-packing) instead, and
    under torchrun its data-parallel split (`Engine.forward_rows`: each rank recomputes its share of the rows,
    then every rank holds all of them)."""
    from rlkit.ops.packing import from_padded, layout

    host = batch if host is None else host
    tokens, plens = from_padded(host.input_ids, host.attn, host.start)
    rows = torch.arange(len(batch.old_logp))
    out = torch.zeros_like(batch.old_logp)
    if engine is not None:  # data-parallel: each rank its share of the rows, then gathered
        C = out.shape[1]

        def run(c: Tensor) -> Tensor:
            lp, _ = completion_logprobs(engine.model, engine.layout([tokens[i] for i in c], [plens[i] for i in c]),
                                        temperature=temperature)
            return torch.nn.functional.pad(lp, (0, C - lp.shape[1]))

        with engine.prec.autocast():
            engine.forward_rows(rows, host.attn.sum(1), chunk_rows, run, out)
        return out * batch.completion_mask
    with torch.no_grad(), (prec or Precision()).autocast():
        for c in rows.split(chunk_rows):
            seqs = layout([tokens[i] for i in c], [plens[i] for i in c]).to(out.device)
            lp, _ = completion_logprobs(model, seqs, temperature=temperature)
            out[c.to(out.device), : lp.shape[1]] = lp
    return out * batch.completion_mask


def mismatch_metrics(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, lags: Tensor | None = None) -> dict[str, Any]:
    """How far the recomputed pi_old (the proximal policy) is from the behaviour policy's logged
    log-probs: mean/max |difference| per token, the importance weights' normalised ESS and, given each
    row's policy lag (N,), the mismatch on the rows sampled by this very policy (the engine's alone)."""
    gap = (old_logp - engine_logp).abs()[mask]
    out: dict[str, Any] = {"logprob_mismatch": float(gap.mean()) if gap.numel() else 0.0,
                           "logprob_mismatch_max": float(gap.max()) if gap.numel() else 0.0,
                           "is_ess": importance_ess(old_logp, engine_logp, mask)}
    if lags is not None:
        fresh = mask & (lags == 0).unsqueeze(1)
        g = (old_logp - engine_logp).abs()[fresh]
        out["logprob_mismatch_fresh"] = float(g.mean()) if g.numel() else None
    return out


def batch_inputs(batch: RLBatch, old_logp: Tensor, recompute: bool, tis: Tensor | None, uses_ref: bool,
                 model=None) -> dict:
    """What a policy step reads, root causes first, for `rlkit.training.engine.non_finite_error`: the input
    table's columns that reach the loss (`uses_ref`: a KL term or penalty reads ref_logprobs), the
    rewards, `model`'s weights (the starting ones: pass it on an update's first step only, later a
    diverged step can have made them non-finite), the recomputed pi_old."""
    return {"the input table's old_logprobs": batch.old_logp if not recompute or tis is not None else None,
            "the input table's ref_logprobs": batch.ref_logp if uses_ref else None,
            "the reward (the input table's reward/* columns)": batch.rewards,
            "the starting weights": model,
            "the recomputed pi_old": old_logp if recompute else None}
