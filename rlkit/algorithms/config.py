"""The knobs of one RL update, importable without torch (so `rlkit --help` stays light).

Fields that default to None mean "the algorithm's default": `resolve(cfg)` fills them from the
algorithm's registry entry (`rlkit.algorithms`), the one place per-algorithm defaults are applied, so
`rlkit update` and `stages.update.run(UpdateConfig(...))` from Python train with the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from rlkit.algorithms.registry import AlgoDefaults  # noqa: F401 (the per-algorithm defaults RLConfig resolves from)

# --kl-estimator when neither the flag nor the algorithm names one, by --kl-in (see `rlkit.ops.kl` for the
# table). In the reward the penalty is a per-token return, and only k1 = log(pi/pi_ref) makes its policy
# gradient the gradient of KL(pi || pi_ref) (k3 there is ~k1^2/2: near the reference it pulls back at
# second order only). In the loss the estimator is differentiated: k3+ reports k3's unbiased low-variance
# value and descends the forward KL with k2's gradient; plain k3 there would descend the reverse
# KL(pi_ref || pi), and k1 there has zero expected gradient (refused).
DEFAULT_KL_ESTIMATOR = {"reward": "k1", "loss": "k3+"}
# verl's clip_ratio_c: for A < 0 the clipped surrogate is capped at -DUAL_CLIP * A.
DEFAULT_DUAL_CLIP = 3.0
# --follow: --tis-cap when not given, applied whenever pi_old is recomputed (lagged rows, a non-HF engine):
# decoupled PPO clips against the proximal policy and weighs by proximal / behaviour, capped
DEFAULT_FOLLOW_TIS_CAP = 2.0


@dataclass(frozen=True)
class RLConfig:
    """The knobs of one update; the stage's config carries these plus I/O paths. None: the --algo's
    default (`AlgoDefaults`), filled in by `resolve`."""

    algo: str = "grpo"
    lr: float = 5e-5
    epochs: int = 2
    minibatch_size: int = 128
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = DEFAULT_DUAL_CLIP  # None: no cap for negative advantages
    beta: float | None = None
    kl_estimator: str | None = None
    kl_in: str | None = None
    loss_agg: str | None = None
    drop_degenerate: bool = False
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    warmup_steps: int = 0
    seed: int = 0
    # PPO (--algo ppo): critic, GAE, clipped value loss, adaptive KL (Ziegler et al. 2019)
    gamma: float = 1.0
    lam: float = 0.95
    vf_clip: float = 0.2
    critic_lr: float | None = None  # None: 2x --lr
    critic_init: str = "policy"  # policy | a reward-model directory (first update only)
    target_kl: float | None = None  # adaptive KL coefficient towards this KL per sequence
    kl_horizon: int = 10_000
    old_logprobs: str = "auto"  # engine | recompute | auto (recompute unless the HF engine sampled)
    tis_cap: float | None = None  # truncated importance sampling cap C (needs recomputed pi_old)
    # on-policy distillation: -teacher_coef * (log pi_old - log pi_teacher) added to each sampled token's advantage
    teacher_coef: float | None = None

    def check(self) -> None:
        """Refuse bad settings with the flag's name (the algorithm's defaults filled in first)."""
        resolve(self)._check()

    def _check(self) -> None:
        from rlkit.algorithms import registry
        from rlkit.errors import RlkitError
        from rlkit.ops.kl import KL_ESTIMATORS, KL_HELP
        from rlkit.ops.losses import AGGREGATIONS

        algo = registry.get(self.algo)
        for flag, v in (("--gamma", self.gamma), ("--lam", self.lam)):
            if not 0 <= v <= 1:
                raise RlkitError(f"{flag} {v:g}: expected a number in [0, 1]")
        if self.vf_clip <= 0:
            raise RlkitError(f"--vf-clip {self.vf_clip:g}: expected a number > 0")
        if self.target_kl is not None and self.target_kl <= 0:
            raise RlkitError(f"--target-kl {self.target_kl:g}: expected a KL per sequence > 0")
        if self.target_kl is not None and (self.kl_in != "reward" or self.beta <= 0):
            raise RlkitError(f"--target-kl adapts the KL penalty in the reward: it needs --kl-in reward (got {self.kl_in}) "
                             f"and --beta > 0 (got {self.beta:g})")
        if self.kl_in not in ("loss", "reward"):
            raise RlkitError(f"--kl-in {self.kl_in!r} is not one of loss, reward")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise RlkitError(f"--kl-estimator {self.kl_estimator!r} is not one of {KL_HELP}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise RlkitError(f"--dual-clip {self.dual_clip:g} must be > 1 (verl's default is 3), or 0 to turn it off")
        if self.loss_agg not in AGGREGATIONS:
            raise RlkitError(f"--loss-agg {self.loss_agg!r} is not one of {', '.join(AGGREGATIONS)}")
        if self.old_logprobs not in ("auto", "engine", "recompute"):
            raise RlkitError(f"--old-logprobs {self.old_logprobs!r} is not one of engine, recompute, auto")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise RlkitError(f"--tis-cap {self.tis_cap} must be > 0 (e.g. 2.0)")
        if self.tis_cap is not None and self.old_logprobs == "engine":
            raise RlkitError("--tis-cap weighs by pi_recomputed / pi_engine, so it needs --old-logprobs recompute")
        for flag, v in (("--beta", self.beta), ("--clip-low", self.clip_low), ("--clip-high", self.clip_high),
                        ("--teacher-coef", self.teacher_coef)):
            if v < 0:
                raise RlkitError(f"{flag} {v:g}: expected a number >= 0")
        if self.lr <= 0:
            raise RlkitError(f"--lr {self.lr:g}: expected a learning rate > 0")
        algo.check(self)


def resolve(cfg: RLConfig) -> RLConfig:
    """`cfg` with every None that means "the algorithm's default" filled from its registry entry.
    Idempotent; an unknown --algo is refused here. Imports no torch."""
    from rlkit.algorithms import registry

    d = registry.defaults(cfg.algo)
    given = {f.name: getattr(cfg, f.name) for f in fields(AlgoDefaults)}
    out = {k: getattr(d, k) if v is None else v for k, v in given.items()}
    out["kl_estimator"] = given["kl_estimator"] or d.kl_estimator or DEFAULT_KL_ESTIMATOR.get(out["kl_in"])
    return replace(cfg, **out)
