"""The supervised objectives of `sft` and `train-rm` on rlkit's one engine (`rlkit.training.engine`), and the
loop both run: a fixed plan of batches, one optimizer step per batch, an LR schedule, the progress line,
tracker rows, resume snapshots.

- `CrossEntropy` (sft): -log pi(completion token) averaged over the batch's completion tokens (prompt
  tokens are context, not targets; so are the completion tokens a per-token mask leaves out, a multi-turn
  rollout's environment tokens). Only completion positions reach the output head.
- `BradleyTerry` (train-rm): -log sigmoid(s_chosen - s_rejected - margin) averaged over the batch's pairs,
  both sides of each pair in one forward pass.

Micro-batches, packing, precision, data parallelism, clipping and the non-finite check are the engine's,
so they work the same in all three training stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlkit.training.engine import Engine, Minibatch, Objective, Plan, StepOut


class CrossEntropy(Objective):
    """SFT's loss over token sequences `tokens` whose first `prompt_lens[i]` tokens are the prompt, optionally with
    per-token completion masks (`plan`'s `masks`): the tokens a mask leaves out are read by the model (context) but
    are not targets, like the prompt."""

    def plan(self, tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int],
             masks: Sequence[Sequence[int] | None] | None = None) -> Plan:
        """`masks[i]`: one 0/1 per completion token of row i (len(tokens[i]) - prompt_lens[i] of them), 1 where the
        token is a target (a multi-turn rollout's `loss_mask`: sampled by the policy), 0 where it is context only
        (appended by an environment); a None row, or `masks` None: every completion token is a target. The loss
        averages over the targets of the whole optimizer step."""
        lengths = torch.tensor([len(t) for t in tokens])
        targets = lengths - torch.tensor(list(prompt_lens))
        if masks is not None:
            if len(masks) != len(tokens):
                raise ValueError(f"CrossEntropy.plan: {len(masks)} masks for {len(tokens)} sequences")
            for i, m in enumerate(masks):
                if m is not None and len(m) != int(targets[i]):
                    raise ValueError(f"CrossEntropy.plan: sequence {i} has {int(targets[i])} completion tokens but a "
                                     f"mask of {len(m)}")
            targets = torch.tensor([int(n) if m is None else int(sum(m)) for n, m in zip(targets, masks, strict=True)])
        return Plan(batch=(tokens, prompt_lens, masks), rows=torch.arange(len(tokens)), lengths=lengths,
                    weights={"loss": lambda r: targets[r].sum()})

    def step(self, engine: Engine, plan: Plan, mb: Minibatch) -> StepOut:
        tokens, plens, masks = plan.batch
        rows = mb.rows.tolist()
        seqs = engine.layout([tokens[i] for i in rows], [plens[i] for i in rows])
        from rlkit.ops.logprobs import completion_logprobs

        with engine.prec.autocast():
            lp, _ = completion_logprobs(engine.model, seqs)  # (r, C), 0 past each completion
        share = mb.shares["loss"]
        if masks is None:
            loss = -lp.sum() / max(1, len(seqs.targets)) * share
        else:
            keep = _completion_mask([masks[i] for i in rows], [len(tokens[i]) - plens[i] for i in rows],
                                    seqs.completion)
            n = int(keep.sum())  # on the host, before the move: no device sync
            loss = -torch.where(keep.to(lp.device), lp, 0.0).sum() / max(1, n) * share
        model = engine.model if mb.first else None
        return StepOut(loss, {"loss": loss}, tokens=seqs.tokens if share else 0,
                       inputs=lambda: {"the starting weights": model})


def _completion_mask(masks: Sequence[Sequence[int] | None], lengths: Sequence[int], C: int) -> torch.Tensor:
    """(r, C) bool: True on the completion tokens that are targets (a None mask: all `lengths[i]` of row i)."""
    out = torch.zeros((len(lengths), C), dtype=torch.bool)
    for i, (m, n) in enumerate(zip(masks, lengths, strict=True)):
        out[i, :n] = True if m is None else torch.tensor(list(m), dtype=torch.bool)
    return out


class BradleyTerry(Objective):
    """The reward model's loss over pairs (chosen[i], rejected[i]) of token sequences, scored at their last token."""

    def __init__(self, margin: float = 0.0) -> None:
        self.margin = margin

    def plan(self, chosen: Sequence[Sequence[int]], rejected: Sequence[Sequence[int]], pairs: Sequence[int]) -> Plan:
        lengths = torch.tensor([len(c) + len(r) for c, r in zip(chosen, rejected, strict=True)])
        return Plan(batch=(chosen, rejected), rows=torch.tensor(list(pairs), dtype=torch.long), lengths=lengths,
                    weights={"loss": len})

    def step(self, engine: Engine, plan: Plan, mb: Minibatch) -> StepOut:
        from rlkit.ops.preference import bradley_terry_loss
        from rlkit.scorers.reward_model import seq_scores

        chosen, rejected = plan.batch
        rows = mb.rows.tolist()
        both = [chosen[i] for i in rows] + [rejected[i] for i in rows]
        seqs = engine.layout(both, [len(x) for x in both])
        with engine.prec.autocast():
            scores = seq_scores(engine.model, seqs)
        share = mb.shares["loss"]
        loss = bradley_terry_loss(scores[: len(rows)], scores[len(rows):], self.margin).mean() * share
        model = engine.model if mb.first else None
        return StepOut(loss, {"loss": loss}, tokens=seqs.tokens if share else 0,
                       inputs=lambda: {"the starting weights": model})


@dataclass
class Fitted:
    """What `fit` leaves: the steps' losses (global under data parallelism), their moving average, the tokens
    this rank ran forward, the training seconds, the padded share of the positions run forward."""

    losses: list[float]
    ema: float | None
    tokens: int
    seconds: float
    padding_fraction: float | None


def fit(engine: Engine, plan: Plan, epochs: list[list[list[int]]], lr_factor: Callable[[int], float], *, name: str,
        snaps, snap, tracker, logging_steps: int, show: Callable[[Fitted], dict[str, Any]]) -> Fitted:
    """One optimizer step per batch of `epochs` (per epoch, the row lists of its batches, all drawn up front so a
    resumed run skips ahead), at learning rate engine.optim.lr x `lr_factor(step)`. `snaps`/`snap`
    (`rlkit.training.resume`): the snapshots to save every --save-steps, and the one to resume (or None);
    `tracker`: a training row every `logging_steps` steps (axis NAME/train); `show(fitted)`: the progress
    line's figures after a step."""
    total = sum(len(e) for e in epochs)
    t0, step, tokens, ema, losses = time.monotonic(), 0, 0, None, []
    start = (0, 0)  # (epoch, batch) to train first
    if snap is not None:  # its AdamW, RNG, loss scale, LR, position and running figures
        got = snaps.restore(snap, engine.model, engine.opt, engine.prec, device=engine.device)
        start, step, tokens = (got["epoch"], got["batch"]), got["step"], int(got["tokens"])
        ema, losses = got["ema"], list(got["losses"])
        t0 -= got["train_seconds"]
    engine.model.train()
    engine.padding_fraction()
    from rlkit import console

    with console.progress(name, total) as bar:
        if snap is not None:
            bar.advance(step)
        for e, batches in enumerate(epochs):
            for b, rows in enumerate(batches):
                if (e, b) < start:
                    continue
                lr = engine.optim.lr * lr_factor(step)
                fig = engine.step(plan, torch.tensor(rows, dtype=torch.long), epoch=e, first=step == 0, lr=lr)
                value = fig.terms["loss"]
                step += 1
                tokens += fig.tokens
                losses.append(value)
                ema = value if ema is None else 0.95 * ema + 0.05 * value
                fitted = Fitted(losses, ema, tokens, time.monotonic() - t0, None)
                bar.advance(1, **show(fitted))
                # the trackers first: a kill right after a snapshot must not lose that step's row
                if step % logging_steps == 0:  # to the trackers alone: --metrics holds the run's row
                    tracker.log({"step": step, "loss": value, "loss_ema": ema, "lr": lr, "grad_norm": fig.grad_norm},
                                axis=f"{name}/train")
                if snaps.due(step):
                    snaps.save(step, total, engine.model, engine.opt, engine.prec, device=engine.device,
                               position={"epoch": e, "batch": b + 1},
                               figures={"ema": ema, "losses": losses, "train_seconds": time.monotonic() - t0,
                                        "run_name": tracker.run_name},
                               per_rank={"tokens": tokens})
    return Fitted(losses, ema, tokens, time.monotonic() - t0, engine.padding_fraction())
