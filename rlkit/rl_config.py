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
# --kl-estimator when not given, by --kl-in. In the reward the penalty is a per-token return, and only
# k1 = log(pi/pi_ref) makes its policy gradient the gradient of KL (k3 there is ~k1^2/2: near the
# reference it pulls back at second order only); in the loss k3 is the low-variance unbiased choice.
DEFAULT_KL_ESTIMATOR = {"reward": "k1", "loss": "k3"}


@dataclass(frozen=True)
class RLConfig:
    """The knobs of one update; the stage's config carries these plus I/O paths."""

    algo: str = "grpo"
    lr: float = 5e-5
    epochs: int = 2
    minibatch_size: int = 128
    clip_low: float = 0.2
    clip_high: float = 0.28
    beta: float = 0.01
    kl_estimator: str = "k3"
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
        from rlkit.kl import KL_ESTIMATORS
        from rlkit.losses import AGGREGATIONS

        algos = [*ADVANTAGES, *CRITIC_ALGOS, *PREFERENCE_ALGOS]
        if self.algo not in algos:
            raise RlkitError(f"--algo {self.algo!r} is not one of {', '.join(algos)}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1) or self.vf_clip <= 0:
            raise RlkitError("--gamma and --lam must be in [0, 1] and --vf-clip > 0")
        if self.target_kl is not None and (self.target_kl <= 0 or self.kl_in != "reward" or self.beta <= 0):
            raise RlkitError("--target-kl adapts the KL penalty in the reward: it needs > 0, --kl-in reward and --beta > 0")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise RlkitError(f"--kl-estimator {self.kl_estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
        if self.kl_in not in ("loss", "reward"):
            raise RlkitError(f"--kl-in {self.kl_in!r} is not one of loss, reward")
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
