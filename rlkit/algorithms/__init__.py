"""The algorithms of `rlkit update`, by --algo name: this registry is the one place that lists them.
Each entry names an `Algorithm` subclass (see `base.py`) in a module of this package, one module per
algorithm or family (`grpo.py` for the group-advantage policy gradients, `ppo.py`, `dpo.py`, ...),
and a line for --algo's help; the class declares its defaults (beta, where the KL goes,
aggregation, clip range), the input it reads (`inputs.Rollouts` or `inputs.Prefs`), how it turns a
batch into advantages and per-minibatch loss terms, any model it trains beside the policy (PPO's
critic, with its save and load) and the metrics it adds. `rlkit.training.trainer.Trainer` runs every one of
them through the same minibatch loop, and `rlkit.algorithms.config.resolve` applies their defaults. Entries
are imported on first use, so `rlkit --help` lists them without importing torch. Adding an algorithm
is one module here plus one line below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlkit.algorithms.base import Algorithm

# --algo name: ("module:class", one line for --algo's help)
REGISTRY: dict[str, tuple[str, str]] = {
    "grpo": ("rlkit.algorithms.grpo:GRPO", "group-normalised advantages (DeepSeekMath)"),
    "dr-grpo": ("rlkit.algorithms.grpo:DrGRPO", "r - group mean, token sums over a constant (Dr. GRPO)"),
    "rloo": ("rlkit.algorithms.grpo:RLOO", "r - the mean of the group's other samples"),
    "reinforce-pp": ("rlkit.algorithms.grpo:ReinforcePP", "whitened over the batch's tokens, no group baseline"),
    "gspo": ("rlkit.algorithms.gspo:GSPO", "GRPO's advantages, sequence-level ratio and clip (Zheng et al. 2025)"),
    "ppo": ("rlkit.algorithms.ppo:PPO", "a learned critic, GAE, the KL in the reward (InstructGPT)"),
    "dpo": ("rlkit.algorithms.dpo:DPO", "offline, on a prefs table scored by score-ref (Rafailov et al. 2023)"),
}


def names() -> list[str]:
    return list(REGISTRY)


def help_text() -> str:
    """--algo's help: every name with its line."""
    return "; ".join(f"{name}: {line}" for name, (_, line) in REGISTRY.items())


def get(name: str) -> type[Algorithm]:
    """The Algorithm class registered as `name` (imports its module)."""
    if name not in REGISTRY:
        from rlkit.errors import RlkitError

        raise RlkitError(f"--algo {name!r} is not one of {', '.join(REGISTRY)}")
    module, _, attr = REGISTRY[name][0].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if cls.name != name:
        raise TypeError(f"{REGISTRY[name][0]} is registered as {name!r} but calls itself {cls.name!r}")
    return cls
