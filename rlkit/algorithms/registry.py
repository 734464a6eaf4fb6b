"""The registry of `rlkit update`'s algorithms (see `rlkit.algorithms`): names, help lines, defaults and the
table kind each trains on. A leaf: it imports no other rlkit module and no torch (entries are imported on
first use), so `rlkit --help`, `rlkit.algorithms.config.resolve` and the docs' defaults table read it
without loading an algorithm.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class AlgoDefaults:
    """What an algorithm uses for each RLConfig field left at None (its `rlkit.algorithms.REGISTRY` entry's)."""

    beta: float = 0.01  # KL coefficient to the reference (DPO: its temperature)
    kl_in: str = "loss"  # loss | reward
    kl_estimator: str | None = None  # None: DEFAULT_KL_ESTIMATOR[kl_in]
    loss_agg: str = "token-mean"  # a name in rlkit.ops.losses.AGGREGATIONS
    clip_low: float = 0.2
    clip_high: float = 0.28
    teacher_coef: float = 0.0  # on-policy distillation's weight on the teacher's per-token advantage


class Entry(NamedTuple):
    target: str  # "module:Class", an Algorithm subclass
    line: str  # one line for --algo's help
    defaults: AlgoDefaults = AlgoDefaults()  # what its RLConfig fields left at None become
    reads: str = "rollouts"  # the table kind it trains on: rollouts (scored when --beta > 0) or prefs


REGISTRY: dict[str, Entry] = {
    "grpo": Entry("rlkit.algorithms.grpo:GRPO", "group-normalised advantages (DeepSeekMath)"),
    "dr-grpo": Entry("rlkit.algorithms.grpo:DrGRPO", "r - group mean, token sums over a constant (Dr. GRPO)",
                     AlgoDefaults(loss_agg="seq-mean-token-sum-norm")),
    "rloo": Entry("rlkit.algorithms.grpo:RLOO", "r - the mean of the group's other samples"),
    "reinforce-pp": Entry("rlkit.algorithms.grpo:ReinforcePP", "whitened over the batch's tokens, no group baseline"),
    # GSPO's paper: a sequence ratio's clip range is ~1000x narrower than a token ratio's, and no KL term
    "gspo": Entry("rlkit.algorithms.gspo:GSPO", "GRPO's advantages, sequence-level ratio and clip (Zheng et al. 2025)",
                  AlgoDefaults(beta=0.0, loss_agg="seq-mean-token-mean", clip_low=3e-4, clip_high=4e-4)),
    # MiniMax-M1: no lower bound on the IS weight (1 - 1 = 0), only the upper one tuned (the paper gives no value:
    # verl's 0.28), and an objective without a KL term
    "cispo": Entry("rlkit.algorithms.grpo:CISPO", "GRPO's advantages, the clipped IS weight detached: every token keeps "
                   "its gradient (MiniMax-M1)", AlgoDefaults(beta=0.0, clip_low=1.0, clip_high=0.28)),
    # the teacher's per-token signal alone; no reference needed (the teacher is the leash)
    "distill": Entry("rlkit.algorithms.distill:Distill", "on-policy distillation: the reverse KL to a teacher, "
                     "token by token, on the policy's own samples (score-ref --teacher)",
                     AlgoDefaults(beta=0.0, teacher_coef=1.0)),
    "ppo": Entry("rlkit.algorithms.ppo:PPO", "a learned critic, GAE, the KL in the reward (InstructGPT)",
                 AlgoDefaults(kl_in="reward")),
    # beta is DPO's temperature
    "dpo": Entry("rlkit.algorithms.dpo:DPO", "offline, on a prefs table scored by score-ref (Rafailov et al. 2023)",
                 AlgoDefaults(beta=0.1), reads="prefs"),
}


def names() -> list[str]:
    return list(REGISTRY)


def help_text() -> str:
    """--algo's help: every name with its line."""
    return "; ".join(f"{name}: {e.line}" for name, e in REGISTRY.items())


def _entry(name: str) -> Entry:
    if name not in REGISTRY:
        from rlkit.errors import RlkitError

        raise RlkitError(f"--algo {name!r} is not one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def defaults(name: str) -> AlgoDefaults:
    """The defaults registered for --algo `name` (no import of its module)."""
    return _entry(name).defaults


def get(name: str) -> type:
    """The `rlkit.algorithms.base.Algorithm` subclass registered as `name` (imports its module)."""
    e = _entry(name)
    module, _, attr = e.target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if cls.name != name:
        raise TypeError(f"{e.target} is registered as {name!r} but calls itself {cls.name!r}")
    if e.reads not in cls.input.kinds:
        raise TypeError(f"{e.target} is registered as reading {e.reads!r} but reads {', '.join(cls.input.kinds)}")
    return cls
