"""One RL update on one rollout batch, in memory: the loop `rlkit update` runs between loading a
checkpoint and saving the next. Kept apart from the stage so that N sequential `update` processes
can be checked against one process doing the same N updates.

The math comes from the pure modules: `advantages`, `kl`, `losses`, `logprobs`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from rlkit.advantages import ADVANTAGES, degenerate_groups
from rlkit.distributed import DataParallel, all_max, all_sum, split_rows
from rlkit.errors import RlkitError, non_finite_cause
from rlkit.kl import kl_per_token
from rlkit.logprobs import completion_logprobs, pack_sequences
from rlkit.losses import AGG_WEIGHTS, AGGREGATIONS, importance_ess, policy_token_loss, truncated_is_weights
from rlkit.rl_config import RLConfig
from rlkit.training import Precision

TRAINER_DIR = "trainer"


class RLBatch(NamedTuple):
    """A rollout batch as tensors. N sequences, L = longest prompt+completion, C = longest completion."""

    input_ids: Tensor  # (N, L) long, right-padded
    attn: Tensor  # (N, L)
    targets: Tensor  # (N, C) completion tokens
    mask: Tensor  # (N, C) bool, True on completion tokens
    start: Tensor  # (N,) position whose logits predict completion token 0
    old_logp: Tensor  # (N, C) pi_old, logged at rollout
    ref_logp: Tensor | None  # (N, C) pi_ref from score-ref, or None
    rewards: Tensor  # (N,) combined reward
    groups: Tensor  # (N,) group ids


def _padded(rows: list[list[float]], C: int) -> Tensor:
    out = torch.zeros((len(rows), C), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def combine_rewards(columns: dict[str, list[float]], weights: dict[str, float] | None) -> tuple[Tensor, dict[str, float]]:
    """Weighted sum of reward components (default: each present component with weight 1)."""
    if not columns:
        raise RlkitError("the input has no reward/<component> columns; sample with a task that has a verifier")
    w = dict(weights) if weights else {name: 1.0 for name in columns}
    missing = sorted(set(w) - set(columns))
    if missing:
        raise RlkitError(f"--reward names {missing}, but the input only has components {sorted(columns)}")
    total = torch.zeros(len(next(iter(columns.values()))), dtype=torch.float64)
    for name, weight in w.items():
        if any(v is None for v in columns[name]):
            raise RlkitError(f"reward component {name!r} has missing values")
        vals = torch.tensor(columns[name], dtype=torch.float64)
        cause = non_finite_cause({f"the input table's reward/{name}": vals})
        if cause:  # an inf reward makes every advantage of its group NaN
            raise RlkitError(cause)
        total += weight * vals
    return total.float(), w


def build_batch(table, pad_id: int, weights: dict[str, float] | None = None,
                length_penalty: float = 0.0) -> tuple[RLBatch, dict[str, float]]:
    """Tensors from a rollouts/scored Arrow table. `length_penalty` > 0 adds the component
    `length_penalty` = -length_penalty * completion tokens (weight 1) to the reward."""
    prompts = table.column("prompt_ids").to_pylist()
    comps = table.column("completion_ids").to_pylist()
    old = table.column("old_logprobs").to_pylist()
    for i, (c, o) in enumerate(zip(comps, old, strict=True)):
        if len(c) != len(o):
            raise RlkitError(f"row {i}: {len(c)} completion tokens but {len(o)} old log-probs; the rollouts table is corrupt")
    ids, attn, targets, mask, start = pack_sequences(prompts, comps, pad_id)
    C = targets.shape[1]
    ref = None
    if "ref_logprobs" in table.column_names:
        ref = _padded(table.column("ref_logprobs").to_pylist(), C)
    reward_cols = {n.split("/", 1)[1]: table.column(n).to_pylist() for n in table.column_names if n.startswith("reward/")}
    if length_penalty:
        reward_cols["length_penalty"] = [-length_penalty * len(c) for c in comps]
        weights = None if weights is None else {**weights, "length_penalty": 1.0}
    rewards, used = combine_rewards(reward_cols, weights)
    groups = torch.tensor(table.column("group_id").to_pylist(), dtype=torch.long)
    return RLBatch(ids, attn, targets, mask, start, _padded(old, C), ref, rewards, groups), used


def make_optimizer(model, cfg: RLConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (LoRA: the adapter only); state is saved per parameter name."""
    from rlkit.training import make_adamw

    return make_adamw(model, cfg.lr, cfg.weight_decay, betas=(0.9, 0.99), eps=1e-8)


