"""Environments for multi-turn rollouts (`rlkit rollout --env SPEC`, `rlkit eval --env SPEC`).

SPEC is one of
  `NAME[:key=value,...]`                    a built-in environment (ENVS) or an `rlkit.envs` entry point
  `path/to/file.py:CLASS[:key=value,...]`   a class in a Python file
  `package.module:CLASS[:key=value,...]`    a class in an importable module
Options go to the class's constructor, converted to its annotated types (int, float, bool, str) as task options
are. The protocol (`reset`, `step`, `Step`, optional `close`) is in `rlkit.envs.base`; `rlkit.envs.Tools` turns
Python functions into a tool-calling environment; docs/environments.md has the whole story.

Built in:
  calc    multi-digit products with a `calc` tool (rlkit.envs.calc)
  guess   guess the number with higher/lower feedback (rlkit.envs.guess)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from rlkit.envs.base import MAX_OBSERVATION_CHARS, EnvError, Environment, Observation, Step, TaskEnv, as_step
from rlkit.errors import RlkitError

__all__ = ["ENVS", "EnvError", "EnvSpec", "Environment", "MAX_OBSERVATION_CHARS", "Observation", "Step",
           "TaskEnv", "Tools", "as_step", "get_env"]

ENVS: dict[str, str] = {"calc": "rlkit.envs.calc:CalcEnv", "guess": "rlkit.envs.guess:GuessNumber"}
ENTRY_POINT_GROUP = "rlkit.envs"
_USER_FORMS = "or a class in your code: path/to/file.py:CLASS or package.module:CLASS"


def __getattr__(name: str) -> Any:
    if name == "Tools":  # imported on use: the tool machinery is not needed to load an environment
        from rlkit.envs.tools import Tools

        return Tools
    raise AttributeError(name)


@dataclass(frozen=True)
class EnvSpec:
    """A loaded `--env`: the class (or factory), its typed options, and its identity for manifests."""

    factory: Any
    options: dict
    spec: str  # as given, normalised (what manifests record)
    name: str  # the class's name (errors name it)
    fingerprint: str  # the hash of the file defining it (a rerun after an edit is not skipped)

    def make(self):
        """One fresh instance (one per trajectory)."""
        try:
            return self.factory(**self.options)
        except RlkitError:
            raise
        except Exception as e:
            from rlkit.tasks.user_code import one_line

            raise EnvError(f"environment {self.name}: its constructor raised {one_line(e)}") from e

    def attribute(self, name: str, default=None):
        """A class attribute of the environment (e.g. `stop`, `max_new_tokens`), read without an instance."""
        return getattr(self.factory, name, default)


def get_env(spec: str) -> EnvSpec:
    """The environment `spec` names (see the module docstring), its options typed and checked now."""
    from rlkit.tasks import _typed_options, parse_options, user_code

    name, _, rest = spec.partition(":")
    if name in ENVS:
        mod, _, cls = ENVS[name].partition(":")
        factory = getattr(importlib.import_module(mod), cls)
        label = name
    else:
        eps = _entry_points() if name.replace("-", "_").isidentifier() else {}
        if name in eps:
            try:
                factory = eps[name].load()
            except Exception as e:
                raise RlkitError(f"environment {name!r} (entry point {eps[name].value}): loading it raised "
                                 f"{user_code.one_line(e)}") from e
            label = name
        else:
            parsed = user_code.parse_ref(spec)
            if parsed is None:
                known = ", ".join([*ENVS, *sorted(eps)])
                raise RlkitError(f"unknown environment {name!r}; known environments: {known}; {_USER_FORMS}")
            ref, rest = parsed
            factory = user_code.load(ref, "environment class")
            name, label = str(ref), ref.name
            rest = rest or ""
    if not callable(factory):
        raise RlkitError(f"environment {label}: {type(factory).__name__} is not a class")
    for method in ("reset", "step"):
        if not callable(getattr(factory, method, None)):
            raise RlkitError(f"environment {label} has no {method}() method; an environment class needs "
                             "reset(example) and step(action) (rlkit.envs.base)")
    opts = _typed_options(factory, parse_options(rest, spec), f"environment {label}")
    shown = name + (":" + ",".join(f"{k}={v}" for k, v in parse_options(rest, spec).items()) if rest else "")
    fp = user_code.fingerprint(factory, label) if name not in ENVS else f"builtin:{name}"
    return EnvSpec(factory, opts, shown, getattr(factory, "__name__", label), fp)


def _entry_points() -> dict:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in ENVS}
