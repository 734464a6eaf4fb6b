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

from rlkit.options import (
    Force,
    GradCheckpointing,
    InTable,
    LoraAlpha,
    LoraDropout,
    LoraRank,
    LoraTargets,
    NoVerify,
    OutDir,
    PolicyDir,
    TrainDtype,
    TrustRemoteCode,
    train_options,
)
from rlkit.rl_config import DEFAULT_DUAL_CLIP, RLConfig
from rlkit.training import TrainOptions

DEFAULT_MAX_DRIFT = 0.05  # relative weight-space distance from the reference; see rlkit.drift
DEFAULT_MAX_LAG = 1  # --follow: steps a row's sampling policy may lag behind the policy it trains
# --follow: --tis-cap when not given, applied whenever pi_old is recomputed (lagged rows, a non-HF engine):
# decoupled PPO clips against the proximal policy and weighs by proximal / behaviour, capped
DEFAULT_FOLLOW_TIS_CAP = 2.0


@dataclass(frozen=True)
class UpdateConfig:
    policy: Path
    out: Path
    inp: str | None = None
    rl: RLConfig = field(default_factory=RLConfig)
    train: TrainOptions = field(default_factory=TrainOptions)  # --dtype, --gradient-checkpointing, --lora-*
    reward: tuple[str, ...] = ()  # NAME=WEIGHT; empty: every component with weight 1
    length_penalty: float = 0.0  # reward -= length_penalty * completion tokens
    metrics: Path | None = None
    tensorboard: Path | None = None
    ref: Path | None = None  # for the drift figure; default: the reference score-ref used
    max_drift: float = DEFAULT_MAX_DRIFT
    # --follow: --out is a directory of step-NNNNNN/ checkpoints, one per --batch-prompts prompts of an
    # unbounded input stream (see rlkit.follow)
    follow: bool = False
    batch_prompts: int | None = None  # None: the upstream `rollout --follow`'s
    max_steps: int | None = None  # steps after --policy's at which the run ends
    keep: int | None = None  # prune all but the newest K steps (never fewer than the lag bound needs)
    max_lag: int = DEFAULT_MAX_LAG
    trust_remote_code: bool = False
    verify: bool = True  # --no-verify: load without the weights' hash check (never for a reference)
    force: bool = False


def parse_weights(specs: tuple[str, ...]) -> dict[str, float] | None:
    import math

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
        if eq and not math.isfinite(out[name.strip()]):
            raise RlkitError(f"--reward {s!r}: the weight must be a finite number")
        if not eq or not name.strip():
            raise RlkitError(f"--reward {s!r}: expected NAME=WEIGHT, e.g. verifier=1.0")
    return out


def distributed_launch() -> bool:
    import os

    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def run(cfg: UpdateConfig) -> Path:
    """Claims --out (see `artifacts.claim_out`: never over an input, one writer) and runs the stage."""
    from rlkit import artifacts, checkpoints

    inputs = {"--policy": cfg.policy, "--in": cfg.inp, "--ref": cfg.ref}
    if cfg.follow:  # --out is a directory of steps with its own writer lock (rlkit.follow)
        artifacts.check_not_input(cfg.out, inputs)
        with checkpoints.verifying(cfg.verify):
            return _run(cfg)
    with artifacts.claim_out(cfg.out, "model", inputs), checkpoints.verifying(cfg.verify):
        return _run(cfg)


