"""The environment registry: the built-in environments by name (`ENVS`), the environments installed packages
register under the `rlkit.envs` entry-point group, and `get_env`, which resolves a spec (through
`rlkit.plugins.resolve`) to an `EnvSpec`: the class, its typed options and its identity for manifests. An
environment that brings its own prompts is the stages' task through `env_task`.

A new built-in environment is one file in `rlkit/envs/` and one line of `ENVS`."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any

from rlkit.envs.base import EnvError
from rlkit.errors import RlkitError
from rlkit.plugins import load_builtin, one_line, resolve, typed_options
from rlkit.tasks.base import DEFAULT_MAX_NEW_TOKENS, TaskBase, check_split
from rlkit.tasks.user import as_example

ENVS: dict[str, str] = {"calc": "rlkit.envs.calc:CalcEnv", "guess": "rlkit.envs.guess:GuessNumber",
                        "textarena": "rlkit.envs.textarena:TextArena", "openenv": "rlkit.envs.openenv:OpenEnv",
                        "openenv-mcp": "rlkit.envs.openenv_mcp:OpenEnvMCP", "python": "rlkit.envs.python:PythonEnv",
                        "code-feedback": "rlkit.envs.code_feedback:CodeFeedbackEnv"}
ENTRY_POINT_GROUP = "rlkit.envs"
# A built-in adapter whose class depends on the server it reaches: name -> "module:function(cls, options)" giving the
# class to run instead (None: `cls`), called once its options are checked, before any model loads.
DISPATCH: dict[str, str] = {"openenv": "rlkit.envs.openenv_mcp:dispatch"}


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
            raise EnvError(f"environment {self.name}: its constructor raised {one_line(e)}") from e

    def sandboxed(self, kind: str | None) -> EnvSpec:
        """With the stage's `--sandbox KIND`: the environment built with `sandbox=KIND` when its constructor takes a
        `sandbox` keyword (`Tools`: its tool calls then run in sandboxed workers) and the spec did not set one."""
        if kind is None or "sandbox" in self.options:
            return self
        try:
            params = inspect.signature(self.factory).parameters
        except (TypeError, ValueError):
            return self
        if "sandbox" not in params:
            return self
        return replace(self, options={**self.options, "sandbox": kind})

    def read_by(self, fns) -> EnvSpec:
        """With the `--reward-fn` functions that will read its instances when their episodes end (rollout): an
        adapter whose reward depends on them (a TRL class: `rlkit.envs.trl`) says so through its `read_by(fns)`."""
        hook = getattr(self.factory, "read_by", None)
        return replace(self, factory=hook(fns)) if callable(hook) and fns else self

    def tool_schemas(self) -> list | None:
        """The JSON schemas of the environment's tools, for chat-template prompts (`tools=`), when its class gives
        them without an instance (a TRL environment class; a `Tools` class's own `tools`); None otherwise."""
        fn = getattr(self.factory, "tool_schemas", None)
        schemas = fn() if callable(fn) and not isinstance(self.factory, type) else None
        declared = getattr(self.factory, "declared_tool_schemas", None)
        if not schemas and isinstance(self.factory, type) and callable(declared):
            schemas = declared()
        return list(schemas) if schemas else None

    def attribute(self, name: str, default=None):
        """A class attribute of the environment (e.g. `stop`, `max_new_tokens`), read without an instance; an
        adapter whose options set it (`textarena:...,stop=\\n`) says so through its `option_attribute(name, options)`."""
        hook = getattr(self.factory, "option_attribute", None)
        if callable(hook):
            value = hook(name, self.options)
            if value is not None:
                return value
        return getattr(self.factory, name, default)


def get_env(spec: str) -> EnvSpec:
    """The environment `spec` names (see `rlkit.envs`), its options typed and checked now."""
    found = resolve("environment", spec, ENVS, ENTRY_POINT_GROUP)
    factory, name, label = found.factory, found.name, found.short
    if not callable(factory):
        raise RlkitError(f"environment {label}: {type(factory).__name__} is not a class")
    fp = f"builtin:{name}" if found.builtin else found.fingerprint(label)
    library = getattr(factory, "library", None)
    if found.builtin and callable(library):
        fp += f"+{library()}"  # the library a built-in adapter runs (textarena's games): a new version reruns
    from rlkit.envs import trl

    if not found.builtin and trl.is_trl_class(factory):
        if _takes_example(factory):
            raise RlkitError(f"environment {label} has reset(example) but no step(); a TRL class takes reset(**row) "
                             "(its public methods the tools, its reward from get_reward()); an rlkit environment needs "
                             "step(action) too (rlkit.envs.base)")
        factory = trl.factory(factory, label)  # TRL's environment_factory class: reset(**row), tools, reward
    for method in ("reset", "step"):
        if not callable(getattr(factory, method, None)) and not getattr(factory, "trl", False):
            raise RlkitError(f"environment {label} has no {method}() method; an environment class needs "
                             "reset(example) and step(action) (rlkit.envs.base)")
    if isinstance(factory, type):
        _check_signatures(factory, label)
    opts = typed_options(factory, found.options, f"environment {label}")
    check = getattr(factory, "check_options", None)
    if callable(check):  # an adapter's own check before any model loads (textarena: the game starts here)
        check(dict(opts))
    if found.builtin and name in DISPATCH:  # an adapter whose class depends on its server (openenv: MCP tools)
        factory = load_builtin(DISPATCH[name])(factory, dict(opts)) or factory
    shown = name + (":" + ",".join(f"{k}={v}" for k, v in found.options.items()) if found.rest else "")
    return EnvSpec(factory, opts, shown, getattr(factory, "__name__", label), fp)


def _takes_example(cls) -> bool:
    """Whether `cls.reset` is written for rlkit's protocol, `reset(example)` (a parameter named so, or one only
    positional), not TRL's `reset(**row)`."""
    try:
        params = list(inspect.signature(cls.reset).parameters.values())[1:]  # without self
    except (TypeError, ValueError):
        return False
    return any(p.name == "example" or p.kind is p.POSITIONAL_ONLY for p in params)


def _check_signatures(cls, label: str) -> None:
    """Before any model loads: `reset` takes the example and `step` the action (one line naming the signature
    otherwise; every trajectory would fail the same way)."""
    for method, arg in (("reset", "example"), ("step", "action")):
        raw = inspect.getattr_static(cls, method, None)
        if isinstance(raw, staticmethod):
            fn, args = raw.__func__, (arg,)
        elif inspect.isfunction(raw):
            fn, args = raw, ("self", arg)
        else:
            continue  # a classmethod, a callable object, an attribute set otherwise: called as it is
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        try:
            sig.bind(*args)
        except TypeError:
            shown = str(sig).replace("(self, ", "(").replace("(self)", "()")
            raise RlkitError(f"environment {label}: {method}{shown} cannot take the {arg} rlkit passes it; an "
                             "environment's methods are reset(self, example) and step(self, action) "
                             "(rlkit.envs.base)") from None


@dataclass
class _EnvTask(TaskBase):
    """An environment that brings its own prompts (`iter_examples`) as the stages' task: its examples, its name
    and identity; it scores its own trajectories (`from_env`: no task verifier runs)."""

    env: EnvSpec
    from_env: bool = True
    _proto: Any = None

    @property
    def name(self) -> str:
        return self.env.name

    @property
    def spec(self) -> str:
        return f"env:{self.env.spec}"

    @property
    def fingerprint(self) -> str:
        return self.env.fingerprint

    @property
    def max_new_tokens(self) -> int:
        n = self.env.attribute("max_new_tokens")
        return n if isinstance(n, int) and n > 0 else DEFAULT_MAX_NEW_TOKENS

    def iter_examples(self, split: str, seed: int, unique: bool = False):
        import atexit

        check_split(split)
        if self._proto is None:
            self._proto = self.env.make()  # the instance that draws the examples (closed at exit)
            close = getattr(self._proto, "close", None)
            if callable(close):
                atexit.register(close)
        fn = self._proto.iter_examples
        it = fn(split, seed, unique) if _takes(fn, 3) else fn(split, seed)
        for i, item in enumerate(it):
            yield as_example(item, split, f"{split}-{seed}-{i}", f"environment {self.name}: iter_examples()")

    def reward(self, response: str, answer: str) -> float:  # noqa: ARG002 (the environment scores itself)
        return 0.0


def _takes(fn, k: int) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    try:
        sig.bind(*range(k))
        return True
    except TypeError:
        return False


def env_task(env: EnvSpec) -> _EnvTask:
    """The environment `env` (which has `iter_examples`) as the task whose prompts a stage samples."""
    return _EnvTask(env)
