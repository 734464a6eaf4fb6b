"""The sampling driver: engine + prompts (+ an environment) -> rows. Every stage that samples goes through it
(`rollout`, its `--follow` service, `eval`, `build-prefs`, sft's held-out eval), so each takes `--engine` and the
same sampling options. See `rlkit.sampling.driver`; greedy held-out evaluation on it (`eval`, sft's held-out eval)
is `rlkit.sampling.evaluate`."""

from rlkit.sampling.driver import Episodes, Prompts, Sampling, run_episodes, sample

__all__ = ["Episodes", "Prompts", "Sampling", "run_episodes", "sample"]
