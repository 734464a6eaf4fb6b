"""The environment protocol, a leaf module (no torch): what `rlkit rollout --env` runs a trajectory against.

An environment is a class; rlkit makes one instance per trajectory, calls `reset(example)` once, then
`step(action)` after every model turn until the environment says the episode is over (or a limit is reached),
and finally `close()` when the class has one (always, also after an error):

    class Env:
        def reset(self, example) -> Observation: ...          # example: rlkit.tasks.Example (prompt, answer, ...)
        def step(self, action: str) -> Step | tuple: ...      # action: the model's turn, decoded text
        def close(self) -> None: ...                          # optional

An `Observation` is text (appended to the trajectory as tokens: the tokenizer's encoding of exactly that text) or
a list of chat messages ({"role": ..., "content": ...}; rendered through the chat template, only the new suffix
tokenised). `reset`'s observation is the prompt; it may simply return `example.prompt`.

`step` returns a `Step(observation, reward, terminated, truncated)`, or a plain tuple `(observation, reward,
done)` or `(observation, reward, terminated, truncated)` (gymnasium's order). `terminated`: the episode reached
its end (won, lost, answered); `truncated`: it was cut short (a limit of the environment's own), not lost. When
neither is set, `observation` (not None) is appended and the model takes another turn. The trajectory's reward is
the sum of its steps' rewards.

Optional, read when present:
  `iter_examples(split, seed)`: the environment brings its own prompts (as a task does); otherwise they come from
      `--task` or `--prompts`.
  `stop`: strings that end a model turn (a tool call's closing tag); the turn keeps them.
  `tool_calls`: the calls the trajectory made, read after the episode (the `tool_calls` column).
  `max_new_tokens`: the environment's per-turn generation length, when `--max-new-tokens` is not given.
  `tool_schemas()`: the JSON schemas of its tools, given to the chat template as `tools=` (`Tools` has it).
  `prompt_hint`: what to do when `reset`'s prompt does not fit the model's context (textarena: `prompt=TEXT`).
  `max_sessions`: each instance holds a resource from `reset` to `close` (a server's session): at most this many
      instances are open at once, and the other trajectories queue for one; `True`: at most `--env-workers`. A `reset`
      that finds no session free (a server at capacity) raises `Busy`: the trajectory waits and tries again.
Any method may be an `async def` (and a `Tools` tool too): it is awaited on an event loop, many at once. Calls of
different trajectories run at the same time (`--env-workers` threads), never two of one instance; code that a call
runs in another process registers how to stop it with `on_cancel` (the call's time limit kills it).
Any task is a one-step environment: `TaskEnv`.

How the driver calls a method (`call_env`): what no `except Exception` would catch or tell apart comes back as an
`EnvError` naming the class and the method: `sys.exit()` inside it, arguments that do not fit its signature. An
error that every trajectory meets (`every_trajectory`: a server that refuses the connection, a wrong signature)
stops the stage without suggesting `--env-errors end` (`failure_line`), which would only end every trajectory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, Union

from rlkit.errors import RlkitError

Observation = Union[str, list[dict[str, str]]]  # noqa: UP007 (read at run time by older typing users)


@dataclass(frozen=True)
class Step:
    """What `step` returns: the next observation (None when the episode is over), the step's reward, and
    whether the episode ended (`terminated`) or was cut short (`truncated`)."""

    observation: Observation | None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False


class Environment(Protocol):
    def reset(self, example: Any) -> Observation: ...

    def step(self, action: str) -> Step | tuple: ...


class EnvError(RlkitError):
    """An environment misbehaved (raised, returned a bad value, overran its time limit): one line naming the
    class, the method and the trajectory. `every_trajectory`: the error is not this trajectory's but the
    environment's (a server that refuses connections, a method that cannot take rlkit's arguments)."""

    def __init__(self, message: str = "", every_trajectory: bool = False) -> None:
        super().__init__(message)
        self.every_trajectory = every_trajectory


ENV_ERRORS_END = " (--env-errors end: end such trajectories with reward 0 instead)"


def every_trajectory(error: BaseException | None) -> bool:
    """Whether `error` would meet every trajectory, not just the one it hit: an `EnvError` that says so, or a
    refused connection (`ConnectionRefusedError`, also as the cause or context of what the environment raised:
    a client library's own connection error)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ConnectionRefusedError) or getattr(error, "every_trajectory", False) is True:
            return True
        error = error.__cause__ or error.__context__
    return False


def failure_line(line: str, error: BaseException | None = None) -> str:
    """The one line a failing environment call stops the stage with (`--env-errors fail`): `line`, then the
    suggestion to end such trajectories instead (`--env-errors end`), unless the line already names that option or
    the error would meet every trajectory (`every_trajectory`), where ending them all is no remedy."""
    if "--env-errors" in line or every_trajectory(error):
        return line
    return line + ENV_ERRORS_END


def call_env(name: str, method: str, fn, *args):
    """`fn(*args)`: environment `name`'s `method` (a bound method), as the driver calls it. `sys.exit()` inside it
    (SystemExit, past every `except Exception`) and arguments that do not fit its signature (a TypeError raised by
    the call itself, not inside the method; every trajectory meets it) are an `EnvError` naming the class and the
    method (the driver adds the trajectory); anything else propagates as raised."""
    try:
        return fn(*args)
    except SystemExit as e:
        raise EnvError(f"environment {name}: {method}() called sys.exit({e.code!r})") from None
    except TypeError as e:
        why = _unbindable(fn, args)
        if why is None:
            raise
        raise EnvError(f"environment {name}: {method}() cannot be called with {why}",
                       every_trajectory=True) from e


def _unbindable(fn, args: tuple) -> str | None:
    """Why `fn` cannot take `args` (its signature, in words), or None when they bind (or it has no signature)."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*args)
    except TypeError as e:
        n = len(args)
        return f"{n} argument{'' if n == 1 else 's'} ({e}); its signature is {getattr(fn, '__name__', 'it')}{sig}"
    return None


class Busy(EnvError):
    """`reset` found no session free (a server at capacity): the driver tries again later, for up to `wait` seconds
    from the first refusal, then reports this error's line."""

    def __init__(self, message: str, wait: float = 30.0) -> None:
        super().__init__(message)
        self.wait = wait


_CANCEL: ContextVar[list | None] = ContextVar("rlkit_env_cancel", default=None)


@contextmanager
def on_cancel(stop: Callable[[], None]) -> Iterator[None]:
    """Within an environment call: `stop()` is run (from another thread) if the driver gives the call up (its time
    limit, a failing stage), e.g. to kill a worker process the call waits on. Outside the driver: nothing."""
    hooks = _CANCEL.get()
    if hooks is None:
        yield
        return
    hooks.append(stop)
    try:
        yield
    finally:
        try:
            hooks.remove(stop)
        except ValueError:
            pass


@contextmanager
def cancel_scope(hooks: list) -> Iterator[None]:
    """The driver's side of `on_cancel`: what the body registers goes to `hooks`."""
    token = _CANCEL.set(hooks)
    try:
        yield
    finally:
        _CANCEL.reset(token)


def as_step(value: object, where: str) -> Step:
    """`step`'s value as a Step: a Step, or a 3-tuple (observation, reward, done) or 4-tuple (observation,
    reward, terminated, truncated); the reward a finite number, the observation text, messages or None."""
    from rlkit.plugins.user_code import as_number

    if isinstance(value, Step):
        s = value
    elif isinstance(value, tuple) and len(value) in (3, 4):
        s = Step(value[0], value[1], bool(value[2]), bool(value[3]) if len(value) == 4 else False)
    elif isinstance(value, tuple) and len(value) == 5:  # gymnasium's (obs, reward, terminated, truncated, info)
        s = Step(value[0], value[1], bool(value[2]), bool(value[3]))
    else:
        raise EnvError(f"{where} returned a {type(value).__name__}; expected rlkit.envs.Step(observation, reward, "
                       "terminated, truncated) or a tuple (observation, reward, done)")
    r = as_number(s.reward)
    if r is None:
        raise EnvError(f"{where} returned the reward {s.reward!r:.60}; expected a finite number")
    check_observation(s.observation, where, allow_none=True)
    return Step(s.observation, r, bool(s.terminated), bool(s.truncated))


MAX_OBSERVATION_CHARS = 1_000_000  # an observation longer than this is a bug in the environment, not context


def check_observation(obs: object, where: str, allow_none: bool = False) -> None:
    if obs is None:
        if allow_none:
            return
        raise EnvError(f"{where} returned None; expected an observation (text or a list of chat messages)")
    if isinstance(obs, str):
        size = len(obs)
    elif isinstance(obs, Sequence) and all(isinstance(m, Mapping) and isinstance(m.get("content"), str)
                                           and isinstance(m.get("role"), str) for m in obs):
        size = sum(len(m["content"]) for m in obs)
    else:
        raise EnvError(f"{where} returned a {type(obs).__name__} observation; expected text or a list of chat "
                       "messages ({'role': ..., 'content': ...})")
    if size > MAX_OBSERVATION_CHARS:
        raise EnvError(f"{where} returned an observation of {size:,} characters; the limit is "
                       f"{MAX_OBSERVATION_CHARS:,} (--max-env-tokens then cuts what is appended)")


def prompt_too_long(env, label: str, tokens: int, context: int) -> RlkitError:
    """The line for `reset`'s prompt of trajectory `label` that leaves the model no room to generate (`tokens` of a
    `context`): `env` (an `EnvSpec`) names itself, and says how to shorten the prompt when it has a `prompt_hint`
    (textarena: `prompt=TEXT` in place of the game's rules)."""
    hint = env.attribute("prompt_hint")
    return RlkitError(f"environment {env.name}: reset()'s prompt for {label} is {tokens} tokens; the model's context "
                      f"is {context}, with no room left to generate" + (f"; {hint}" if isinstance(hint, str) else ""))


def unescape(text: str) -> str:
    """An option's text with its backslash escapes read (`stop=\\n` is a newline): options come from a command line."""
    return text.encode().decode("unicode_escape")


def option_attribute(name: str, options: dict):
    """For an adapter whose spec options set `stop`, `max_new_tokens` and `max_sessions` (`textarena:...,stop=\\n`):
    the attribute as those options give it, read without an instance (`EnvSpec.attribute`); None: the class's own."""
    if name == "stop" and options.get("stop"):
        return (unescape(str(options["stop"])),)
    if name == "max_new_tokens" and options.get("max_new_tokens"):
        return int(options["max_new_tokens"])
    if name == "max_sessions" and options.get("max_sessions"):
        return int(options["max_sessions"])
    return None


class TaskEnv:
    """A task as a one-step environment: the prompt is the observation, the task's verifier scores the one
    turn, and the episode ends."""

    def __init__(self, task) -> None:
        self.task = task
        self.answer = None

    def reset(self, example) -> str:
        self.answer = example.answer
        return example.prompt

    def step(self, action: str) -> Step:
        r = self.task.reward(action, self.answer)
        return Step(None, r if math.isfinite(r) else 0.0, terminated=True)
