"""PPO with a learned critic on one rollout batch (the InstructGPT recipe), for `update --algo ppo`.

The critic is a value head on its own transformer (a `AutoModelForSequenceClassification` with
num_labels=1, read at every completion position), initialised from the policy or from a reward
model on the first update and stored in the checkpoint's `critic/` folder with its optimizer state,
so the next `update` resumes it. Per-token rewards are -kl_coef * KL(pi_old || pi_ref) on every
completion token plus the sequence's reward at its last token (`--kl-in reward`, the default for
ppo; `--kl-in loss` puts the KL in the loss instead); advantages come from GAE over the critic's
values, whitened over the batch; the value loss is PPO's clipped one. `--target-kl` adapts the KL
coefficient between updates (Ziegler et al. 2019); its state travels in `critic/kl_controller.json`.

The math is in `rlkit.gae`, `rlkit.losses`, `rlkit.kl`; this module only wires it to the models.
"""

from __future__ import annotations

import json
import math
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlkit.artifacts import MODEL_MANIFEST
from rlkit.distributed import DataParallel, all_sum, split_rows
from rlkit.errors import RlkitError
from rlkit.gae import AdaptiveKLController, clipped_value_loss, gae, kl_penalised_token_rewards, masked_whiten
from rlkit.kl import kl_per_token
from rlkit.logprobs import completion_logprobs
from rlkit.losses import AGG_WEIGHTS, AGGREGATIONS, policy_token_loss, token_mean, truncated_is_weights
from rlkit.policy_update import (
    TRAINER_DIR,
    RLBatch,
    TrainerState,
    batch_inputs,
    load_trainer,
    make_optimizer,
    mismatch_metrics,
    non_finite_error,
    recompute_logprobs,
    save_trainer,
)
from rlkit.rl_config import RLConfig
from rlkit.training import Precision

CRITIC_DIR = "critic"
KL_STATE = "kl_controller.json"


