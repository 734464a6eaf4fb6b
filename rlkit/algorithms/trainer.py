"""`rlkit update`'s trainer, whatever the --algo: the engine (`rlkit.training.engine.Engine`: model, AdamW,
precision, data parallelism, micro-batches, the optimizer step) driven by the algorithm's objective
over the update's schedule: the shuffle into minibatches for --epochs passes, one optimizer step per
minibatch, the loss and gradient-norm metrics, and the checkpoint's `trainer/` state (save and resume).
The algorithm (`rlkit.algorithms`) supplies the rest: what a batch means (`prepare`), one micro-batch's
loss terms (`step`) and its metrics (`finish`).

Kept apart from the stage so that N sequential `update` processes can be checked against one
`Trainer` doing the same N updates in memory.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlkit import algorithms, devices
from rlkit.algorithms.base import Context
from rlkit.algorithms.config import RLConfig, resolve
from rlkit.training import Optim, TrainOptions
from rlkit.training.distributed import DataParallel, all_max, all_sum
from rlkit.training.engine import (  # noqa: F401 (re-exported: the names `update`'s trainer state had)
    TRAINER_DIR,
    Engine,
    Trained,
    TrainerState,
    load_trainer,
    make_optimizer,
    non_finite_error,
    save_trainer,
    trainer_tensors,
)


class Trainer(Engine):
    """The policy and whatever the algorithm trains beside it, kept in memory across the updates of one
    process: one update without --follow, one per batch of prompts with it.

        t = Trainer(model, RLConfig(algo="grpo"), tokenizer=tok)
        t.load(checkpoint_dir)              # optimizer state, counters, RNG (and PPO's critic); optional
        metrics = t.train(batch, temperature=1.0, length_norm=16.0)
        t.save(out_dir, manifest, t.gather())

    `cfg` is resolved (`rlkit.algorithms.config.resolve`), so None fields get the algorithm's defaults. `train`
    (TrainOptions): precision, gradient checkpointing and LoRA (a fresh adapter on `model`, whose
    weights came from directory `base`). `dp`: data parallelism (FSDP2, `rlkit.training.distributed`)."""

    def __init__(self, model, cfg: RLConfig, *, tokenizer=None, train: TrainOptions = TrainOptions(),
                 base: Path | None = None, dp: DataParallel | None = None, trust_remote_code: bool = False,
                 device=None, runtime=None) -> None:
        from rlkit.ops.logprobs import completion_logprobs_local

        self.cfg = resolve(cfg)
        self.algo = algorithms.get(self.cfg.algo)(self.cfg)
        super().__init__(model, self.algo, Optim(lr=self.cfg.lr, weight_decay=self.cfg.weight_decay,
                                                 grad_clip=self.cfg.grad_clip),
                         train=train, base=base, dp=dp, device=device, tokenizer=tokenizer,
                         trust_remote_code=trust_remote_code, shard_fn=completion_logprobs_local, name="update",
                         runtime=runtime)

    def load(self, src: Path) -> None:
        """Optimizer state, counters, RNG and loss scale from checkpoint `src` (fresh when it has none),
        then the algorithm's own models (PPO's critic)."""
        self.load_state(src)
        self.algo.load(self, src)

    def train(self, batch, *, cfg: RLConfig | None = None, temperature: float = 1.0, length_norm: float | None = None,
              recompute: bool = False, lags: Tensor | None = None, progress=None) -> dict[str, Any]:
        """One update on `batch` (the algorithm's input kind: an RLBatch or a PrefBatch) -> its metrics.

        `cfg`: this update's knobs when they differ from the trainer's (`update --follow` sets --tis-cap
        per step). `temperature`, `length_norm` (seq-mean-token-sum-norm's constant, the rollout's
        max_new_tokens; x max_turns, at most max_total_tokens, under --env), `recompute` (pi_old from the trainer's own forward pass before the first step
        instead of the engine's log-probs) and `lags` (N,) describe a rollout batch (see `Context`).
        `progress(total_steps)`: a context manager giving a ticker with `advance(n, loss=...)`.

        The minibatch order is seeded by --seed and the number of updates done, so the same updates
        give the same order in one process or many. Each minibatch is one optimizer step (`Engine.step`):
        data-parallel, every rank holds the whole batch and the same order and trains on rows rank::world
        of each minibatch, in micro-batches, each loss term scaled by its share of what it averages over
        (`Plan.weights`), which FSDP's gradient averaging turns into the one-process gradient."""
        t0 = time.monotonic()
        cfg = self.cfg if cfg is None else resolve(cfg)
        for t in self.trained:
            t.model.train()
        devices.reset_peak_memory(self.device)
        # the batch moves to the device once; its host copy gives sizes (sequence lengths, loss weights)
        # without a device sync
        host = batch
        batch = devices.to_device(batch, self.device)
        lags_dev = devices.to_device(lags, self.device)
        plan = self.algo.prepare(self, batch, cfg, Context(temperature, length_norm, recompute, lags_dev, host))
        sums: dict[str, float] = dict.fromkeys(plan.sums, 0)
        maxes = dict.fromkeys(plan.maxes, -math.inf)
        terms: dict[str, list[float]] = {}
        grad_norms: list[float] = []
        tokens = 0
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.state.updates)
        total = cfg.epochs * -(-len(plan.rows) // cfg.minibatch_size)
        self.padding_fraction()  # counts from here
        with progress(total) if progress is not None else contextlib.nullcontext() as ticker:
            for epoch in range(cfg.epochs):
                order = plan.rows[torch.randperm(len(plan.rows), generator=gen)]
                for s in range(0, len(order), cfg.minibatch_size):
                    fig = self.step(plan, order[s : s + cfg.minibatch_size], epoch=epoch, first=not grad_norms,
                                    lr=cfg.lr * self.state.lr_factor(cfg.warmup_steps), grad_clip=cfg.grad_clip)
                    for k, v in fig.terms.items():
                        terms.setdefault(k, []).append(v)
                    for k, v in fig.sums.items():
                        sums[k] += v
                    for k, v in fig.maxes.items():
                        maxes[k] = max(maxes[k], v)
                    tokens += fig.tokens
                    grad_norms.append(fig.grad_norm)
                    if ticker is not None:
                        ticker.advance(1, loss=next(iter(fig.terms.values()), 0.0))
        for t in self.trained:
            t.state.updates += 1
        if self.dp is not None:
            *summed, tokens = all_sum([*sums.values(), tokens], self.dp)
            sums = dict(zip(sums, summed, strict=True))
            maxes = dict(zip(maxes, all_max(list(maxes.values()), self.dp), strict=True))
        metrics = {**plan.metrics, **{k: sum(v) / len(v) for k, v in terms.items()},
                   "optimizer_steps": len(grad_norms), "grad_norm": sum(grad_norms) / max(1, len(grad_norms)),
                   **self.algo.finish(self, plan, sums, maxes)}
        if "loss" not in metrics:  # no step (every row dropped): say so with 0, as for the gradient norm
            metrics["loss"] = 0.0
        secs = time.monotonic() - t0
        metrics.update(train_seconds=round(secs, 3), tokens_per_s=round(tokens / secs, 1) if secs > 0 else None,
                       padding_fraction=self.padding_fraction())
        if self.prec.scaler is not None:
            metrics.update(loss_scale=self.prec.scaler.get_scale(), skipped_steps=self.prec.skipped)
        metrics.update(devices.peak_memory(self.device))
        return metrics

    def gather(self) -> tuple:
        """(full policy weights or None, its optimizer tensors, the algorithm's): collectives under data
        parallelism, so every rank calls it; rank 0 then saves."""
        from rlkit.training import distributed

        full = distributed.full_model_state(self.model) if self.dp is not None else None
        return full, trainer_tensors(self.model, self.opt, self.dp), self.algo.gather(self)

    def save(self, d: Path, manifest: dict, gathered: tuple, write_manifest: bool = True) -> dict:
        """The policy checkpoint into `d`: weights (or the LoRA adapter), tokenizer, `trainer/`, the
        algorithm's own models; returns the manifest with the weights' hashes."""
        from rlkit.io import checkpoints

        full, opt_tensors, extra = gathered
        self.state.precision = self.prec.state()
        manifest = checkpoints.save_model(self.model, self.tokenizer, d, manifest, state_dict=full,
                                          write_manifest=write_manifest)
        save_trainer(self.model, self.opt, self.state, d / TRAINER_DIR, opt_tensors)
        self.algo.save(self, d, extra)
        return manifest


def free_grads(t) -> None:
    """Drop the gradients of every model trainer `t` trains (the policy, PPO's critic) once its step is done:
    `zero_grad(set_to_none=True)`, as the next step would at its start, so that between steps the GPU holds the
    weights and AdamW state only (12 bytes per trained parameter in fp32, not 16). The next step computes the same."""
    for tr in t.trained:
        tr.opt.zero_grad(set_to_none=True)