@dataclass
class TrainerState:
    """What carries over between `update` processes besides the weights."""

    optimizer_step: int = 0
    updates: int = 0
    precision: dict | None = None  # rlkit.training.Precision.state(): the fp16 loss scale to resume with

    def lr_factor(self, warmup: int) -> float:
        return min(1.0, (self.optimizer_step + 1) / warmup) if warmup > 0 else 1.0


def trainer_tensors(model, opt: torch.optim.Optimizer, dp: DataParallel | None = None) -> dict[str, Tensor]:
    """AdamW moments and step per parameter name plus the torch RNG, unsharded (a collective under `dp`)."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if dp is not None:
        from rlkit.distributed import full_optimizer_state

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
        from rlkit.distributed import load_full_optimizer_state

        load_full_optimizer_state(model, opt, per_name)
    else:
        for name, p in model.named_parameters():
            if name in per_name:
                st = per_name[name]
                opt.state[p] = {"step": st["step"], "exp_avg": st["exp_avg"].to(p.dtype),
                                "exp_avg_sq": st["exp_avg_sq"].to(p.dtype)}
    torch.set_rng_state(tensors["rng/torch"])
    s = json.loads((d / "state.json").read_text())
    return TrainerState(optimizer_step=s["optimizer_step"], updates=s["updates"], precision=s.get("precision"))


def optimizer_step(model, opt: torch.optim.Optimizer, state: TrainerState, cfg: RLConfig, loss: Tensor,
                   global_loss: float | None = None, prec: Precision | None = None,
                   inputs: Callable[[], dict] | None = None) -> Tensor:
    """Backward (loss-scaled under fp16), clip, step with the scheduled LR; a NaN/inf loss or (fp32/bf16)
    gradient aborts before any write, an fp16 overflow skips the step as any loss scaler does.
    Returns the gradient norm before clipping. Data-parallel: `global_loss` (the same on every rank)
    decides, so all ranks stop together; FSDP's gradient norm is already global. `inputs`, called only
    when the step fails: the step's inputs for `non_finite_error`."""
    if not math.isfinite(loss.item() if global_loss is None else global_loss):
        raise non_finite_error("loss", state, cfg, inputs)
    prec = prec or Precision()
    opt.zero_grad(set_to_none=True)
    for g in opt.param_groups:
        g["lr"] = cfg.lr * state.lr_factor(cfg.warmup_steps)
    prec.backward(loss)
    (gn,), stepped = prec.step([(model.parameters(), opt, cfg.grad_clip)])
    if not stepped and prec.scaler is None:
        raise non_finite_error("gradient", state, cfg, inputs)
    state.optimizer_step += 1
    return gn


def non_finite_error(what: str, state: TrainerState, cfg: RLConfig, inputs: Callable[[], dict] | None) -> RlkitError:
    """A NaN/inf `what` (loss, gradient): the step's non-finite input when one was (`inputs()`: what to
    call it -> tensor or model, see `rlkit.errors.non_finite_cause`), else the step diverged: lower --lr."""
    cause = non_finite_cause(inputs()) if inputs is not None else None
    tail = f": {cause}" if cause else f" (lower --lr, now {cfg.lr})"
    return RlkitError(f"non-finite {what} at optimizer step {state.optimizer_step}; nothing was written{tail}")


def batch_inputs(batch: RLBatch, old_logp: Tensor, recompute: bool, tis: Tensor | None, uses_ref: bool,
                 model=None, **derived: Tensor) -> dict:
    """What a policy step reads, root causes first, for `non_finite_error`: the input table's columns
    that reach the loss (`uses_ref`: a KL term or penalty reads ref_logprobs), the rewards, `model`'s
    weights (the starting ones: pass it on a process's first step only, later a diverged step can have
    made them non-finite), then `derived` tensors."""
    return {"the input table's old_logprobs": batch.old_logp if not recompute or tis is not None else None,
            "the input table's ref_logprobs": batch.ref_logp if uses_ref else None,
            "the reward (the input table's reward/* columns)": batch.rewards,
            "the starting weights": model,
            "the recomputed pi_old": old_logp if recompute else None,
            **{f"the {k.replace('_', ' ')}": v for k, v in derived.items()}}