def load_critic(policy: Path, cfg: RLConfig, tokenizer, trust_remote_code: bool = False, dp: DataParallel | None = None,
                train=None, policy_model=None):
    """(critic, its optimizer, its TrainerState, KL controller or None, where it came from); under `dp`
    the critic is sharded like the policy (FSDP2) before its optimizer state is loaded. `train`
    (rlkit.training.TrainOptions): gradient checkpointing applies to the critic as to the policy.

    LoRA (OpenRLHF's choice): when the policy trains a LoRA adapter (`policy_model` is a LoRA model, or
    `train.lora`), the critic does too, with the same settings, on the base it starts from: a LoRA
    policy checkpoint's own adapter and base (plus a value head), or a fresh adapter on the full policy
    or the --critic-init reward model; a LoRA reward model's adapter keeps training as the critic's."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from rlkit import checkpoints

    d = policy / CRITIC_DIR
    if d.is_dir():
        src, kw = d, {}
    elif cfg.critic_init == "policy":
        src, kw = policy, {"num_labels": 1}
    else:
        src, kw = Path(cfg.critic_init), {}
        checkpoints.check_model_dir(src, "critic init")
        rm_tok = checkpoints.load_tokenizer(src, trust_remote_code)
        if checkpoints.tokenizer_fingerprint(rm_tok) != checkpoints.tokenizer_fingerprint(tokenizer):
            raise RlkitError(f"--critic-init {src}: its tokenizer differs from the policy's, so its values cannot "
                             "be read at the policy's tokens; use --critic-init policy")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a fresh value head is "newly initialized" on purpose
    try:
        from rlkit import lora

        if lora.is_adapter_dir(src):  # a LoRA critic resumed, or started from a LoRA policy's or reward model's adapter
            critic = lora.load(src, "seq-cls", trust_remote_code=trust_remote_code)
        else:
            critic = AutoModelForSequenceClassification.from_pretrained(
                str(src), dtype=torch.float32, trust_remote_code=trust_remote_code, use_safetensors=True, **kw)
            opts = (train.lora if train is not None else None) or lora.options_of(policy_model)
            if opts is not None:  # the policy trains a LoRA adapter: so does the critic, with the same settings
                critic = lora.wrap(critic, opts, "seq-cls", src)
    finally:
        hf_logging.set_verbosity(verbosity)
    if critic.config.num_labels != 1:
        raise RlkitError(f"{src} has {critic.config.num_labels} labels; a critic needs one")
    if src == policy:  # a fresh value head: zero, so V starts at 0 everywhere and every process agrees
        with torch.no_grad():
            for p in critic.score.parameters():
                p.zero_()
    critic.config.pad_token_id = tokenizer.pad_token_id
    if train is not None and train.gradient_checkpointing:
        from rlkit.training import enable_gradient_checkpointing

        enable_gradient_checkpointing(critic)
    if dp is not None:
        from rlkit.distributed import shard_model

        critic = shard_model(critic, dp, _critic_values)
    ccfg = RLConfig(lr=cfg.critic_lr or 2 * cfg.lr, weight_decay=cfg.weight_decay)
    opt = make_optimizer(critic, ccfg)
    cstate = load_trainer(critic, opt, d / TRAINER_DIR, dp) if d.is_dir() else TrainerState()
    ctrl = None
    if cfg.target_kl is not None:
        ctrl = (AdaptiveKLController.from_state(json.loads((d / KL_STATE).read_text())) if (d / KL_STATE).is_file()
                else AdaptiveKLController(cfg.beta, cfg.target_kl, cfg.kl_horizon))
    return critic, opt, cstate, ctrl, "resumed" if src == d else f"initialised from {src}"


def gather_critic(critic, opt, dp: DataParallel | None) -> tuple[dict | None, dict]:
    """(full weights or None, full optimizer tensors): collectives under `dp`, on every rank."""
    from rlkit.distributed import full_model_state
    from rlkit.policy_update import trainer_tensors

    return (full_model_state(critic) if dp is not None else None), trainer_tensors(critic, opt, dp)


def save_critic(critic, opt, cstate: TrainerState, ctrl: AdaptiveKLController | None, d: Path,
                gathered: tuple[dict | None, dict] | None = None) -> None:
    from rlkit import lora

    full, tensors = gathered if gathered is not None else (None, None)
    if lora.state(critic) is not None:  # the adapter, and its base's path and hashes for the next update
        d.mkdir(parents=True, exist_ok=True)
        entry = lora.save(critic, d, full)
        (d / MODEL_MANIFEST).write_text(json.dumps({"kind": "critic", "lora": entry}, indent=2, sort_keys=True) + "\n")
    else:
        critic.save_pretrained(d, safe_serialization=True, **({"state_dict": full} if full is not None else {}))
    save_trainer(critic, opt, cstate, d / TRAINER_DIR, tensors)
    if ctrl is not None:
        (d / KL_STATE).write_text(json.dumps(ctrl.state_dict()) + "\n")


def critic_values(critic, input_ids: Tensor, attn: Tensor, start: Tensor, C: int) -> Tensor:
    """V(state before completion token t) for t < C: the value head at position start + t. -> (B, C)."""
    root = getattr(critic, "_rlkit_fsdp_root", None)
    if root is not None:  # FSDP2: through the root unit, fn = _critic_values
        return root(input_ids, attn, start, C)
    return _critic_values(critic, input_ids, attn, start, C)


def _critic_values(critic, input_ids: Tensor, attn: Tensor, start: Tensor, C: int) -> Tensor:
    hidden = critic.base_model(input_ids=input_ids, attention_mask=attn, use_cache=False).last_hidden_state  # (B, L, H)
    idx = (start.unsqueeze(1) + torch.arange(C).unsqueeze(0)).clamp(max=input_ids.shape[1] - 1)
    h = hidden.gather(1, idx.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # (B, C, H)
    return critic.score(h).squeeze(-1).float()


def _values(critic, batch: RLBatch, chunk: int, prec: Precision) -> Tensor:
    out = torch.zeros_like(batch.old_logp)
    with torch.no_grad(), prec.autocast():
        for s in range(0, len(out), chunk):
            idx = torch.arange(s, min(len(out), s + chunk))
            L, C = int(batch.attn[idx].sum(1).max()), int(batch.mask[idx].sum(1).max())
            out[idx, :C] = critic_values(critic, batch.input_ids[idx, :L], batch.attn[idx, :L], batch.start[idx], C)
    return out * batch.mask


def _step_inputs(batch: RLBatch, old_logp: Tensor, recompute: bool, tis: Tensor | None, uses_kl: bool,
                 values: Tensor, adv: Tensor, models: tuple | None) -> dict:
    """What a PPO step reads, root causes first, for `non_finite_error` (`models`, (policy, critic), on a
    process's first step only: their starting weights)."""
    policy, critic = models or (None, None)
    return {**batch_inputs(batch, old_logp, recompute, tis, uses_kl and batch.ref_logp is not None, policy),
            "the critic's starting weights": critic, "the critic's value estimate": values, "the advantage": adv}


def train_ppo(model, critic, opt, critic_opt, state: TrainerState, cstate: TrainerState,
              ctrl: AdaptiveKLController | None, batch: RLBatch, cfg: RLConfig, temperature: float = 1.0,
              ticker=None, recompute: bool = False, dp: DataParallel | None = None,
              length_norm: float | None = None, prec: Precision | None = None) -> dict[str, Any]:
    """GAE advantages from the critic, then `epochs` passes of minibatches updating policy and critic.
    Data-parallel (`dp`): rows rank::world of each minibatch; the policy and value losses each get this
    rank's share of their global denominators (see `rlkit.distributed.split_rows`). `length_norm` is
    the constant of `seq-mean-token-sum-norm` (the rollout's max_new_tokens), as in `train_on_batch`.
    `prec`: compute precision for both models (one loss scale under fp16: they share one backward)."""
    t0 = time.monotonic()
    prec = prec or Precision()
    mask = batch.mask
    agg = AGGREGATIONS[cfg.aggregation]
    if cfg.beta > 0 and batch.ref_logp is None:
        raise RlkitError("--beta > 0 needs reference log-probs: pipe the rollouts through `rlkit score-ref --ref REF` "
                         "(or pass --beta 0)")
    metrics: dict[str, Any] = {"old_logprobs": "recompute" if recompute else "engine"}
    model.train()
    critic.train()
    old_logp = batch.old_logp
    if recompute:
        old_logp = recompute_logprobs(model, batch, temperature, cfg.minibatch_size, prec)
        metrics.update(mismatch_metrics(old_logp, batch.old_logp, mask))
    elif cfg.tis_cap is not None:
        raise RlkitError("--tis-cap needs the recomputed pi_old (--old-logprobs recompute)")
    tis = truncated_is_weights(old_logp, batch.old_logp, cfg.tis_cap) if cfg.tis_cap is not None else None
    kl_coef = ctrl.value if ctrl is not None else cfg.beta
    kl_tok = (kl_per_token(cfg.kl_estimator, old_logp, batch.ref_logp, mask) if batch.ref_logp is not None
              else torch.zeros_like(old_logp))
    in_reward = cfg.kl_in == "reward" and kl_coef > 0
    token_rewards = kl_penalised_token_rewards(batch.rewards, kl_tok, mask, kl_coef if in_reward else 0.0)
    old_values = _values(critic, batch, cfg.minibatch_size, prec)
    adv, returns = gae(token_rewards, old_values, mask, cfg.gamma, cfg.lam)
    adv = masked_whiten(adv, mask)
    ret_m, val_m = returns[mask], old_values[mask]
    explained = 1 - float((ret_m - val_m).var() / ret_m.var()) if ret_m.numel() > 1 and ret_m.var() > 0 else math.nan
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + state.updates)
    losses, vlosses, grad_norms = [], [], []
    clip_n = dual_n = vclip_n = tok_n = 0
    ent_sum = ent_n = 0.0
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(adv), generator=gen)
        for s in range(0, len(order), cfg.minibatch_size):
            idx = order[s : s + cfg.minibatch_size]
            share = vshare = 1.0
            if dp is not None:
                glob = idx
                idx, share = split_rows(glob, dp, lambda rows: AGG_WEIGHTS[cfg.aggregation](mask[rows]))
                _, vshare = split_rows(glob, dp, lambda rows: mask[rows].sum())  # the value loss is a token mean
            L, C = int(batch.attn[idx].sum(1).max()), int(batch.mask[idx].sum(1).max())
            m = mask[idx, :C] if share else torch.zeros_like(mask[idx, :C])
            ids, att = batch.input_ids[idx, :L], batch.attn[idx, :L]
            with prec.autocast():
                logp, ent = completion_logprobs(model, ids, att, batch.targets[idx, :C], batch.start[idx],
                                                temperature=temperature, with_entropy=epoch == 0)
            in_loss = cfg.kl_in == "loss" and kl_coef > 0
            tl = policy_token_loss(logp, old_logp[idx, :C], adv[idx, :C], m, clip_low=cfg.clip_low,
                                   clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                                   tis=None if tis is None else tis[idx, :C],
                                   ref_logp=batch.ref_logp[idx, :C] if in_loss else None,
                                   kl_estimator=cfg.kl_estimator, kl_coef=kl_coef if in_loss else 0.0)
            loss = agg(tl.loss, m, length_norm) * share
            with prec.autocast():
                v = critic_values(critic, ids, att, batch.start[idx], C)
            vl_tok = clipped_value_loss(v, old_values[idx, :C], returns[idx, :C], cfg.vf_clip)
            vloss = token_mean(vl_tok, m) * vshare
            lv = [loss.item(), vloss.item()]
            if dp is not None:
                lv = [x / dp.world for x in all_sum(lv, dp)]
            inputs = partial(_step_inputs, batch, old_logp, recompute, tis, kl_coef > 0, old_values, adv,
                             None if losses else (model, critic))
            if not all(math.isfinite(x) for x in lv):
                raise non_finite_error("loss", state, cfg, inputs)
            opt.zero_grad(set_to_none=True)
            critic_opt.zero_grad(set_to_none=True)
            for g in opt.param_groups:
                g["lr"] = cfg.lr * state.lr_factor(cfg.warmup_steps)
            prec.backward(loss + vloss)  # separate models: each gets only its own gradient
            (gn, _), stepped = prec.step([(model.parameters(), opt, cfg.grad_clip),
                                          (critic.parameters(), critic_opt, cfg.grad_clip)])
            if not stepped and prec.scaler is None:
                raise non_finite_error("gradient", state, cfg, inputs)
            state.optimizer_step += 1
            cstate.optimizer_step += 1
            with torch.no_grad():
                clip_n += int(tl.clipped.sum())
                dual_n += int(tl.dual_clipped.sum())
                unclipped_v = (v - returns[idx, :C]) ** 2
                vclip_n += int(((0.5 * unclipped_v < vl_tok - 1e-12) & m).sum())
                tok_n += int(m.sum())
                if ent is not None:
                    ent_sum += float(ent[m].sum())
                    ent_n += int(m.sum())
            losses.append(lv[0])
            vlosses.append(lv[1])
            grad_norms.append(float(gn))
            if ticker is not None:
                ticker.advance(1, loss=losses[-1])
    state.updates += 1
    cstate.updates += 1
    if dp is not None:
        clip_n, dual_n, vclip_n, tok_n, ent_sum, ent_n = all_sum([clip_n, dual_n, vclip_n, tok_n, ent_sum, ent_n], dp)
    kl_seq = float(kl_tok.sum(1).mean())
    if batch.ref_logp is not None:
        metrics.update(kl_per_token=float(kl_tok.sum() / mask.sum().clamp(min=1)), kl_per_seq=kl_seq)
    metrics["kl_coef"] = kl_coef
    if ctrl is not None:
        metrics["kl_coef_next"] = ctrl.update(kl_seq, len(adv))
    metrics.update(
        loss=sum(losses) / len(losses), value_loss=sum(vlosses) / len(vlosses), optimizer_steps=len(losses),
        clip_fraction=clip_n / max(1, tok_n), dual_clip_fraction=dual_n / max(1, tok_n), value_clip_fraction=vclip_n / max(1, tok_n),
        entropy=ent_sum / ent_n if ent_n else None, grad_norm=sum(grad_norms) / len(grad_norms),
        values_mean=float(val_m.mean()), returns_mean=float(ret_m.mean()),
        explained_variance=None if math.isnan(explained) else explained,
        sequences=len(adv), sequences_trained=len(adv), mean_response_tokens=float(mask.sum(1).float().mean()),
        train_seconds=round(time.monotonic() - t0, 3),
    )
    if prec.scaler is not None:
        metrics.update(loss_scale=prec.scaler.get_scale(), skipped_steps=prec.skipped)
    return metrics
