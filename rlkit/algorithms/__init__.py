"""The algorithms of `rlkit update`, by --algo name: this registry is the one place that lists them.
Each entry names an `Algorithm` subclass (see `base.py`) in a module of this package, one module per
algorithm or family (`grpo.py` for the group-advantage policy gradients, `ppo.py`, `dpo.py`, ...),
a line for --algo's help, its defaults (beta, where the KL goes, aggregation, clip range:
`config.AlgoDefaults`) and the table kind it trains on. The class supplies the input it reads
(`inputs.Rollouts` or `inputs.Prefs`), how it turns a batch into advantages and per-minibatch loss
terms, any model it trains beside the policy (PPO's critic, with its save and load) and the metrics it
adds. `rlkit.training.trainer.Trainer` runs every one of them through the same minibatch loop, and
`rlkit.algorithms.config.resolve` applies their defaults. The registry imports no torch (entries are
imported on first use), so `rlkit --help` lists the algorithms and their defaults without it, and
docs/algorithms.md's defaults table is rendered from it (`python -m rlkit.algorithms.defaults_table`).
Adding an algorithm is one module here plus one line below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple

from rlkit.algorithms.config import AlgoDefaults

if TYPE_CHECKING:
    from rlkit.algorithms.base import Algorithm


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


def get(name: str) -> type[Algorithm]:
    """The Algorithm class registered as `name` (imports its module)."""
    e = _entry(name)
    module, _, attr = e.target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if cls.name != name:
        raise TypeError(f"{e.target} is registered as {name!r} but calls itself {cls.name!r}")
    if e.reads not in cls.input.kinds:
        raise TypeError(f"{e.target} is registered as reading {e.reads!r} but reads {', '.join(cls.input.kinds)}")
    return cls
