"""`rlkit update`: one policy-gradient update of the policy on one rollout batch.

Reads a policy checkpoint and a rollouts table (or a 'scored' one, with reference log-probs, from
`score-ref`) on stdin or --in. Writes the next checkpoint: weights, `rlkit.json` (step + 1, metrics)
and `trainer/` (AdamW moments and step counter as safetensors, state as JSON), which the next
`update` resumes, so N sequential processes equal one process doing N updates.

Advantages come from a registry (grpo, dr-grpo, rloo, reinforce-pp); the loss is PPO's clipped
surrogate on pi_theta / pi_old with asymmetric clipping and a dual clip for negative advantages, run
for --epochs passes of --minibatch-size sequences, so one rollout batch feeds many optimizer steps.
The KL leash to pi_ref (never pi_old) is a loss term (k3+ by default: k3's value, the forward KL's
gradient) or a reward penalty (k1 by default); `rlkit.kl` says which estimator belongs where. Metrics go to the screen, the manifest, --metrics FILE and
--tensorboard DIR; among them `drift`, the policy's relative weight distance from the reference
(`rlkit.drift`), with a warning above --max-drift. Under torchrun the update is data-parallel
(FSDP2, `rlkit.distributed`): same result as one process, rank 0 writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from rlkit.options import Force, InTable, OutDir, PolicyDir, TrustRemoteCode
from rlkit.rl_config import DEFAULT_DUAL_CLIP, RLConfig

DEFAULT_MAX_DRIFT = 0.05  # relative weight-space distance from the reference; see rlkit.drift


@dataclass(frozen=True)
class UpdateConfig:
    policy: Path
    out: Path
    inp: str | None = None
    rl: RLConfig = field(default_factory=RLConfig)
    reward: tuple[str, ...] = ()  # NAME=WEIGHT; empty: every component with weight 1
    length_penalty: float = 0.0  # reward -= length_penalty * completion tokens
    metrics: Path | None = None
    tensorboard: Path | None = None
    ref: Path | None = None  # for the drift figure; default: the reference score-ref used
    max_drift: float = DEFAULT_MAX_DRIFT
    trust_remote_code: bool = False
    force: bool = False


def parse_weights(specs: tuple[str, ...]) -> dict[str, float] | None:
    from rlkit.errors import RlkitError

    if not specs:
        return None
    out = {}
    for s in specs:
        name, eq, w = s.partition("=")
        try:
            out[name.strip()] = float(w)
        except ValueError:
            eq = ""
        if not eq or not name.strip():
            raise RlkitError(f"--reward {s!r}: expected NAME=WEIGHT, e.g. verifier=1.0")
    return out


def distributed_launch() -> bool:
    import os

    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def run(cfg: UpdateConfig) -> Path:
    from rlkit import artifacts, checkpoints, console, metrics_log
    from rlkit.errors import RlkitError

    weights = parse_weights(cfg.reward)
    checkpoints.check_model_dir(cfg.policy, "policy")
    artifacts.check_out(cfg.out, "model")
    # Open the input on a background thread and import torch and load the policy meanwhile: in a pipe
    # all stages then start up at once, and upstream streams into memory instead of a full pipe.
    cfg.rl.check()
    metrics_log.check_tensorboard(cfg.tensorboard)
    if cfg.ref is not None:
        checkpoints.verify_reference(cfg.ref)
    from rlkit.rl_config import CRITIC_ALGOS, PREFERENCE_ALGOS

    offline = cfg.rl.algo in PREFERENCE_ALGOS
    dp = None
    if distributed_launch():
        from rlkit import distributed

        dp = distributed.init()
    pending = (artifacts.open_table(cfg.inp, ["prefs"] if offline else ["rollouts", "scored"])
               if dp is None or dp.main else None)
    from rlkit import distributed, policy_update

    model, tokenizer = checkpoints.load_policy(cfg.policy, "fp32", cfg.trust_remote_code)
    reader = pending.result() if dp is None else distributed.share_table(pending, dp)
    if offline:
        return _run_dpo(cfg, reader, model, tokenizer, dp)
    if cfg.rl.beta > 0 and reader.kind == "rollouts":
        raise RlkitError("--beta > 0 needs reference log-probs, but the input has none: pipe the rollouts through "
                         "`rlkit score-ref --ref REF` first (or pass --beta 0)")
    inputs = {"policy": artifacts.fingerprint(cfg.policy), "in": reader.fingerprint}
    if artifacts.skip_if_current(cfg.out, "update", cfg, inputs):
        return cfg.out
    table = reader.read_all()
    for col in ("prompt_ids", "completion_ids", "old_logprobs"):
        if table.column(col).null_count:
            raise RlkitError(f"{reader.label}: column '{col}' has missing values; rollouts need token ids and log-probs")
    upstream = reader.manifest or {}
    want = upstream.get("tokenizer")
    if want and want != checkpoints.tokenizer_fingerprint(tokenizer):
        raise RlkitError(f"policy {cfg.policy} has a different tokenizer from the one that sampled these rollouts")
    rollout_cfg = upstream.get("rollout") or upstream.get("config") or {}
    temperature = float(upstream.get("temperature", rollout_cfg.get("temperature", 1.0)))
    batch, used = policy_update.build_batch(table, tokenizer.pad_token_id, weights, cfg.length_penalty)
    length_norm = float(rollout_cfg.get("max_new_tokens") or batch.targets.shape[1])  # Dr. GRPO's constant
    console.info("update: reward = " + " + ".join(f"{w:g}*{k}" for k, w in used.items())
                 + (" (the sum of the components present; weigh them with --reward NAME=W)" if weights is None else ""))
    if any(p != inputs["policy"] for p in set(table.column("policy_fingerprint").to_pylist())):
        console.warn("these rollouts were sampled from another checkpoint than --policy (off-policy); "
                     "the pi_theta/pi_old ratio corrects for it, within the clip range")

    if dp is not None:
        from rlkit.logprobs import _completion_logprobs

        model = distributed.shard_model(model, dp, _completion_logprobs)
        console.info(f"update: data-parallel over {dp.world} processes ({dp.device.type}, FSDP2)")
    opt = policy_update.make_optimizer(model, cfg.rl)
    state = policy_update.load_trainer(model, opt, cfg.policy / policy_update.TRAINER_DIR, dp)
    engine = upstream.get("engine")
    recompute = cfg.rl.old_logprobs == "recompute" or (cfg.rl.old_logprobs == "auto" and engine != "hf")
    if cfg.rl.old_logprobs == "auto" and recompute:
        console.info(f"update: rollouts sampled by engine {engine or 'unknown'}: recomputing pi_old with the trainer "
                     "(--old-logprobs engine to trust the engine's)")
    steps = cfg.rl.epochs * -(-len(table) // cfg.rl.minibatch_size)
    critic = None
    if cfg.rl.algo in CRITIC_ALGOS:
        from rlkit import ppo

        critic, critic_opt, cstate, ctrl, origin = ppo.load_critic(cfg.policy, cfg.rl, tokenizer, cfg.trust_remote_code,
                                                                   dp)
        console.info(f"update: critic {origin}")
        with console.progress("update", steps) as bar:
            m = ppo.train_ppo(model, critic, opt, critic_opt, state, cstate, ctrl, batch, cfg.rl, temperature, bar,
                              recompute, dp, length_norm)
    else:
        with console.progress("update", steps) as bar:
            m = policy_update.train_on_batch(model, opt, state, batch, cfg.rl, temperature, length_norm, bar,
                                             recompute, dp)
    from rlkit.advantages import GROUP_BASELINE

    if m.get("singleton_groups") and cfg.rl.algo in GROUP_BASELINE:
        console.warn(f"update: {m['singleton_groups']} groups have one sample and get advantage 0 under --algo "
                     f"{cfg.rl.algo} (no group baseline); sample --n >= 2 or use --algo reinforce-pp")
    comps = {n.split("/", 1)[1]: table.column(n).to_pylist() for n in table.column_names if n.startswith("reward/")}
    if cfg.length_penalty:
        comps["length_penalty"] = [-cfg.length_penalty * len(c) for c in table.column("completion_ids").to_pylist()]
    rew = batch.rewards
    metrics = {
        "step": checkpoints.policy_step(cfg.policy) + 1,
        "reward_mean": float(rew.mean()),
        "reward_std": float(rew.std()) if len(rew) > 1 else 0.0,
        **{f"reward/{k}": sum(v) / len(v) for k, v in comps.items()},
        **({"verifier_accuracy": sum(v == 1.0 for v in comps["verifier"]) / len(comps["verifier"])}
           if "verifier" in comps else {}),
        **m,
    }
    # gathered on every rank (collectives) under data parallelism; rank 0 alone writes
    full = distributed.full_model_state(model) if dp is not None else None
    opt_tensors = policy_update.trainer_tensors(model, opt, dp)
    critic_gathered = ppo.gather_critic(critic, critic_opt, dp) if critic is not None else None
    if distributed.stand_down(dp, metrics):
        return cfg.out
    metrics.update(_drift(cfg, full if full is not None else dict(model.state_dict()), upstream.get("reference")))
    manifest = artifacts.make_manifest("model", "update", cfg, inputs, step=metrics["step"], metrics=metrics,
                                       reward_weights=used)
    with artifacts.atomic_dir(cfg.out) as tmp:
        checkpoints.save_model(model, tokenizer, tmp, manifest, state_dict=full)
        policy_update.save_trainer(model, opt, state, tmp / policy_update.TRAINER_DIR, opt_tensors)
        if critic is not None:
            ppo.save_critic(critic, critic_opt, cstate, ctrl, tmp / ppo.CRITIC_DIR, critic_gathered)
    metrics_log.write({"stage": "update", "out": str(cfg.out), **metrics}, cfg.metrics, cfg.tensorboard)
    _show(metrics)
    distributed.barrier(dp)
    return cfg.out


def _drift(cfg: UpdateConfig, params: dict, upstream_ref: str | None) -> dict:
    """{'drift': ...} of the policy's weights from --ref or the reference score-ref used; warns above --max-drift."""
    from rlkit import console
    from rlkit.checkpoints import verify_reference
    from rlkit.drift import load_weights, relative_drift

    ref = cfg.ref or (Path(upstream_ref) if upstream_ref else None)
    if ref is None:
        return {}
    if cfg.ref is None and not ref.is_dir():
        console.warn(f"update: no drift figure: the reference score-ref used ({ref}) is not there any more; pass --ref")
        return {}
    verify_reference(ref)
    d = relative_drift(params, load_weights(ref))
    if d > cfg.max_drift:
        console.warn(f"POLICY DRIFT: the weights are {d:.4f} (relative L2) away from the reference {ref}, above "
                     f"--max-drift {cfg.max_drift:g}; check KL, held-out accuracy and response length for reward hacking")
    return {"drift": d}


