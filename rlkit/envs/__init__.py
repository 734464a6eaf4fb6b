"""Environments for multi-turn rollouts (`rlkit rollout --env SPEC`, `rlkit eval --env SPEC`).

SPEC is one of
  `NAME[:key=value,...]`                    a built-in environment (ENVS) or an `rlkit.envs` entry point
  `path/to/file.py:CLASS[:key=value,...]`   a class in a Python file
  `package.module:CLASS[:key=value,...]`    a class in an importable module
Options go to the class's constructor, converted to its annotated types (int, float, bool, str) as task options
are. The protocol (`reset`, `step`, `Step`, optional `close`) is in `rlkit.envs.base`; `rlkit.envs.Tools` turns
Python functions into a tool-calling environment; docs/environments.md has the whole story.

Built in:
  calc       multi-digit products with a `calc` tool (rlkit.envs.calc)
  guess      guess the number with higher/lower feedback (rlkit.envs.guess)
  code-feedback  the code task, a program a turn, a failing visible test's output as feedback, up to `attempts`
             programs (rlkit.envs.code_feedback)
  textarena  textarena's single-player games, `textarena:game=ID` (extra rlkit[textarena]; rlkit.envs.textarena)
  openenv    an OpenEnv server over its WebSocket protocol, `openenv:url=ws://...` (extra rlkit[openenv];
             rlkit.envs.openenv)
A class written for TRL's `GRPOTrainer(environment_factory=...)` (a `reset(**row)` and no `step`; its public methods
the tools) runs unchanged through `rlkit.envs.trl`.
"""

from rlkit.envs.base import (
    MAX_OBSERVATION_CHARS,
    Busy,
    EnvError,
    Environment,
    Observation,
    Step,
    TaskEnv,
    as_step,
    on_cancel,
)
from rlkit.envs.registry import ENTRY_POINT_GROUP, ENVS, EnvSpec, env_task, get_env
from rlkit.envs.tools import Tools

__all__ = ["ENTRY_POINT_GROUP", "ENVS", "Busy", "EnvError", "EnvSpec", "Environment", "MAX_OBSERVATION_CHARS",
           "Observation", "Step", "TaskEnv", "Tools", "as_step", "env_task", "get_env", "on_cancel"]