def recompute_logprobs(model, batch: RLBatch, temperature: float, minibatch_size: int,
                       prec: Precision | None = None) -> Tensor:
    """The trainer's own log-probs of the sampled tokens under `model` in its training precision, no
    grad: (N, C), 0 off the mask."""
    out = torch.zeros_like(batch.old_logp)
    with torch.no_grad(), (prec or Precision()).autocast():
        for s in range(0, len(out), minibatch_size):
            idx = torch.arange(s, min(len(out), s + minibatch_size))
            L = int(batch.attn[idx].sum(1).max())
            C = int(batch.mask[idx].sum(1).max())
            lp, _ = completion_logprobs(model, batch.input_ids[idx, :L], batch.attn[idx, :L], batch.targets[idx, :C],
                                        batch.start[idx], temperature=temperature)
            out[idx, :C] = lp * batch.mask[idx, :C]
    return out


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


def train_on_batch(model, opt: torch.optim.Optimizer, state: TrainerState, batch: RLBatch, cfg: RLConfig,
                   temperature: float = 1.0, length_norm: float | None = None, ticker=None,
                   recompute: bool = False, dp: DataParallel | None = None,
                   lags: Tensor | None = None, prec: Precision | None = None) -> dict[str, Any]:
    """Advantages, then `epochs` passes of shuffled minibatches of the clipped surrogate (+ KL term).

    Data-parallel (`dp`): every rank holds the whole batch and the same minibatch order and trains on
    rows rank::world of each minibatch; its loss is its share of the minibatch loss (see
    `losses.AGG_WEIGHTS`) times world, which FSDP's gradient averaging turns into the one-process sum.

    `recompute`: pi_old is the trainer's own forward pass before the first step rather than the
    engine's logged log-probs (their gap is logged as `logprob_mismatch`); with `cfg.tis_cap` the
    per-token loss is also weighted by min(pi_old / pi_engine, cap). `lags` (N,): each row's policy
    lag (`update --follow`), for the mismatch metrics. `prec`: the compute precision (autocast and
    fp16 loss scaling, `rlkit.training.Precision`); default fp32.
    """
    prec = prec or Precision()
    t0 = time.monotonic()
    agg = AGGREGATIONS[cfg.aggregation]
    mask = batch.mask
    if cfg.beta > 0 and batch.ref_logp is None:
        raise RlkitError("--beta > 0 needs reference log-probs: pipe the rollouts through `rlkit score-ref --ref REF` "
                         "(or pass --beta 0)")
    if cfg.tis_cap is not None and not recompute:
        raise RlkitError("--tis-cap needs the recomputed pi_old (--old-logprobs recompute)")
    rewards = batch.rewards
    metrics: dict[str, Any] = {"old_logprobs": "recompute" if recompute else "engine"}
    old_logp, tis = batch.old_logp, None
    if recompute:
        model.train()
        old_logp = recompute_logprobs(model, batch, temperature, cfg.minibatch_size, prec)
        metrics.update(mismatch_metrics(old_logp, batch.old_logp, mask, lags))
        if cfg.tis_cap is not None:
            tis = truncated_is_weights(old_logp, batch.old_logp, cfg.tis_cap)
            metrics.update(tis_weight_mean=float(tis[mask].mean()),
                           tis_capped_fraction=float((tis[mask] >= cfg.tis_cap).float().mean()))
    if batch.ref_logp is not None:
        kl_tok = kl_per_token(cfg.kl_estimator, old_logp, batch.ref_logp, mask)
        metrics["kl_per_token"] = float(kl_tok.sum() / mask.sum().clamp(min=1))
        metrics["kl_per_seq"] = float(kl_tok.sum(1).mean())
        if cfg.kl_in == "reward" and cfg.beta > 0:
            rewards = rewards - cfg.beta * kl_tok.sum(1)
    adv = ADVANTAGES[cfg.algo](rewards, batch.groups, lengths=mask.sum(1))
    counts = degenerate_groups(batch.rewards, batch.groups)
    keep = torch.arange(len(adv))
    if cfg.drop_degenerate:
        keep = keep[~counts.degenerate_mask]
    metrics.update(degenerate_group_fraction=counts.degenerate / max(1, counts.groups),
                   singleton_groups=counts.singletons, sequences=len(adv), sequences_trained=len(keep))
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + state.updates)
    clip_n = dual_n = tok_n = 0
    ratio_min, ratio_max, ratio_sum = math.inf, -math.inf, 0.0
    ent_sum = ent_n = 0.0
    grad_norms, losses = [], []
    model.train()
    tokens = 0
    for epoch in range(cfg.epochs):
        order = keep[torch.randperm(len(keep), generator=gen)]
        for s in range(0, len(order), cfg.minibatch_size):
            idx = order[s : s + cfg.minibatch_size]
            share = 1.0
            if dp is not None:
                idx, share = split_rows(idx, dp, lambda rows: AGG_WEIGHTS[cfg.aggregation](batch.mask[rows]))
            L = int(batch.attn[idx].sum(1).max())
            C = int(batch.mask[idx].sum(1).max())
            m = batch.mask[idx, :C]
            if share == 0.0:
                m = torch.zeros_like(m)
            with prec.autocast():
                logp, ent = completion_logprobs(model, batch.input_ids[idx, :L], batch.attn[idx, :L],
                                                batch.targets[idx, :C], batch.start[idx], temperature=temperature,
                                                with_entropy=epoch == 0)
            in_loss = cfg.beta > 0 and cfg.kl_in == "loss"
            tl = policy_token_loss(logp, old_logp[idx, :C], adv[idx], m, clip_low=cfg.clip_low,
                                   clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                                   tis=None if tis is None else tis[idx, :C],
                                   ref_logp=batch.ref_logp[idx, :C] if in_loss else None,
                                   kl_estimator=cfg.kl_estimator, kl_coef=cfg.beta if in_loss else 0.0)
            loss = agg(tl.loss, m, length_norm) * share
            global_loss = all_sum([loss.item() / dp.world], dp)[0] if dp is not None else None
            gn = optimizer_step(model, opt, state, cfg, loss, global_loss, prec, partial(
                batch_inputs, batch, old_logp, recompute, tis, cfg.beta > 0, None if losses else model, advantage=adv))
            with torch.no_grad():
                r = tl.ratio[m]
                clip_n += int(tl.clipped.sum())
                dual_n += int(tl.dual_clipped.sum())
                tok_n += int(m.sum())
                if r.numel():
                    ratio_min, ratio_max = min(ratio_min, float(r.min())), max(ratio_max, float(r.max()))
                ratio_sum += float(r.sum())
                if ent is not None:
                    ent_sum += float(ent[m].sum())
                    ent_n += int(m.sum())
            tokens += int(batch.attn[idx, :L].sum()) if share else 0
            grad_norms.append(float(gn))
            losses.append(loss.item() if global_loss is None else global_loss)
            if ticker is not None:
                ticker.advance(1, loss=losses[-1])
    state.updates += 1
    if dp is not None:
        clip_n, dual_n, tok_n, ratio_sum, ent_sum, ent_n, tokens = all_sum(
            [clip_n, dual_n, tok_n, ratio_sum, ent_sum, ent_n, tokens], dp)
        ratio_max, neg_min = all_max([ratio_max, -ratio_min], dp)
        ratio_min = -neg_min
    secs = time.monotonic() - t0
    lengths = mask.sum(1).float()
    metrics.update(
        loss=sum(losses) / max(1, len(losses)),
        optimizer_steps=len(losses),
        clip_fraction=clip_n / max(1, tok_n),
        dual_clip_fraction=dual_n / max(1, tok_n),
        ratio_min=ratio_min if tok_n else None, ratio_max=ratio_max if tok_n else None,
        ratio_mean=ratio_sum / max(1, tok_n),
        entropy=ent_sum / ent_n if ent_n else None,
        grad_norm=sum(grad_norms) / max(1, len(grad_norms)),
        advantage_abs_mean=float(adv.abs().mean()),
        mean_response_tokens=float(lengths.mean()),
        train_seconds=round(secs, 3),
        tokens_per_s=round(tokens / secs, 1) if secs > 0 else None,
    )
    if prec.scaler is not None:
        metrics.update(loss_scale=prec.scaler.get_scale(), skipped_steps=prec.skipped)
    return metrics