def _run_dpo(cfg: UpdateConfig, reader, model, tokenizer, dp=None) -> Path:
    """--algo dpo: offline, on a prefs table scored by the reference."""
    from rlkit import artifacts, checkpoints, console, distributed, metrics_log, policy_update

    inputs = {"policy": artifacts.fingerprint(cfg.policy), "in": reader.fingerprint}
    if artifacts.skip_if_current(cfg.out, "update", cfg, inputs):
        return cfg.out
    table = reader.read_all()
    batch = policy_update.build_pref_batch(table, tokenizer)
    if dp is not None:
        from rlkit.logprobs import _completion_logprobs

        model = distributed.shard_model(model, dp, _completion_logprobs)
        console.info(f"update: data-parallel over {dp.world} processes ({dp.device.type}, FSDP2)")
    opt = policy_update.make_optimizer(model, cfg.rl)
    state = policy_update.load_trainer(model, opt, cfg.policy / policy_update.TRAINER_DIR, dp)
    n_train = int((~batch.heldout).sum())
    with console.progress("update", cfg.rl.epochs * -(-n_train // cfg.rl.minibatch_size)) as bar:
        m = policy_update.train_dpo(model, opt, state, batch, cfg.rl, bar, dp=dp)
    metrics = {"step": checkpoints.policy_step(cfg.policy) + 1, "algo": "dpo", "beta": cfg.rl.beta, **m}
    full = distributed.full_model_state(model) if dp is not None else None
    opt_tensors = policy_update.trainer_tensors(model, opt, dp)
    if distributed.stand_down(dp, metrics):
        return cfg.out
    metrics.update(_drift(cfg, full if full is not None else dict(model.state_dict()),
                          (reader.manifest or {}).get("reference")))
    manifest = artifacts.make_manifest("model", "update", cfg, inputs, step=metrics["step"], metrics=metrics)
    with artifacts.atomic_dir(cfg.out) as tmp:
        checkpoints.save_model(model, tokenizer, tmp, manifest, state_dict=full)
        policy_update.save_trainer(model, opt, state, tmp / policy_update.TRAINER_DIR, opt_tensors)
    metrics_log.write({"stage": "update", "out": str(cfg.out), **metrics}, cfg.metrics, cfg.tensorboard)
    _show(metrics, [k for k in metrics if k.startswith(("train_", "heldout_", "loss", "grad_norm", "drift"))])
    distributed.barrier(dp)
    return cfg.out


def _show(metrics: dict, keys: list[str] | None = None) -> None:
    from rich.table import Table

    from rlkit import console

    t = Table(title=f"update step {metrics['step']}", show_header=False)
    default = ("reward_mean", "reward_std", "verifier_accuracy", "kl_per_token", "kl_per_seq", "entropy",
            "clip_fraction", "dual_clip_fraction", "ratio_min", "ratio_mean", "ratio_max", "logprob_mismatch", "logprob_mismatch_max",
            "tis_weight_mean", "tis_capped_fraction", "kl_coef", "kl_coef_next", "value_loss", "value_clip_fraction",
            "explained_variance", "grad_norm", "mean_response_tokens", "drift",
            "degenerate_group_fraction", "optimizer_steps", "tokens_per_s", "train_seconds")
    for k in keys or (*[k for k in metrics if k.startswith("reward/")], *default):
        v = metrics.get(k)
        if v is not None:
            t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    console.err.print(t)


def command(
    policy: PolicyDir,
    out: OutDir,
    inp: InTable = None,
    algo: Annotated[str, typer.Option(help="grpo, dr-grpo, rloo or reinforce-pp (rollouts in; a group of one sample gets advantage 0 from the group-based ones, reinforce-pp whitens over all completion tokens of the batch); ppo (a critic); dpo (a prefs table scored by score-ref in).")] = "grpo",
    lr: Annotated[float, typer.Option(help="AdamW learning rate (default suits the tiny model; ~1e-6 for 1B+ models).")] = RLConfig.lr,
    epochs: Annotated[int, typer.Option(min=1, help="Passes over the rollout batch.")] = RLConfig.epochs,
    minibatch_size: Annotated[int, typer.Option(min=1, help="Sequences per optimizer step.")] = RLConfig.minibatch_size,
    clip_low: Annotated[float, typer.Option(help="Ratio clip below 1: 1 - clip_low.")] = RLConfig.clip_low,
    clip_high: Annotated[float, typer.Option(help="Ratio clip above 1: 1 + clip_high.")] = RLConfig.clip_high,
    dual_clip: Annotated[float, typer.Option(help="Dual clip C (verl's clip_ratio_c): for a negative advantage the clipped loss is capped at -C*A, so a ratio far above 1 cannot blow it up; must be > 1; 0 turns it off.")] = DEFAULT_DUAL_CLIP,
    beta: Annotated[float | None, typer.Option(help=f"KL coefficient to the reference (0: no reference needed; default {RLConfig.beta}); for --algo dpo, DPO's beta (default 0.1).")] = None,
    kl_estimator: Annotated[str | None, typer.Option(help="KL estimator: k1, k2, k3 or k3+. In the reward use k1 (its default): only the log-ratio makes the penalised reward's policy gradient the gradient of KL(pi||pi_ref). In the loss use k3+ (its default: k3's unbiased low-variance value, k2's gradient, which in expectation is the gradient of KL(pi||pi_ref)) or k2; k3 in the loss descends the reverse KL(pi_ref||pi) instead, and k1 in the loss has zero expected gradient (refused).")] = None,
    kl_in: Annotated[str | None, typer.Option(help="Where the KL goes: loss (a loss term) or reward (a per-token penalty); default reward for ppo, loss otherwise.")] = None,
    loss_agg: Annotated[str | None, typer.Option(help="token-mean, seq-mean-token-mean (mean over non-empty responses of their token means) or seq-mean-token-sum-norm (token sums / (responses x the rollout's max_new_tokens)); default: per --algo.")] = None,
    drop_degenerate: Annotated[bool, typer.Option(help="Leave out groups whose rewards are all equal.")] = False,
    reward: Annotated[list[str] | None, typer.Option(help="Reward component weight NAME=W (repeatable), e.g. verifier=1 rm:helpful=0.7; default: sum of all components.")] = None,
    length_penalty: Annotated[float, typer.Option(min=0.0, help="Subtract this times the completion length in tokens from the reward (a 'length_penalty' component).")] = 0.0,
    grad_clip: Annotated[float, typer.Option(help="Gradient norm clip.")] = RLConfig.grad_clip,
    warmup_steps: Annotated[int, typer.Option(min=0, help="Linear LR warmup over this many optimizer steps (counted across updates).")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the minibatch order.")] = 0,
    gamma: Annotated[float, typer.Option(help="ppo: GAE discount.")] = RLConfig.gamma,
    lam: Annotated[float, typer.Option(help="ppo: GAE lambda.")] = RLConfig.lam,
    vf_clip: Annotated[float, typer.Option(help="ppo: value clip range around the old values.")] = RLConfig.vf_clip,
    critic_lr: Annotated[float | None, typer.Option(help="ppo: critic learning rate (default 2x --lr).")] = None,
    critic_init: Annotated[str, typer.Option(help="ppo, first update: initialise the critic from 'policy' or a reward-model DIR (same tokenizer).")] = RLConfig.critic_init,
    target_kl: Annotated[float | None, typer.Option(help="ppo: adapt the KL coefficient towards this KL (Ziegler et al.), starting at --beta. Unit: nats per sequence, i.e. the --kl-estimator's per-token KL of pi_old vs pi_ref summed over each response and averaged over the batch (TRL's convention; the kl_per_seq metric).")] = None,
    old_logprobs: Annotated[str, typer.Option(help="pi_old for the ratio: engine (as logged at rollout), recompute (the trainer's own forward pass before the first step) or auto (recompute unless the hf engine sampled).")] = RLConfig.old_logprobs,
    tis_cap: Annotated[float | None, typer.Option(help="Truncated importance sampling: weight each token's loss by min(pi_recomputed / pi_engine, CAP), e.g. 2.0.")] = None,
    metrics: Annotated[Path | None, typer.Option(help="Append this update's metrics as one JSON line to this file.")] = None,
    tensorboard: Annotated[Path | None, typer.Option(help="Also log the metrics as TensorBoard scalars under this directory (needs the tensorboard extra).")] = None,
    ref: Annotated[Path | None, typer.Option(help="Frozen reference for the drift figure (default: the one score-ref used).")] = None,
    max_drift: Annotated[float, typer.Option(min=0.0, help="Warn when the policy's relative weight distance from the reference exceeds this.")] = DEFAULT_MAX_DRIFT,
    trust_remote_code: TrustRemoteCode = False,
    force: Force = False,
) -> None:
    """One clipped policy-gradient update (GRPO family) with a KL leash; writes the next checkpoint."""
    from rlkit.rl_config import DEFAULT_BETA, DEFAULT_KL_ESTIMATOR

    if kl_estimator == "k3" and (kl_in or ("reward" if algo == "ppo" else RLConfig.kl_in)) == "loss":
        from rlkit import console

        console.info("update: k3 in the loss descends the reverse KL(pi_ref || pi), not KL(pi || pi_ref); "
                     "k3+ reports the same value with the forward KL's gradient")

    beta = beta if beta is not None else DEFAULT_BETA.get(algo, RLConfig.beta)
    kl_in = kl_in or ("reward" if algo == "ppo" else RLConfig.kl_in)
    kl_estimator = kl_estimator or DEFAULT_KL_ESTIMATOR.get(kl_in, RLConfig.kl_estimator)
    rl = RLConfig(algo=algo, lr=lr, epochs=epochs, minibatch_size=minibatch_size, clip_low=clip_low, clip_high=clip_high,
                  dual_clip=dual_clip or None,
                  beta=beta, kl_estimator=kl_estimator, kl_in=kl_in, loss_agg=loss_agg, drop_degenerate=drop_degenerate,
                  grad_clip=grad_clip, warmup_steps=warmup_steps, seed=seed, old_logprobs=old_logprobs, tis_cap=tis_cap,
                  gamma=gamma, lam=lam, vf_clip=vf_clip, critic_lr=critic_lr, critic_init=critic_init,
                  target_kl=target_kl)
    run(UpdateConfig(policy=policy, out=out, inp=inp, rl=rl, reward=tuple(reward or ()), length_penalty=length_penalty,
                     metrics=metrics, tensorboard=tensorboard, ref=ref, max_drift=max_drift,
                     trust_remote_code=trust_remote_code, force=force))