def _run(cfg: UpdateConfig) -> Path:
    from rlkit import artifacts, checkpoints, console, lora, metrics_log
    from rlkit.errors import RlkitError

    weights = parse_weights(cfg.reward)
    checkpoints.check_model_dir(cfg.policy, "policy")
    if cfg.follow:
        _check_follow(cfg)
    else:
        artifacts.check_out(cfg.out, "model")
    # Open the input on a background thread and import torch and load the policy meanwhile: in a pipe
    # all stages then start up at once, and upstream streams into memory instead of a full pipe.
    cfg.rl.check()
    cfg.train.check(distributed=distributed_launch())
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
    if cfg.follow:
        return _run_follow(cfg, pending, weights)
    from rlkit import distributed, training

    model, tokenizer = checkpoints.load_policy(cfg.policy, "fp32", cfg.trust_remote_code)
    model = training.prepare_model(model, cfg.train, "causal-lm", base=cfg.policy)
    reader = pending.result() if dp is None else distributed.share_table(pending, dp)
    if offline:
        return _run_dpo(cfg, reader, model, tokenizer, dp)
    if cfg.rl.beta > 0 and reader.kind == "rollouts":
        raise RlkitError(_NO_REF)
    inputs = {"policy": artifacts.fingerprint(cfg.policy), "in": reader.fingerprint}
    if artifacts.skip_if_current(cfg.out, "update", cfg, inputs):
        return cfg.out
    table = reader.read_all()
    upstream = reader.manifest or {}
    _check_upstream(cfg, upstream, tokenizer)
    if any(p != inputs["policy"] for p in set(table.column("policy_fingerprint").to_pylist())):
        console.warn("these rollouts were sampled from another checkpoint than --policy (off-policy); "
                     "the pi_theta/pi_old ratio corrects for it, within the clip range")

    if dp is not None:
        from rlkit.logprobs import _completion_logprobs

        model = distributed.shard_model(model, dp, _completion_logprobs)
        console.info(f"update: data-parallel over {dp.world} processes ({dp.device.type}, FSDP2)")
    t = _Trainer(cfg, model, tokenizer, dp, weights, step=checkpoints.policy_step(cfg.policy))
    t.load_state(cfg.policy, CRITIC_ALGOS)
    engine = upstream.get("engine")
    recompute = cfg.rl.old_logprobs == "recompute" or (cfg.rl.old_logprobs == "auto" and (
        engine != "hf" or cfg.train.dtype != "fp32"))
    if cfg.rl.old_logprobs == "auto" and recompute:
        why = (f"rollouts sampled by engine {engine or 'unknown'}" if engine != "hf" else
               f"--dtype {cfg.train.dtype} computes other log-probs than the fp32 engine")
        console.info(f"update: {why}: recomputing pi_old with the trainer (--old-logprobs engine to trust the engine's)")
    metrics, used = t.train(table, upstream, cfg.rl, recompute, label=reader.label)
    # gathered on every rank (collectives) under data parallelism; rank 0 alone writes
    gathered = t.gather()
    if distributed.stand_down(dp, metrics):
        return cfg.out
    metrics.update(_drift(cfg, lora.plain_state_dict(t.model, gathered[0]),
                          upstream.get("reference")))
    manifest = artifacts.make_manifest("model", "update", cfg, inputs, step=metrics["step"], metrics=metrics,
                                       reward_weights=used)
    with artifacts.atomic_dir(cfg.out) as tmp:
        t.save(tmp, manifest, gathered)
    metrics_log.write({"stage": "update", "out": str(cfg.out), **metrics}, cfg.metrics, cfg.tensorboard)
    _show(metrics)
    distributed.barrier(dp)
    return cfg.out


_NO_REF = ("--beta > 0 needs reference log-probs, but the input has none: pipe the rollouts through "
           "`rlkit score-ref --ref REF` first (or pass --beta 0)")


def _check_upstream(cfg: UpdateConfig, upstream: dict, tokenizer) -> None:
    from rlkit import checkpoints
    from rlkit.errors import RlkitError

    want = upstream.get("tokenizer")
    if want and want != checkpoints.tokenizer_fingerprint(tokenizer):
        raise RlkitError(f"policy {cfg.policy} has a different tokenizer from the one that sampled these rollouts")


