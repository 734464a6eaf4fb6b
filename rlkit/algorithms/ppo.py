"""PPO with a learned critic (the InstructGPT recipe), `update --algo ppo`.

The critic is a value head on its own transformer (a `AutoModelForSequenceClassification` with
num_labels=1, read at every completion position), initialised from the policy or from a reward
model on the first update and stored in the checkpoint's `critic/` folder with its optimizer state,
so the next `update` resumes it; the trainer steps it with the policy (one backward, one loss scale).
Per-token rewards are -kl_coef * KL(pi_old || pi_ref) on every completion token plus the sequence's
reward at its last token (`--kl-in reward`, the default for ppo; `--kl-in loss` puts the KL in the
loss instead), plus a `token_rewards` column's values at their own tokens (their sum is taken out of the last
token's share) and, with --teacher-coef, the teacher's per-token term -C * (log pi_old - log pi_teacher); advantages come from GAE over the critic's values, whitened over the batch; the value
loss is PPO's clipped one, a token mean. `--target-kl` adapts the KL coefficient between updates
(Ziegler et al. 2019); its state travels in `critic/kl_controller.json`.

Multi-turn rows (a `loss_mask`): the environment's tokens are context, not actions. The KL penalty sits on
the sampled tokens only and the sequence's reward on its last sampled token; GAE steps over the
environment's tokens, so the value of the next turn's first sampled token (which has read the environment's
reply) bootstraps the previous turn's last one, undiscounted by the tokens between; the policy and the
value losses train on the sampled tokens only (verl's response_mask), so the critic is never fitted, nor
read, at a token the policy did not choose.

The math is in `rlkit.ops.gae`, `rlkit.ops.losses`, `rlkit.ops.kl`; this module wires it to the models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlkit.algorithms.batch import RLBatch
from rlkit.algorithms.config import RLConfig
from rlkit.algorithms.policy_gradient import PGPlan, PolicyGradient
from rlkit.errors import RlkitError
from rlkit.io.manifests import MODEL_MANIFEST
from rlkit.ops.advantages import teacher_advantage
from rlkit.ops.gae import (
    AdaptiveKLController,
    clipped_value_loss,
    explained_variance,
    gae,
    kl_penalised_token_rewards,
    masked_whiten,
)
from rlkit.ops.logprobs import hidden_states
from rlkit.ops.losses import token_mean
from rlkit.ops.packing import Seqs, scatter
from rlkit.training import Optim
from rlkit.training.distributed import DataParallel
from rlkit.training.engine import (
    TRAINER_DIR,
    Trained,
    TrainerState,
    load_trainer,
    make_optimizer,
    save_trainer,
    trainer_tensors,
)

if TYPE_CHECKING:
    from rlkit.algorithms.base import Minibatch
    from rlkit.training.engine import Engine as Trainer

CRITIC_DIR = "critic"
KL_STATE = "kl_controller.json"


class PPO(PolicyGradient):
    name = "ppo"
    shown = (*PolicyGradient.shown, "kl_coef", "kl_coef_next", "value_loss", "value_clip_fraction",
             "explained_variance")
    extra_sums = ("value_clipped",)
    teacher_in_rewards = True  # --teacher-coef: the teacher's term is a per-token reward GAE propagates

    def __init__(self, cfg: RLConfig) -> None:
        super().__init__(cfg)
        self.critic: Trained | None = None
        self.ctrl: AdaptiveKLController | None = None

    def load(self, trainer: Trainer, src: Path) -> None:
        from rlkit import console

        critic, opt, cstate, self.ctrl, origin = load_critic(
            src, self.cfg, trainer.tokenizer, trainer.trust_remote_code, trainer.dp, trainer.train_options,
            trainer.model, device=trainer.device)
        self.critic = Trained(critic, opt, cstate)
        console.info(f"update: critic {origin}")

    def trained(self) -> list[Trained]:
        return [self._critic()]

    def gather(self, trainer: Trainer) -> tuple[dict | None, dict]:
        c = self._critic()
        return gather_critic(c.model, c.opt, trainer.dp)

    def save(self, trainer: Trainer, d: Path, gathered: Any) -> None:
        c = self._critic()
        save_critic(c.model, c.opt, c.state, self.ctrl, d / CRITIC_DIR, gathered)

    def _critic(self) -> Trained:
        if self.critic is None:
            raise RlkitError("--algo ppo trains a critic: load it with Trainer.load(checkpoint) first")
        return self.critic

    def kl_coef(self, cfg: RLConfig) -> float:
        return self.ctrl.value if self.ctrl is not None else cfg.beta

    def advantages(self, trainer: Trainer, batch: RLBatch, old_logp: Tensor, kl_tok: Tensor | None, kl_coef: float,
                   cfg: RLConfig, metrics: dict, host: RLBatch | None = None) -> tuple[Tensor, dict[str, Any]]:
        """GAE over the critic's values of the KL-penalised per-token rewards, whitened: (N, C)."""
        mask = batch.mask
        kl = kl_tok if kl_tok is not None else torch.zeros_like(old_logp)
        in_reward = cfg.kl_in == "reward" and kl_coef > 0
        token_rewards = kl_penalised_token_rewards(batch.rewards, kl, mask, kl_coef if in_reward else 0.0,
                                                   batch.token_rewards)  # a token_rewards column at its tokens
        if cfg.teacher_coef > 0:  # on-policy distillation's per-token reward, through GAE with the rest
            token_rewards = token_rewards + teacher_advantage(old_logp, batch.teacher_logp, mask, cfg.teacher_coef)
        old_values = _values(trainer, self._critic().model, batch, cfg.minibatch_size, host)
        adv, returns = gae(token_rewards, old_values, mask, cfg.gamma, cfg.lam)
        adv = masked_whiten(adv, mask)
        ret_m, val_m = returns[mask], old_values[mask]
        metrics.update(values_mean=float(val_m.mean()), returns_mean=float(ret_m.mean()),
                       explained_variance=explained_variance(ret_m, val_m), kl_coef=kl_coef)
        return adv, {"old_values": old_values, "returns": returns, "kl_per_seq": float(kl.sum(1).mean())}

    def extra_weights(self, host: RLBatch) -> dict:
        return {"value_loss": lambda rows: host.mask[rows].sum()}  # the value loss is a token mean

    def extra_terms(self, trainer: Trainer, plan: PGPlan, mb: Minibatch, seqs: Seqs,
                    mask: Tensor) -> tuple[dict[str, Tensor], dict[str, float]]:
        """PPO's clipped value loss, a token mean over the policy's tokens, and its clipped-token count."""
        idx, C = mb.idx, mask.shape[1]
        with trainer.prec.autocast():
            v = critic_values(self._critic().model, seqs)
        returns = plan.extra["returns"][idx, :C]
        vl_tok = clipped_value_loss(v, plan.extra["old_values"][idx, :C], returns, plan.cfg.vf_clip)
        vloss = token_mean(vl_tok, mask) * mb.shares["value_loss"]
        with torch.no_grad():  # a () tensor: read with the step's other figures, in one sync
            clipped = ((0.5 * (v - returns) ** 2 < vl_tok - 1e-12) & mask).sum()
        return {"value_loss": vloss}, {"value_clipped": clipped}

    def step_inputs(self, plan: PGPlan, first: bool) -> dict:
        return {"the critic's starting weights": self._critic().model if first else None,
                "the critic's value estimate": plan.extra["old_values"], "the advantage": plan.adv}

    def finish(self, trainer: Trainer, plan: PGPlan, sums: dict[str, float], maxes: dict[str, float]) -> dict[str, Any]:
        out = super().finish(trainer, plan, sums, maxes)
        out["value_clip_fraction"] = sums["value_clipped"] / max(1, sums["policy_tokens"])
        if self.ctrl is not None:
            out["kl_coef_next"] = self.ctrl.update(plan.extra["kl_per_seq"], len(plan.adv))
        return out


