"""The knobs of one RL update, importable without torch (so `rlkit --help` stays light)."""

from __future__ import annotations

from dataclasses import dataclass

# Loss aggregation each algorithm uses unless --loss-agg says otherwise.
ALGO_AGG = {"grpo": "token-mean", "dr-grpo": "seq-mean-token-sum-norm", "rloo": "token-mean",
            "reinforce-pp": "token-mean"}
# Offline preference algorithms: they read a prefs table, not rollouts.
PREFERENCE_ALGOS = ("dpo",)
# Algorithms with a learned critic (per-token advantages from GAE) instead of group baselines.
CRITIC_ALGOS = ("ppo",)
# --beta when not given: the KL coefficient for RL, DPO's temperature for dpo.
DEFAULT_BETA = {"dpo": 0.1}
# --kl-estimator when not given, by --kl-in (see `rlkit.kl` for the table). In the reward the penalty is
# a per-token return, and only k1 = log(pi/pi_ref) makes its policy gradient the gradient of
# KL(pi || pi_ref) (k3 there is ~k1^2/2: near the reference it pulls back at second order only). In the
# loss the estimator is differentiated: k3+ reports k3's unbiased low-variance value and descends the
# forward KL with k2's gradient; plain k3 there would descend the reverse KL(pi_ref || pi), and k1 there
# has zero expected gradient (refused).
DEFAULT_KL_ESTIMATOR = {"reward": "k1", "loss": "k3+"}
# verl's clip_ratio_c: for A < 0 the clipped surrogate is capped at -DUAL_CLIP * A.
DEFAULT_DUAL_CLIP = 3.0


@dataclass(frozen=True)
class RLConfig:
    """The knobs of one update; the stage's config carries these plus I/O paths."""

    algo: str = "grpo"
    lr: float = 5e-5
    epochs: int = 2
    minibatch_size: int = 128
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = DEFAULT_DUAL_CLIP  # None: no cap for negative advantages
    beta: float = 0.01
    kl_estimator: str = "k3+"
    kl_in: str = "loss"
    loss_agg: str | None = None  # None: the algorithm's default (ALGO_AGG)
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

    def check(self) -> None:
        from rlkit.advantages import ADVANTAGES
        from rlkit.errors import RlkitError
        from rlkit.kl import KL_ESTIMATORS, KL_HELP
        from rlkit.losses import AGGREGATIONS

        algos = [*ADVANTAGES, *CRITIC_ALGOS, *PREFERENCE_ALGOS]
        if self.algo not in algos:
            raise RlkitError(f"--algo {self.algo!r} is not one of {', '.join(algos)}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1) or self.vf_clip <= 0:
            raise RlkitError("--gamma and --lam must be in [0, 1] and --vf-clip > 0")
        if self.target_kl is not None and (self.target_kl <= 0 or self.kl_in != "reward" or self.beta <= 0):
            raise RlkitError("--target-kl adapts the KL penalty in the reward: it needs > 0, --kl-in reward and --beta > 0")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise RlkitError(f"--kl-estimator {self.kl_estimator!r} is not one of {KL_HELP}")
        if self.kl_in not in ("loss", "reward"):
            raise RlkitError(f"--kl-in {self.kl_in!r} is not one of loss, reward")
        if self.kl_in == "loss" and self.kl_estimator == "k1" and self.beta > 0 and self.algo not in PREFERENCE_ALGOS:
            raise RlkitError("--kl-estimator k1 in the loss has zero expected gradient (E_pi[grad log pi] = 0), so it "
                             "would regularise nothing: use k3+ or k2 with --kl-in loss, or k1 with --kl-in reward")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise RlkitError(f"--dual-clip {self.dual_clip:g} must be > 1 (verl's default is 3), or 0 to turn it off")
        if self.loss_agg is not None and self.loss_agg not in AGGREGATIONS:
            raise RlkitError(f"--loss-agg {self.loss_agg!r} is not one of {', '.join(AGGREGATIONS)}")
        if self.old_logprobs not in ("auto", "engine", "recompute"):
            raise RlkitError(f"--old-logprobs {self.old_logprobs!r} is not one of engine, recompute, auto")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise RlkitError(f"--tis-cap {self.tis_cap} must be > 0 (e.g. 2.0)")
        if self.tis_cap is not None and self.old_logprobs == "engine":
            raise RlkitError("--tis-cap weighs by pi_recomputed / pi_engine, so it needs --old-logprobs recompute")
        if self.beta < 0 or self.lr <= 0 or self.clip_low < 0 or self.clip_high < 0:
            raise RlkitError("--beta, --clip-low and --clip-high must be >= 0 and --lr > 0")

    @property
    def aggregation(self) -> str:
        return self.loss_agg or ALGO_AGG.get(self.algo, "token-mean")