class _Trainer:
    """The policy (and PPO's critic) with their optimizers and counters, kept in memory across the
    updates of one process: one update without --follow, one per batch of prompts with it."""

    def __init__(self, cfg: UpdateConfig, model, tokenizer, dp, weights: dict[str, float] | None, step: int) -> None:
        self.cfg, self.model, self.tokenizer, self.dp, self.weights, self.step = cfg, model, tokenizer, dp, weights, step
        self.critic = self.critic_opt = self.cstate = self.ctrl = None
        self.said_reward = False
        from rlkit.training import Precision

        self.prec = Precision(cfg.train.dtype, dp.device.type if dp is not None else "cpu")

    def load_state(self, src: Path, critic_algos) -> None:
        """Optimizer, counters and RNG (and the critic) from checkpoint `src`; fresh when it has none."""
        from rlkit import console, policy_update

        self.opt = policy_update.make_optimizer(self.model, self.cfg.rl)
        self.state = policy_update.load_trainer(self.model, self.opt, src / policy_update.TRAINER_DIR, self.dp)
        self.prec.load_state(self.state.precision)
        if self.cfg.rl.algo in critic_algos:
            from rlkit import ppo

            self.critic, self.critic_opt, self.cstate, self.ctrl, origin = ppo.load_critic(
                src, self.cfg.rl, self.tokenizer, self.cfg.trust_remote_code, self.dp, self.cfg.train, self.model)
            console.info(f"update: critic {origin}")

    def train(self, table, upstream: dict, rl, recompute: bool, lags=None, label: str = "the input") -> tuple[dict, dict]:
        """One update on `table` (whole groups) -> (metrics, reward weights used); self.step advances."""
        from rlkit import console, policy_update
        from rlkit.advantages import GROUP_BASELINE
        from rlkit.errors import RlkitError

        cfg = self.cfg
        for col in ("prompt_ids", "completion_ids", "old_logprobs"):
            if table.column(col).null_count:
                raise RlkitError(f"{label}: column '{col}' has missing values; rollouts need token ids and log-probs")
        rollout_cfg = upstream.get("rollout") or upstream.get("config") or {}
        temperature = float(upstream.get("temperature", rollout_cfg.get("temperature", 1.0)))
        batch, used = policy_update.build_batch(table, self.tokenizer.pad_token_id, self.weights, cfg.length_penalty)
        length_norm = float(rollout_cfg.get("max_new_tokens") or batch.targets.shape[1])  # Dr. GRPO's constant
        if not self.said_reward:
            console.info("update: reward = " + " + ".join(f"{w:g}*{k}" for k, w in used.items())
                         + (" (the sum of the components present; weigh them with --reward NAME=W)"
                            if self.weights is None else ""))
            self.said_reward = True
        steps = rl.epochs * -(-len(table) // rl.minibatch_size)
        with console.progress(f"update step {self.step + 1}" if cfg.follow else "update", steps) as bar:
            if self.critic is not None:
                from rlkit import ppo

                m = ppo.train_ppo(self.model, self.critic, self.opt, self.critic_opt, self.state, self.cstate,
                                  self.ctrl, batch, rl, temperature, bar, recompute, self.dp, length_norm, self.prec)
            else:
                m = policy_update.train_on_batch(self.model, self.opt, self.state, batch, rl, temperature,
                                                 length_norm, bar, recompute, self.dp, lags=lags, prec=self.prec)
        if m.get("singleton_groups") and rl.algo in GROUP_BASELINE:
            console.warn(f"update: {m['singleton_groups']} groups have one sample and get advantage 0 under --algo "
                         f"{rl.algo} (no group baseline); sample --n >= 2 or use --algo reinforce-pp")
        comps = {n.split("/", 1)[1]: table.column(n).to_pylist() for n in table.column_names
                 if n.startswith("reward/")}
        if cfg.length_penalty:
            comps["length_penalty"] = [-cfg.length_penalty * len(c) for c in table.column("completion_ids").to_pylist()]
        rew = batch.rewards
        self.step += 1
        metrics = {
            "step": self.step,
            "reward_mean": float(rew.mean()),
            "reward_std": float(rew.std()) if len(rew) > 1 else 0.0,
            **{f"reward/{k}": sum(v) / len(v) for k, v in comps.items()},
            **({"verifier_accuracy": sum(v == 1.0 for v in comps["verifier"]) / len(comps["verifier"])}
               if "verifier" in comps else {}),
            **m,
        }
        return metrics, used

    def gather(self) -> tuple:
        """(full policy weights or None, optimizer tensors, critic's): collectives under data parallelism."""
        from rlkit import distributed, policy_update

        full = distributed.full_model_state(self.model) if self.dp is not None else None
        opt_tensors = policy_update.trainer_tensors(self.model, self.opt, self.dp)
        critic = None
        if self.critic is not None:
            from rlkit import ppo

            critic = ppo.gather_critic(self.critic, self.critic_opt, self.dp)
        return full, opt_tensors, critic

    def save(self, tmp: Path, manifest: dict, gathered: tuple, write_manifest: bool = True) -> dict:
        from rlkit import checkpoints, policy_update

        full, opt_tensors, critic = gathered
        self.state.precision = self.prec.state()
        manifest = checkpoints.save_model(self.model, self.tokenizer, tmp, manifest, state_dict=full,
                                          write_manifest=write_manifest)
        policy_update.save_trainer(self.model, self.opt, self.state, tmp / policy_update.TRAINER_DIR, opt_tensors)
        if self.critic is not None:
            from rlkit import ppo

            ppo.save_critic(self.critic, self.critic_opt, self.cstate, self.ctrl, tmp / ppo.CRITIC_DIR, critic)
        return manifest


def _check_follow(cfg: UpdateConfig) -> None:
    from rlkit import follow
    from rlkit.errors import RlkitError
    from rlkit.rl_config import PREFERENCE_ALGOS

    if cfg.rl.algo in PREFERENCE_ALGOS:
        raise RlkitError("--follow trains on a stream of rollouts; --algo dpo is offline (run it without --follow)")
    if distributed_launch():
        raise RlkitError("--follow runs in one process for now: launch it without torchrun (or run per-round "
                         "updates under torchrun)")
    if cfg.max_lag < 0 or (cfg.keep is not None and cfg.keep < 1) or (cfg.max_steps is not None and cfg.max_steps < 1):
        raise RlkitError("--max-lag must be >= 0, --keep >= 1 and --max-steps >= 1")
    follow.check_root(cfg.out)


def _run_follow(cfg: UpdateConfig, pending, weights: dict[str, float] | None) -> Path:
    """`update --follow`: one step per --batch-prompts prompts of the stream, published into --out."""
    from dataclasses import replace

    from rlkit import artifacts, checkpoints, console, follow, lora, metrics_log
    from rlkit.errors import RlkitError
    from rlkit.rl_config import CRITIC_ALGOS

    root = cfg.out
    base_fp = artifacts.fingerprint(cfg.policy)
    base_step = checkpoints.policy_step(cfg.policy)
    with follow.writer_lock(root):
        stale = follow.clean_stale(root)
        if stale:
            console.info(f"update: removed {len(stale)} unfinished step(s) a killed writer left in {root}")
        steps, partial = follow.scan(root)
        if partial:
            raise RlkitError(f"{partial[0]} has no {artifacts.MODEL_MANIFEST}: an incomplete step directory that "
                             "`rlkit update --follow` did not write; remove it")
        start = steps[-1].path if steps else cfg.policy
        if steps:
            m = follow.verify_step(start)
            began = (m.get("follow") or {}).get("base_fingerprint")
            if began != base_fp:
                raise RlkitError(f"{root} holds a run started from another --policy than {cfg.policy} (or one changed "
                                 "since); pass that --policy or a new --out")
        model, tokenizer = checkpoints.load_policy(start, "fp32", cfg.trust_remote_code)
        from rlkit import training

        model = training.prepare_model(model, cfg.train, "causal-lm", base=start)
        base_tok = checkpoints.load_tokenizer(cfg.policy, cfg.trust_remote_code)
        if checkpoints.tokenizer_fingerprint(tokenizer) != checkpoints.tokenizer_fingerprint(base_tok):
            raise RlkitError(f"{start} has a different tokenizer from --policy {cfg.policy}")
        t = _Trainer(cfg, model, tokenizer, None, weights, step=checkpoints.policy_step(start))
        t.load_state(start, CRITIC_ALGOS)
        done = t.step - base_step
        if steps:
            console.info(f"update: resuming {root} from {start.name} (step {t.step}; {done} steps after --policy)")
        if cfg.max_steps is not None and done >= cfg.max_steps:
            console.info(f"update: {root} already has --max-steps {cfg.max_steps} steps after --policy; nothing to do")
            return root
        reader = pending.result()
        upstream = reader.manifest or {}
        if cfg.rl.beta > 0 and reader.kind == "rollouts":
            raise RlkitError(_NO_REF)
        _check_upstream(cfg, upstream, tokenizer)
        rollout_cfg = upstream.get("rollout") or upstream.get("config") or {}
        P = cfg.batch_prompts or rollout_cfg.get("batch_prompts")
        if P is None:
            raise RlkitError("update --follow needs --batch-prompts P (prompts per step): the input is not from "
                             "`rlkit rollout --follow`, which would say")
        if rollout_cfg.get("follow") and rollout_cfg.get("batch_prompts") not in (None, P):
            raise RlkitError(f"--batch-prompts {P} differs from the upstream rollout's {rollout_cfg['batch_prompts']}; "
                             "the two would wait on each other forever (leave it out here)")
        n = rollout_cfg.get("n") if rollout_cfg.get("follow") else None
        engine = upstream.get("engine")
        cap = cfg.rl.tis_cap if cfg.rl.tis_cap is not None else DEFAULT_FOLLOW_TIS_CAP
        keep = None if cfg.keep is None else max(cfg.keep, cfg.max_lag + 2)
        if cfg.keep is not None and keep != cfg.keep:
            console.info(f"update: --keep {cfg.keep} raised to {keep}: rollout may still be loading any of the newest "
                         f"--max-lag + 2 steps")
        inputs = {"policy": base_fp, "in": reader.fingerprint}
        ref_cache: dict = {}
        dropped = 0
        batches = _Batcher(reader, P, n, cfg.max_lag)
        while cfg.max_steps is None or t.step - base_step < cfg.max_steps:
            got = batches.next(t.step)
            if got is None:
                console.info(f"update: the input ended; last step {t.step}" + (
                    f" ({batches.leftover} rows of an unfinished batch left untrained)" if batches.leftover else ""))
                return root
            table, lags, drop = got
            dropped += drop
            lag_max = int(lags.max())
            recompute = cfg.rl.old_logprobs == "recompute" or (
                cfg.rl.old_logprobs == "auto" and (engine != "hf" or lag_max > 0 or cfg.train.dtype != "fp32"))
            rl = replace(cfg.rl, tis_cap=(cap or None) if recompute else None)
            metrics, used = t.train(table, upstream, rl, recompute, lags=lags, label=reader.label)
            metrics.update(lag_mean=float(lags.float().mean()), lag_max=lag_max, rows_dropped=drop,
                           rows_dropped_total=dropped, prompts=P)
            metrics.update(_drift(cfg, lora.plain_state_dict(t.model), upstream.get("reference"), ref_cache))
            manifest = artifacts.make_manifest(
                "model", "update", cfg, inputs, step=t.step, metrics=metrics, reward_weights=used,
                follow={"base": str(cfg.policy), "base_fingerprint": base_fp, "base_step": base_step})
            path = follow.publish(root, t.step, lambda tmp, m=manifest: t.save(tmp, m, t.gather(), write_manifest=False))
            pruned = follow.prune(root, keep) if keep is not None else []
            metrics_log.write({"stage": "update", "out": str(path), **metrics}, cfg.metrics, cfg.tensorboard)
            _show(metrics)
            console.info(f"update: wrote {path} (lag mean {metrics['lag_mean']:.2f}, max {lag_max}; "
                         f"{drop} rows dropped)" + (f"; pruned steps {pruned}" if pruned else ""))
        console.info(f"update: --max-steps {cfg.max_steps} reached (step {t.step}); stopping")
        return root


class _Batcher:
    """Cuts a stream of rollout record batches into tables of P whole prompt groups (rows of a group
    are contiguous, as `rollout` writes them), dropping the rows whose lag behind the current step
    (step - policy_step) exceeds `max_lag`. With `n` (the group size) a batch is cut as soon as its
    P-th group is complete, so a paced upstream is never waited on for rows it will not send yet."""

    def __init__(self, reader, P: int, n: int | None, max_lag: int) -> None:
        self.reader, self.it, self.P, self.n, self.max_lag = reader, iter(reader), P, n, max_lag
        self.buf = None
        self.ended = False
        self.leftover = 0

    def _cut(self) -> int:
        import numpy as np

        g = self.buf.column("group_id").to_numpy()
        starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        if len(starts) > self.P:
            return int(starts[self.P])
        if len(starts) == self.P and (self.ended or (self.n and len(g) - starts[-1] >= self.n)):
            return len(g)
        return 0

    def next(self, step: int):
        """(table, lags (rows,) long tensor, rows dropped since the last batch), or None at the end."""
        import numpy as np
        import pyarrow as pa
        import torch

        from rlkit.errors import RlkitError

        dropped = 0
        while True:
            if self.buf is not None and self.buf.num_rows:
                lag = step - self.buf.column("policy_step").to_numpy()
                if (lag < 0).any():
                    raise RlkitError(f"{self.reader.label}: rows sampled by step {int(step - lag.min())}, newer than "
                                     f"this update's step {step}: the rollout follows another directory than --out")
                stale = lag > self.max_lag
                if stale.any():
                    self.buf = self.buf.filter(pa.array(~stale))
                    dropped += int(stale.sum())
                    continue
                cut = self._cut()
                if cut:
                    out, self.buf = self.buf.slice(0, cut), self.buf.slice(cut)
                    return out, torch.from_numpy(np.ascontiguousarray(lag[:cut])).long(), dropped
            if self.ended:
                self.leftover = self.buf.num_rows if self.buf is not None else 0
                return None
            batch = next(self.it, None)
            if batch is None:
                self.ended = True
                continue
            t = pa.Table.from_batches([batch])
            self.buf = t if self.buf is None else pa.concat_tables([self.buf, t])


def _drift(cfg: UpdateConfig, params: dict, upstream_ref: str | None, cache: dict | None = None) -> dict:
    """{'drift': ...} of the policy's weights from --ref or the reference score-ref used; warns above --max-drift.
    `cache` (kept by the caller across steps) holds the hash-checked reference weights after the first call."""
    from rlkit import console
    from rlkit.checkpoints import verify_reference
    from rlkit.drift import load_weights, relative_drift

    ref = cfg.ref or (Path(upstream_ref) if upstream_ref else None)
    if ref is None:
        return {}
    if cache is None or ref not in cache:
        if cfg.ref is None and not ref.is_dir():
            console.warn(f"update: no drift figure: the reference score-ref used ({ref}) is not there any more; "
                         "pass --ref")
            return {}
        verify_reference(ref)
        weights = load_weights(ref)
        if cache is not None:
            cache[ref] = weights
    else:
        weights = cache[ref]
    d = relative_drift(params, weights)
    if d > cfg.max_drift:
        console.warn(f"POLICY DRIFT: the weights are {d:.4f} (relative L2) away from the reference {ref}, above "
                     f"--max-drift {cfg.max_drift:g}; check KL, held-out accuracy and response length for reward hacking")
    return {"drift": d}


def _run_dpo(cfg: UpdateConfig, reader, model, tokenizer, dp=None) -> Path:
    """--algo dpo: offline, on a prefs table scored by the reference."""
    from rlkit import artifacts, checkpoints, console, distributed, lora, metrics_log, policy_update

    inputs = {"policy": artifacts.fingerprint(cfg.policy), "in": reader.fingerprint}
    if artifacts.skip_if_current(cfg.out, "update", cfg, inputs):
        return cfg.out
    table = reader.read_all()
    batch = policy_update.build_pref_batch(table, tokenizer)
    if dp is not None:
        from rlkit.logprobs import _completion_logprobs

        model = distributed.shard_model(model, dp, _completion_logprobs)
        console.info(f"update: data-parallel over {dp.world} processes ({dp.device.type}, FSDP2)")
    from rlkit.training import Precision

    opt = policy_update.make_optimizer(model, cfg.rl)
    state = policy_update.load_trainer(model, opt, cfg.policy / policy_update.TRAINER_DIR, dp)
    prec = Precision(cfg.train.dtype, dp.device.type if dp is not None else "cpu")
    prec.load_state(state.precision)
    n_train = int((~batch.heldout).sum())
    with console.progress("update", cfg.rl.epochs * -(-n_train // cfg.rl.minibatch_size)) as bar:
        m = policy_update.train_dpo(model, opt, state, batch, cfg.rl, bar, dp=dp, prec=prec)
    state.precision = prec.state()
    metrics = {"step": checkpoints.policy_step(cfg.policy) + 1, "algo": "dpo", "beta": cfg.rl.beta, **m}
    full = distributed.full_model_state(model) if dp is not None else None
    opt_tensors = policy_update.trainer_tensors(model, opt, dp)
    if distributed.stand_down(dp, metrics):
        return cfg.out
    metrics.update(_drift(cfg, lora.plain_state_dict(model, full),
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
            "tis_weight_mean", "tis_capped_fraction", "is_ess", "lag_mean", "lag_max", "rows_dropped", "kl_coef", "kl_coef_next", "value_loss", "value_clip_fraction",
            "explained_variance", "grad_norm", "loss_scale", "skipped_steps", "mean_response_tokens", "drift",
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
    old_logprobs: Annotated[str, typer.Option(help="pi_old for the ratio: engine (as logged at rollout), recompute (the trainer's own forward pass before the first step) or auto (recompute unless the hf engine sampled and --dtype is fp32).")] = RLConfig.old_logprobs,
    tis_cap: Annotated[float | None, typer.Option(help="Truncated importance sampling: weight each token's loss by min(pi_recomputed / pi_engine, CAP), e.g. 2.0.")] = None,
    metrics: Annotated[Path | None, typer.Option(help="Append this update's metrics as one JSON line to this file.")] = None,
    tensorboard: Annotated[Path | None, typer.Option(help="Also log the metrics as TensorBoard scalars under this directory (needs the tensorboard extra).")] = None,
    ref: Annotated[Path | None, typer.Option(help="Frozen reference for the drift figure (default: the one score-ref used).")] = None,
    max_drift: Annotated[float, typer.Option(min=0.0, help="Warn when the policy's relative weight distance from the reference exceeds this.")] = DEFAULT_MAX_DRIFT,
    follow: Annotated[bool, typer.Option("--follow", help="Persistent: read an unbounded rollouts stream and write one checkpoint per --batch-prompts prompts as --out/step-NNNNNN/ (atomic; --out/latest names the newest); a rerun resumes from --out/latest. See README 'Persistent stages'.")] = False,
    batch_prompts: Annotated[int | None, typer.Option(min=1, help="--follow: prompts (whole groups) per update step; default: the upstream `rollout --follow`'s.")] = None,
    max_steps: Annotated[int | None, typer.Option(min=1, help="--follow: end the run cleanly once --out holds this many steps after --policy's.")] = None,
    keep: Annotated[int | None, typer.Option(min=1, help="--follow: prune all but the newest K steps (at least --max-lag + 2 are kept: rollout may be loading them).")] = None,
    max_lag: Annotated[int, typer.Option(min=0, help="--follow: drop (and count) rows sampled more than this many steps before the policy they would train; lagged rows get pi_old recomputed (the proximal policy) and a truncated importance weight (--tis-cap, default 2 here).")] = DEFAULT_MAX_LAG,
    dtype: TrainDtype = "fp32",
    gradient_checkpointing: GradCheckpointing = False,
    lora_rank: LoraRank = None,
    lora_alpha: LoraAlpha = None,
    lora_dropout: LoraDropout = 0.0,
    lora_targets: LoraTargets = None,
    trust_remote_code: TrustRemoteCode = False,
    no_verify: NoVerify = False,
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
    train = train_options(dtype, gradient_checkpointing, lora_rank, lora_alpha, lora_dropout, lora_targets)
    run(UpdateConfig(policy=policy, out=out, inp=inp, rl=rl, train=train, reward=tuple(reward or ()), length_penalty=length_penalty,
                     metrics=metrics, tensorboard=tensorboard, ref=ref, max_drift=max_drift, follow=follow,
                     batch_prompts=batch_prompts, max_steps=max_steps, keep=keep, max_lag=max_lag,
                     trust_remote_code=trust_remote_code, verify=not no_verify, force=force))
