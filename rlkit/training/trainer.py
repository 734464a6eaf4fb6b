"""The one training loop of `rlkit update`, whatever the --algo: `Trainer` owns the policy (LoRA and
gradient checkpointing applied, FSDP2-sharded under torchrun), its AdamW and counters, the compute
precision, the shuffle into minibatches for --epochs passes, the data-parallel split of each
minibatch, the optimizer step of every trained model, the loss and gradient-norm metrics, and the
checkpoint's `trainer/` state (save and resume). The algorithm (`rlkit.algorithms`) supplies the
rest: what a batch means (`prepare`), one minibatch's loss terms (`step`) and its metrics (`finish`).

Kept apart from the stage so that N sequential `update` processes can be checked against one
`Trainer` doing the same N updates in memory.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlkit import algorithms, devices
from rlkit.algorithms.base import Context, Minibatch, Plan, StepOut
from rlkit.algorithms.config import RLConfig, resolve
from rlkit.errors import RlkitError, non_finite_cause
from rlkit.training import Precision, TrainOptions
from rlkit.training.distributed import DataParallel, all_max, all_sum, split_rows

TRAINER_DIR = "trainer"


@dataclass
class TrainerState:
    """What carries over between `update` processes besides the weights."""

    optimizer_step: int = 0
    updates: int = 0
    precision: dict | None = None  # rlkit.training.Precision.state(): the fp16 loss scale to resume with

    def lr_factor(self, warmup: int) -> float:
        return min(1.0, (self.optimizer_step + 1) / warmup) if warmup > 0 else 1.0


@dataclass
class Trained:
    """A model the update trains, with its own AdamW and counters: the policy, or an algorithm's (PPO's critic)."""

    model: Any
    opt: torch.optim.Optimizer
    state: TrainerState


def make_optimizer(model, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (LoRA: the adapter only); state is saved per parameter name."""
    from rlkit.training import make_adamw

    return make_adamw(model, lr, weight_decay, betas=(0.9, 0.99), eps=1e-8)


def trainer_tensors(model, opt: torch.optim.Optimizer, dp: DataParallel | None = None) -> dict[str, Tensor]:
    """AdamW moments and step per parameter name plus the torch RNG, unsharded (a collective under `dp`)."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if dp is not None:
        from rlkit.training.distributed import full_optimizer_state

        per_name = full_optimizer_state(model, opt)
    else:
        per_name = {name: opt.state[p] for name, p in model.named_parameters() if opt.state.get(p)}
    for name, st in per_name.items():
        for k in ("exp_avg", "exp_avg_sq"):
            tensors[f"{name}/{k}"] = st[k].detach().contiguous()
        tensors[f"{name}/step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1)
    return tensors


def save_trainer(model, opt: torch.optim.Optimizer | None, state: TrainerState, d: Path,
                 tensors: dict[str, Tensor] | None = None) -> None:
    """safetensors + JSON: the same layout whatever the world size, so any world size resumes it."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors if tensors is not None else trainer_tensors(model, opt), str(d / "optimizer.safetensors"))
    s = {"optimizer_step": state.optimizer_step, "updates": state.updates}
    if state.precision:
        s["precision"] = state.precision
    (d / "state.json").write_text(json.dumps(s) + "\n")


def load_trainer(model, opt: torch.optim.Optimizer, d: Path, dp: DataParallel | None = None) -> TrainerState:
    """Restore what `save_trainer` wrote; a checkpoint without it (an SFT model) starts fresh. Under `dp`
    the full state is sharded onto this rank's FSDP parameters."""
    from safetensors.torch import load_file

    if not (d / "optimizer.safetensors").is_file():
        return TrainerState()
    tensors = load_file(str(d / "optimizer.safetensors"))
    names = [name for name, _ in model.named_parameters()]
    per_name = {name: {"step": tensors[f"{name}/step"].reshape(()).clone(),
                       "exp_avg": tensors[f"{name}/exp_avg"].float(),
                       "exp_avg_sq": tensors[f"{name}/exp_avg_sq"].float()}
                for name in names if f"{name}/exp_avg" in tensors}
    if dp is not None:
        from rlkit.training.distributed import load_full_optimizer_state

        load_full_optimizer_state(model, opt, per_name)
    else:
        for name, p in model.named_parameters():
            if name in per_name:
                st = per_name[name]
                opt.state[p] = {"step": st["step"], "exp_avg": st["exp_avg"].to(device=p.device, dtype=p.dtype),
                                "exp_avg_sq": st["exp_avg_sq"].to(device=p.device, dtype=p.dtype)}
    torch.set_rng_state(tensors["rng/torch"])
    s = json.loads((d / "state.json").read_text())
    return TrainerState(optimizer_step=s["optimizer_step"], updates=s["updates"], precision=s.get("precision"))