class PrefBatch(NamedTuple):
    """P preference pairs packed as 2P sequences: rows 0..P-1 the chosen responses, P..2P-1 the rejected."""

    input_ids: Tensor  # (2P, L) long, right-padded prompt + response (+ eos)
    attn: Tensor  # (2P, L)
    targets: Tensor  # (2P, C) response tokens
    mask: Tensor  # (2P, C) bool
    start: Tensor  # (2P,)
    ref_logp: Tensor  # (2P,) summed reference log-probs of each response
    heldout: Tensor  # (P,) bool, split == heldout


def build_pref_batch(table, tokenizer) -> PrefBatch:
    """Tensors from a prefs table that `score-ref --ref` has scored."""
    from rlkit.data import encode_responses

    for col in ("ref_chosen_logp", "ref_rejected_logp"):
        if col not in table.column_names or table.column(col).null_count:
            raise RlkitError("--algo dpo needs the reference's log-probs of chosen and rejected: pipe the prefs "
                             "through `rlkit score-ref --ref REF` first")
    prompts = table.column("prompt").to_pylist()
    p_c, r_c = encode_responses(tokenizer, prompts, table.column("chosen").to_pylist())
    p_r, r_r = encode_responses(tokenizer, prompts, table.column("rejected").to_pylist())
    ids, attn, targets, mask, start = pack_sequences(p_c + p_r, r_c + r_r, tokenizer.pad_token_id)
    ref = torch.tensor(table.column("ref_chosen_logp").to_pylist() + table.column("ref_rejected_logp").to_pylist(),
                       dtype=torch.float32)
    held = torch.tensor([s == "heldout" for s in table.column("split").to_pylist()], dtype=torch.bool)
    return PrefBatch(ids, attn, targets, mask, start, ref, held)