def load_critic(policy: Path, cfg: RLConfig, tokenizer, trust_remote_code: bool = False, dp: DataParallel | None = None,
                train=None, policy_model=None, device=None):
    """(critic, its optimizer, its TrainerState, KL controller or None, where it came from); under `dp`
    the critic is sharded like the policy (FSDP2) before its optimizer state is loaded. `train`
    (rlkit.training.TrainOptions): gradient checkpointing applies to the critic as to the policy.

    LoRA (OpenRLHF's choice): when the policy trains a LoRA adapter (`policy_model` is a LoRA model, or
    `train.lora`), the critic does too, with the same settings, on the base it starts from: a LoRA
    policy checkpoint's own adapter and base (plus a value head), or a fresh adapter on the full policy
    or the --critic-init reward model; a LoRA reward model's adapter keeps training as the critic's."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from rlkit.io import checkpoints

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
        from rlkit.io import adapters
        from rlkit.training import lora

        if adapters.is_adapter_dir(src):  # a LoRA critic resumed, or started from a LoRA policy's or reward model's adapter
            critic = adapters.load(src, "seq-cls", trust_remote_code=trust_remote_code)
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
        from rlkit.training.distributed import shard_model

        critic = shard_model(critic, dp, _critic_values, train.on(dp.device).dtype if train is not None else "fp32")
    elif device is not None:
        critic.to(device)  # beside the policy, before its optimizer state is loaded onto it
    opt = make_optimizer(critic, Optim(lr=cfg.critic_lr or 2 * cfg.lr, weight_decay=cfg.weight_decay))
    cstate = load_trainer(critic, opt, d / TRAINER_DIR, dp) if d.is_dir() else TrainerState()
    ctrl = None
    if cfg.target_kl is not None:
        ctrl = (AdaptiveKLController.from_state(json.loads((d / KL_STATE).read_text())) if (d / KL_STATE).is_file()
                else AdaptiveKLController(cfg.beta, cfg.target_kl, cfg.kl_horizon))
    return critic, opt, cstate, ctrl, "resumed" if src == d else f"initialised from {src}"


def gather_critic(critic, opt, dp: DataParallel | None) -> tuple[dict | None, dict]:
    """(full weights or None, full optimizer tensors): collectives under `dp`, on every rank."""
    from rlkit.training.distributed import full_model_state

    return (full_model_state(critic) if dp is not None else None), trainer_tensors(critic, opt, dp)


def save_critic(critic, opt, cstate: TrainerState, ctrl: AdaptiveKLController | None, d: Path,
                gathered: tuple[dict | None, dict] | None = None) -> None:
    from rlkit.io import adapters

    full, tensors = gathered if gathered is not None else (None, None)
    if adapters.state(critic) is not None:  # the adapter, and its base's path and hashes for the next update
        d.mkdir(parents=True, exist_ok=True)
        entry = adapters.save(critic, d, full)
        (d / MODEL_MANIFEST).write_text(json.dumps({"kind": "critic", "lora": entry}, indent=2, sort_keys=True) + "\n")
    else:
        critic.save_pretrained(d, safe_serialization=True, **({"state_dict": full} if full is not None else {}))
    save_trainer(critic, opt, cstate, d / TRAINER_DIR, tensors)
    if ctrl is not None:
        (d / KL_STATE).write_text(json.dumps(ctrl.state_dict()) + "\n")


def critic_values(critic, seqs: Seqs) -> Tensor:
    """V(state before completion token t) for each completion token of `seqs` (`rlkit.ops.packing`, padded or
    packed): the value head at the position whose output predicts the token. -> (r, C), 0 past each end."""
    root = getattr(critic, "_rlkit_fsdp_root", None)
    if root is not None:  # FSDP2: through the root unit, fn = _critic_values
        return root(seqs)
    return _critic_values(critic, seqs)


def _critic_values(critic, seqs: Seqs) -> Tensor:
    h = hidden_states(critic, seqs)[seqs.pos]  # (K, H)
    return scatter(critic.score(h).squeeze(-1).float(), seqs)


def _values(engine, critic, batch: RLBatch, chunk: int, host: RLBatch | None = None) -> Tensor:
    """The critic's values (N, C) of a batch on its device, `chunk` rows (or the engine's micro-batches) at a
    time, laid out like the policy's (`Engine.layout`), 0 off the mask. `host`: the same batch on the CPU
    (sizes and tokens without a device sync; default `batch`)."""
    from rlkit.ops.packing import from_padded

    host = batch if host is None else host
    tokens, plens = from_padded(host.input_ids, host.attn, host.start)
    out = torch.zeros_like(batch.old_logp)
    C = out.shape[1]

    def run(rows: Tensor) -> Tensor:
        v = critic_values(critic, engine.layout([tokens[i] for i in rows], [plens[i] for i in rows]))
        return torch.nn.functional.pad(v, (0, C - v.shape[1]))

    with engine.prec.autocast():  # data-parallel: each rank its share of the rows, then gathered
        engine.forward_rows(torch.arange(len(out)), host.attn.sum(1), chunk, run, out)
    return out * batch.mask