def non_finite_error(what: str, state: TrainerState, cfg: RLConfig, inputs: Callable[[], dict] | None) -> RlkitError:
    """A NaN/inf `what` (loss, gradient): the step's non-finite input when one was (`inputs()`: what to
    call it -> tensor or model, see `rlkit.errors.non_finite_cause`), else the step diverged: lower --lr."""
    cause = non_finite_cause(inputs()) if inputs is not None else None
    tail = f": {cause}" if cause else f" (lower --lr, now {cfg.lr})"
    return RlkitError(f"non-finite {what} at optimizer step {state.optimizer_step}; nothing was written{tail}")


class Trainer:
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
                 device=None) -> None:
        from rlkit import training

        self.cfg = resolve(cfg)
        self.algo = algorithms.get(self.cfg.algo)(self.cfg)
        # the device everything trains on: the data-parallel rank's, else `device` (default the CPU)
        self.device = dp.device if dp is not None else torch.device(device) if device is not None else torch.device("cpu")
        train = train.on(self.device)  # --dtype auto made concrete
        self.tokenizer, self.train_options, self.dp, self.trust_remote_code = tokenizer, train, dp, trust_remote_code
        self.prec = Precision(train.dtype, self.device.type)
        model = training.prepare_model(model, train, "causal-lm", base=base)
        if dp is not None:
            from rlkit import console
            from rlkit.ops.logprobs import completion_logprobs_local
            from rlkit.training import distributed

            model = distributed.shard_model(model, dp, completion_logprobs_local)
            console.info(f"update: data-parallel over {dp.world} processes ({dp.device.type}, FSDP2)")
        else:
            model.to(self.device)
        self.model = model
        self.opt = make_optimizer(model, self.cfg.lr, self.cfg.weight_decay)
        self.state = TrainerState()

    def load(self, src: Path) -> None:
        """Optimizer state, counters, RNG and loss scale from checkpoint `src` (fresh when it has none),
        then the algorithm's own models (PPO's critic)."""
        self.state = load_trainer(self.model, self.opt, src / TRAINER_DIR, self.dp)
        self.prec.load_state(self.state.precision)
        self.algo.load(self, src)

    @property
    def trained(self) -> list[Trained]:
        return [Trained(self.model, self.opt, self.state), *self.algo.trained()]

    def train(self, batch, *, cfg: RLConfig | None = None, temperature: float = 1.0, length_norm: float | None = None,
              recompute: bool = False, lags: Tensor | None = None, progress=None) -> dict[str, Any]:
        """One update on `batch` (the algorithm's input kind: an RLBatch or a PrefBatch) -> its metrics.

        `cfg`: this update's knobs when they differ from the trainer's (`update --follow` sets --tis-cap
        per step). `temperature`, `length_norm` (seq-mean-token-sum-norm's constant, the rollout's
        max_new_tokens), `recompute` (pi_old from the trainer's own forward pass before the first step
        instead of the engine's log-probs) and `lags` (N,) describe a rollout batch (see `Context`).
        `progress(total_steps)`: a context manager giving a ticker with `advance(n, loss=...)`.

        The minibatch order is seeded by --seed and the number of updates done, so the same updates
        give the same order in one process or many. Data-parallel: every rank holds the whole batch and
        the same order and trains on rows rank::world of each minibatch, each loss term scaled by the
        rank's share of what it averages over (`Plan.weights`, `rlkit.training.distributed.split_rows`), which
        FSDP's gradient averaging turns into the one-process gradient."""
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
        with progress(total) if progress is not None else contextlib.nullcontext() as ticker:
            for epoch in range(cfg.epochs):
                order = plan.rows[torch.randperm(len(plan.rows), generator=gen)]
                for s in range(0, len(order), cfg.minibatch_size):
                    out = self.algo.step(self, plan, self._minibatch(plan, order[s : s + cfg.minibatch_size], epoch,
                                                                     first=not grad_norms))
                    values, gn, got_sums, got_maxes = self._optimize(out, cfg)
                    for k, v in zip(out.terms, values, strict=True):
                        terms.setdefault(k, []).append(v)
                    for k, v in got_sums.items():
                        sums[k] += v
                    for k, v in got_maxes.items():
                        maxes[k] = max(maxes[k], v)
                    tokens += out.tokens
                    grad_norms.append(gn)
                    if ticker is not None:
                        ticker.advance(1, loss=values[0])
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
        metrics.update(train_seconds=round(secs, 3), tokens_per_s=round(tokens / secs, 1) if secs > 0 else None)
        if self.prec.scaler is not None:
            metrics.update(loss_scale=self.prec.scaler.get_scale(), skipped_steps=self.prec.skipped)
        metrics.update(devices.peak_memory(self.device))
        return metrics

    def _minibatch(self, plan: Plan, rows: Tensor, epoch: int, first: bool) -> Minibatch:
        """This rank's rows of minibatch `rows` (host indices) and, per loss term, its share (1.0 in one
        process); the rows' indices on the device beside them."""
        shares = dict.fromkeys(plan.weights, 1.0)
        mine = rows
        if self.dp is not None:
            mine = None
            for k, weight in plan.weights.items():
                idx, shares[k] = split_rows(rows, self.dp, weight)
                mine = idx if mine is None else mine
        return Minibatch(devices.to_device(mine, self.device), shares, epoch, first, mine)

    def _optimize(self, out: StepOut, cfg: RLConfig) -> tuple[list[float], float, dict, dict]:
        """Backward (loss-scaled under fp16), clip, then ONE host sync for the step's figures (its loss
        terms, gradient norms, the algorithm's sums and maxes), then step every trained model with the
        scheduled LR (the policy's; an extra model keeps its own). A NaN/inf loss term or (fp32/bf16)
        gradient aborts before the optimizer steps, so nothing is written and the weights stay as they
        were; an fp16 overflow skips the step as any loss scaler does. Data-parallel: the terms summed
        over ranks decide, so all ranks stop together; FSDP's gradient norm is already global.
        -> (the terms' values, global under data parallelism; the policy's gradient norm before clipping;
        the step's sums; its maxes)."""
        trained = self.trained
        for t in trained:
            t.opt.zero_grad(set_to_none=True)
        for g in self.opt.param_groups:
            g["lr"] = cfg.lr * self.state.lr_factor(cfg.warmup_steps)
        groups = [(t.model.parameters(), t.opt, cfg.grad_clip) for t in trained]
        self.prec.backward(out.loss)
        norms = self.prec.clip(groups)
        nt, ns = len(out.terms), len(out.sums)
        got = devices.host([*out.terms.values(), *out.sums.values(), *out.maxes.values(), *norms])
        values = got[:nt]
        sums = dict(zip(out.sums, got[nt : nt + ns], strict=True))
        maxes = dict(zip(out.maxes, got[nt + ns : nt + ns + len(out.maxes)], strict=True))
        norm_values = got[len(got) - len(norms):]
        if self.dp is not None:
            values = all_sum([v / self.dp.world for v in values], self.dp)
        if not all(math.isfinite(v) for v in values):
            raise non_finite_error("loss", self.state, cfg, out.inputs)
        stepped = self.prec.apply(groups, all(math.isfinite(v) for v in norm_values))
        if not stepped and self.prec.scaler is None:
            raise non_finite_error("gradient", self.state, cfg, out.inputs)
        for t in trained:
            t.state.optimizer_step += 1
        return values, float(norm_values[0]), sums, maxes

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
