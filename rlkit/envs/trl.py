"""TRL's environment classes (`GRPOTrainer(environment_factory=CLASS)`) as rlkit environments, unchanged.

A TRL environment class has `reset(**row) -> str | None` and no `step`; its public methods are the model's tools,
and the reward is read from the instance after the episode. `rlkit rollout --env my_env.py:MyEnv` recognises such
a class (a `reset` and no `step`) and runs it through `TrlEnvironment`, which maps TRL's contract onto rlkit's:

  TRL                                              rlkit
  one instance per rollout (per completion)        one instance per trajectory (`EnvSpec.make`)
  `reset(**row)`: the dataset row's columns        `reset(prompt=..., answer=..., prompt_id=..., split=...)`: the
                                                   example's fields; an answer that is a JSON object also spreads
                                                   its keys (`{"target": 3}` -> `target=3`), so a row's extra
                                                   columns can travel in the answer column
  reset's str appended to the last user message    appended to the prompt text (no separator, as TRL)
  None: the prompt unchanged                       the same
  tools: public methods but reset and get_reward   the same (bound methods; names, signatures and annotated
                                                   int/float/str/bool arguments checked as for `rlkit.envs.Tools`)
  tool calls parsed by the chat template's parser  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the
                                                   Hermes/Qwen format) or `<call>NAME(ARGS)</call>`
  a tool's result as a `tool` message              the same (`[{"role": "tool", "content": str(result)}]`)
  a tool that raises: `{'error': '...'}` fed back  `error: NAME raised ...` fed back; the episode goes on
  the loop ends when the model calls no tool       the same: that turn ends the episode (terminated)
  `max_tool_calling_iterations`                    `--max-turns` (a trajectory that reaches it is truncated)
  reward: `get_reward()` (a source of its own)     reward/env: `get_reward()` when the class has it, read when
  and each reward function, which may read the     the episode ends; each `--reward-fn` its own reward/NAME, one
  instances (`environments=`); all summed          taking `environments` getting the class's own instances
                                                   (`wrapped`); `update` sums them (`read_by`, below)

Where a class without `get_reward()` keeps its reward is its reward functions' business in TRL (grpo_2048 keeps
it in `env.score`, TRL's docs in `env.reward`), so reward/env follows what reads the instances (`read_by`): a
`--reward-fn` that names `environment(s)` scores them, and reward/env is 0 (the `reward` attribute such a function
reads is not counted twice); otherwise the instance's `reward` attribute (a number) is reward/env, so a class runs
alone; with neither, reward/env is 0 when a function takes the instances through `**kwargs` (TRL's way too), and
else the episode's end is one line naming the class and what to add.

The tools' JSON schemas (transformers' `get_json_schema` of each public method, as TRL builds them) go to the chat
template as `tools=` wherever rlkit renders through it: chat-formatted `--prompts` (a `messages` column) and the
tool messages appended after each call; a prompt that is plain text (`--task`, a `prompt` column) is used as it
is, so it must describe the tools itself (`describe()` gives one line per tool). An async tool (`async def`, as TRL
awaits them) is awaited on the driver's event loop. The instance's other attributes (`done`) are the class's own
business, as in TRL.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from typing import NamedTuple

from rlkit.envs.base import EnvError
from rlkit.envs.tools import Tools
from rlkit.errors import RlkitError

RESERVED = ("reset", "get_reward")


def is_trl_class(factory) -> bool:
    """A TRL environment class: it has `reset` and no `step`."""
    return callable(getattr(factory, "reset", None)) and not callable(getattr(factory, "step", None))


def tool_methods(obj, label: str) -> dict:
    """The instance's public bound methods but reset and get_reward: the model's tools (TRL's rule)."""
    out = {}
    for name, fn in inspect.getmembers(obj, predicate=inspect.ismethod):
        if name.startswith("_") or name in RESERVED:
            continue
        out[name] = fn
    return out


class TrlEnvironment(Tools):
    """One instance of a TRL environment class, run as an rlkit environment (see the module docstring)."""

    def __init__(self, cls, label: str, options: dict, read_by: ReadBy | None = None) -> None:
        try:
            self.inner = cls(**options)
        except RlkitError:
            raise
        except Exception as e:
            from rlkit.plugins.user_code import one_line

            raise EnvError(f"environment {label}: its constructor raised {one_line(e)}") from e
        self.label = label
        self.cls = cls
        self.read_by = read_by or ReadBy()
        super().__init__(functions=tool_methods(self.inner, label))

    def tool_schemas(self) -> tuple[dict, ...]:
        """The tools' JSON schemas, for the chat template (the driver renders message observations with them)."""
        return tool_schemas(self.cls)

    @property
    def wrapped(self):
        """The user's own instance: what a `--reward-fn` taking `environments` receives (TRL's reward functions
        read its state, `env.reward`)."""
        return self.inner

    def reset(self, example):
        self.example = example
        self.tool_calls = self.tool_errors = 0
        row = {"prompt": example.prompt, "answer": example.answer, "prompt_id": example.prompt_id,
               "split": example.split}
        try:
            extra = json.loads(example.answer) if isinstance(example.answer, str) else None
        except ValueError:
            extra = None
        if isinstance(extra, dict):
            row = {**{k: v for k, v in extra.items() if isinstance(k, str)}, **row}
        fn = self.inner.reset
        try:
            params = inspect.signature(fn).parameters
            if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                row = {k: v for k, v in row.items() if k in params}
        except (TypeError, ValueError):
            pass
        out = fn(**row)
        if inspect.isawaitable(out):  # an async reset: awaited on the driver's event loop
            return self._reset_awaited(out, example)
        return self._prompt(out, example)

    async def _reset_awaited(self, out, example):
        return self._prompt(await out, example)

    def _prompt(self, out, example):
        if out is None:
            return example.prompt
        if not isinstance(out, str):
            raise EnvError(f"environment {self.label}: reset() returned a {type(out).__name__}; a TRL environment's "
                           "reset returns a str (appended to the prompt) or None")
        return example.prompt + out

    def score(self, answer: str, example) -> float:  # noqa: ARG002 (Tools.step: a turn without a tool call)
        """The episode's end: the reward the instance gives itself (TRL reads it off the instance afterwards)."""
        from rlkit.plugins.user_code import as_number

        get = getattr(self.inner, "get_reward", None)
        if callable(get):
            value, what = get(), "get_reward()"
        elif self.read_by.naming:  # the functions that name the instances score them (TRL: the class owns no reward)
            return 0.0
        elif hasattr(self.inner, "reward"):
            value, what = self.inner.reward, "its reward attribute"
        elif self.read_by.kwargs:
            return 0.0
        else:
            raise EnvError(f"environment {self.label} has neither get_reward() nor a reward attribute, and no "
                           "--reward-fn reads its instances; add get_reward() or set self.reward, or pass its reward "
                           "function (TRL's reward_funcs): --reward-fn FILE.py:FUNC taking `environments`")
        v = as_number(value)
        if v is None or not math.isfinite(v):
            raise EnvError(f"environment {self.label}: {what} is {value!r:.60}; expected a finite number")
        return v


class ReadBy(NamedTuple):
    """The `--reward-fn` functions that read a TRL class's instances when its episodes end (`read_by`)."""

    naming: tuple[str, ...] = ()  # name `environment(s)`: they score the instances (reward/env is 0)
    kwargs: tuple[str, ...] = ()  # get them through **kwargs only (TRL's way): the class may keep no reward


_SENTINEL = object()


@functools.cache
def tool_schemas(cls) -> tuple[dict, ...]:
    """The JSON schemas of the class's tools, as TRL hands them to the chat template (`tools=`): transformers'
    `get_json_schema` of each public method (type hints and a Google-style docstring), read off the class without
    making an instance. A method it cannot describe gets its first docstring line and its parameters' types from
    its hints (`rlkit.envs.tools.json_schema`)."""
    from rlkit.envs.tools import json_schema

    return tuple(json_schema(fn.__get__(_SENTINEL), name)  # bound (as TRL's instance methods are): no `self`
                 for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
                 if not name.startswith("_") and name not in RESERVED)


def factory(cls, label: str, read_by: ReadBy | None = None):
    """A callable making one `TrlEnvironment` of `cls` per trajectory, with the class's keyword options; its
    `read_by(fns)` is the same factory told which `--reward-fn` functions read the instances (`EnvSpec.read_by`,
    rollout: where reward/env comes from, the module docstring)."""

    def make(**options):
        return TrlEnvironment(cls, label, options, read_by)

    make.__name__ = getattr(cls, "__name__", label)
    make.__wrapped__ = cls  # inspect.signature reads the class's constructor (options typed as for any class)
    make.stop = TrlEnvironment.stop  # what the driver reads off the class: a turn ends at a call's closing tag
    make.trl = True
    make.tool_schemas = functools.partial(tool_schemas, cls)  # for chat-template prompts (stages' --prompts)
    make.read_by = lambda fns: factory(cls, label, ReadBy(
        tuple(f.name for f in fns if f.takes_environments),
        tuple(f.name for f in fns if f.reads_environments and not f.takes_environments)))
    return make
