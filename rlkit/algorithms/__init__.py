"""The algorithms of `rlkit update`, by --algo name: this registry is the one place that lists them.
Each entry names an `Algorithm` subclass (see `base.py`) in a module of this package, one module per
algorithm or family (`grpo.py` for the group-advantage policy gradients, `ppo.py`, `dpo.py`, ...),
a line for --algo's help, its defaults (beta, where the KL goes, aggregation, clip range:
`config.AlgoDefaults`) and the table kind it trains on. The class supplies the input it reads
(`inputs.Rollouts` or `inputs.Prefs`), how it turns a batch into advantages and per-minibatch loss
terms, any model it trains beside the policy (PPO's critic, with its save and load) and the metrics it
adds. `rlkit.algorithms.trainer.Trainer` runs every one of them through the same minibatch loop, and
`rlkit.algorithms.config.resolve` applies their defaults. The registry imports no torch (entries are
imported on first use), so `rlkit --help` lists the algorithms and their defaults without it, and
docs/algorithms.md's defaults table is rendered from it (`python -m rlkit.algorithms.defaults_table`).
Adding an algorithm is one module here plus one line below.
"""

from __future__ import annotations

from rlkit.algorithms.registry import REGISTRY, Entry, defaults, get, help_text, names  # noqa: F401 (the package's API)