def _pair_logps(model, b: PrefBatch, pairs: Tensor, prec: Precision | None = None) -> Tensor:
    """Summed policy log-probs (2p,) of the chosen then rejected responses of `pairs` (p,)."""
    P = len(b.heldout)
    rows = torch.cat([pairs, pairs + P])
    L = int(b.attn[rows].sum(1).max())
    C = int(b.mask[rows].sum(1).max())
    with (prec or Precision()).autocast():
        lp, _ = completion_logprobs(model, b.input_ids[rows, :L], b.attn[rows, :L], b.targets[rows, :C], b.start[rows])
    return (lp * b.mask[rows, :C]).sum(1)


def train_dpo(model, opt: torch.optim.Optimizer, state: TrainerState, b: PrefBatch, cfg: RLConfig,
              ticker=None, label_smoothing: float = 0.0, dp: DataParallel | None = None,
              prec: Precision | None = None) -> dict[str, Any]:
    """DPO (Rafailov et al. 2023) on the train pairs for `epochs` passes; figures on both splits after.
    Data-parallel (`dp`): pairs rank::world of each minibatch, loss shares as in `train_on_batch`."""
    from rlkit.preference import dpo_loss

    t0 = time.monotonic()
    prec = prec or Precision()
    P = len(b.heldout)
    train = torch.arange(P)[~b.heldout]
    if len(train) == 0:
        raise RlkitError("the prefs table has no train pairs (every pair is split=heldout)")
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + state.updates)
    losses, grad_norms = [], []
    model.train()
    for _ in range(cfg.epochs):
        order = train[torch.randperm(len(train), generator=gen)]
        for s in range(0, len(order), cfg.minibatch_size):
            idx = order[s : s + cfg.minibatch_size]
            share = 1.0
            if dp is not None:
                idx, share = split_rows(idx, dp, len)
            pi = _pair_logps(model, b, idx, prec)
            p = len(idx)
            loss, _, _ = dpo_loss(pi[:p], pi[p:], b.ref_logp[idx], b.ref_logp[idx + P], cfg.beta, label_smoothing)
            loss = loss.mean() * share
            global_loss = all_sum([loss.item() / dp.world], dp)[0] if dp is not None else None
            gn = optimizer_step(model, opt, state, cfg, loss, global_loss, prec,
                                partial(_pref_inputs, b, None if losses else model))
            losses.append(loss.item() if global_loss is None else global_loss)
            grad_norms.append(float(gn))
            if ticker is not None:
                ticker.advance(1, loss=losses[-1])
    state.updates += 1
    # after training: implicit rewards and log-probs on every pair, per split (likelihood displacement:
    # both chosen and rejected log-probs falling below the reference's)
    model.eval()
    with torch.no_grad():
        pi = _both_sides(model, b, cfg.minibatch_size, prec)
    metrics: dict[str, Any] = {"loss": sum(losses) / len(losses), "optimizer_steps": len(losses),
                               "grad_norm": sum(grad_norms) / len(grad_norms), "pairs_trained": len(train)}
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
    secs = time.monotonic() - t0
    metrics.update(train_seconds=round(secs, 3))
    return metrics


def _pref_inputs(b: PrefBatch, model=None) -> dict:
    """What a DPO step reads, for `non_finite_error` (`model` on a process's first step only)."""
    P = len(b.heldout)
    return {"the input table's ref_chosen_logp/ref_rejected_logp": torch.stack([b.ref_logp[:P], b.ref_logp[P:]], 1),
            "the starting weights": model}


def _both_sides(model, b: PrefBatch, chunk: int, prec: Precision | None = None) -> Tensor:
    """Summed policy log-probs (2P,) of every chosen then every rejected response, no grad."""
    P = len(b.heldout)
    parts = [_pair_logps(model, b, c, prec) for c in torch.arange(P).split(chunk)]
    chosen = torch.cat([x[: len(x) // 2] for x in parts])
    rejected = torch.cat([x[len(x) // 2:] for x in parts])
    return torch.cat([chosen, rejected])
