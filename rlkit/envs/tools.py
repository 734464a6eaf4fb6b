"""Tool-calling environments from plain Python functions: `Tools`.

    def mul(a: int, b: int) -> int:
        "Multiply two integers."
        return a * b

    class MyEnv(Tools):
        tools = [mul]                                  # the functions; their names are the tool names
        def score(self, answer, example):              # the final answer's reward
            return float(answer.strip() == example.answer)

or `Tools(functions=[mul])` directly (its reward is 0.0). `rlkit rollout --env my_env.py:MyEnv` runs it.

A model turn that contains a call is a tool call: the tool runs and its result comes back as the observation
`[{"role": "tool", "content": str(result)}]` (rendered through the tokenizer's chat template, or as
`<tool>RESULT</tool>` for a tokenizer without one); the model then takes another turn. A turn without a call is
the final answer: the episode terminates with reward `score(answer_text, example)` (`example`: the
`rlkit.tasks.Example` that `reset` received; the default score is 0.0). Tool calls earn no reward themselves.

The call formats of `CALL_FORMATS` are read, all in every turn (the first call of the turn counts; `stop` ends the turn at a
closing tag; a new format is its parser and one line there):
  `<call>mul(37, 48)</call>`   NAME(ARGS), ARGS Python literals, positional or keyword (parsed with `ast`, never
                               evaluated: numbers, strings, lists, tuples, dicts, sets, True/False/None);
  `<tool_call>{"name": "mul", "arguments": {"a": 37, "b": 48}}</tool_call>`   the Hermes/Qwen chat templates'
                               JSON (`arguments` an object, a list of positional values, or a JSON string of one).
An opening tag without its closing tag is no call (a turn cut at its length is a final answer).

The tools' JSON schemas (`tool_schemas()`: transformers' `get_json_schema` of each function, as TRL builds them;
a function without a Google-style docstring for every argument gets its parameters from its type hints) go to the
chat template as `tools=` wherever rlkit renders through it: chat-formatted `--prompts` (a `messages` column) and
the tool messages appended after each call. A prompt that is plain text (`--task`, a `prompt` column, `calc`'s
own) is used as it is, so it must describe the tools itself (`describe()` gives one line per tool).

Failures never crash the episode; each becomes the observation `error: ...` (so the model can retry): an
unparsable call, an unknown tool, arguments that do not bind to the function's signature or do not match its
annotations (int, float, str, bool and unions of them are checked; an int is accepted for a float), a tool that
raises. `self.tool_calls` counts the turns with a call (failed ones included; `tool_errors` the failed ones).
A tool may be an `async def` (a web call, say): `step` then returns a coroutine, which the driver awaits on its event
loop (many at once, no thread held; `asyncio.run(env.step(...))` outside it); so may `score`.
A result longer than `max_output_chars` (1000) is cut there and marked `...[N characters cut]` (rollout's
--max-env-tokens then bounds the tokens appended).

Where the tools run: in the stage's process by default (the user's own code, trusted, as `--reward-fn`; the
driver's --env-timeout bounds each step). With `sandbox` (the constructor keyword: an `rlkit.sandbox.Sandbox`,
or "bwrap" / "none"; `--env NAME:sandbox=bwrap` gives it) every call runs in a sandboxed worker process instead
(`rlkit.sandbox.workers`'s workers, each call in a process of its own): a tool may then run model-written code. A
sandboxed tool must be a module-level function of a file or an importable module (the worker imports it by
name); its arguments travel as JSON (tuples arrive as lists) and each call may run `timeout` seconds (10; more
is an error observation). The workers are shared by the instances of one class and sandbox: one worker per call
running at once (at most the sandbox's `workers`, by default the CPU count; the others wait for one), kept for
later calls and stopped when the last instance is closed (`close()`). A call the driver gives up (--env-timeout) has
its worker killed at once.

Built-in tools are named by a string in `tools` (or `functions`): `"python"`, a sandboxed Python interpreter
(`rlkit.envs.python`), one list of `BUILTIN_TOOLS`. Such a tool is a session tool: an object with `name`, `function`
(its schema and signature) and `session(sandbox)`, which `Tools` opens per instance (per trajectory) and closes in
`close()`; it runs its own sandbox (the environment's `sandbox` kind, bwrap when none is given) and cuts its own
output. A configured one is given as the object (`PythonTool(timeout=5)`).
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import re
import threading
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlkit.envs.base import Step, on_cancel
from rlkit.errors import RlkitError
from rlkit.sandbox.workers import Workers

MAX_CALL_CHARS = 10_000  # a call's text longer than this is refused unparsed
# The built-in tools, by the name a `tools` list gives them: a new one is a session tool class and one line here.
BUILTIN_TOOLS: dict[str, str] = {"python": "rlkit.envs.python:PythonTool"}
_SIMPLE_TYPES = (int, float, str, bool)


@dataclass(frozen=True)
class Call:
    """A tool call read from a model turn: the tool's name and its arguments, or why it could not be read."""

    name: str | None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    error: str | None = None  # the call could not be parsed: why (then `name` may be None)


def parse_call(text: str) -> Call | None:
    """The first tool call in `text` (any format of `CALL_FORMATS`), or None when it has none."""
    found = [(m, f) for f in CALL_FORMATS.values() if (m := f.pattern.search(text)) is not None]
    if not found:
        return None
    m, f = min(found, key=lambda mf: mf[0].start())
    inner = m.group(1)
    if len(inner) > MAX_CALL_CHARS:
        return Call(None, error=f"the call is {len(inner):,} characters long; at most {MAX_CALL_CHARS:,}")
    return f.parse(inner)


def _parse_simple(inner: str) -> Call:
    shown = inner.strip()[:80]
    want = "expected <call>NAME(ARGS)</call> with Python literals as arguments"
    try:
        node = ast.parse(inner.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return Call(None, error=f"cannot parse the call {shown!r}; {want}")
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return Call(None, error=f"{shown!r} is not a call NAME(ARGS); {want}")
    name = node.func.id
    args: list = []
    kwargs: dict = {}
    try:
        for i, a in enumerate(node.args):
            if isinstance(a, ast.Starred):
                return Call(name, error=f"{name}: *arguments are not supported; {want}")
            args.append(_literal(a, f"argument {i + 1}"))
        for k in node.keywords:
            if k.arg is None:
                return Call(name, error=f"{name}: **arguments are not supported; {want}")
            kwargs[k.arg] = _literal(k.value, f"argument {k.arg}")
    except ValueError as e:
        return Call(name, error=f"{name}: {e}; {want}")
    return Call(name, tuple(args), kwargs)


def _literal(node: ast.AST, what: str):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        raise ValueError(f"{what} ({ast.unparse(node)[:40]!r}) is not a Python literal") from None


def _parse_json(inner: str) -> Call:
    want = 'expected <tool_call>{"name": NAME, "arguments": {...}}</tool_call>'
    try:
        obj = json.loads(inner)
    except (ValueError, RecursionError):
        return Call(None, error=f"cannot parse the tool call {inner.strip()[:80]!r} as JSON; {want}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call(None, error=f"the tool call has no \"name\"; {want}")
    name, a = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    if isinstance(a, str):  # OpenAI-style: the arguments as a JSON string
        try:
            a = json.loads(a) if a.strip() else {}
        except (ValueError, RecursionError):
            return Call(name, error=f"{name}: its \"arguments\" string is not JSON; {want}")
    if a is None:
        a = {}
    if isinstance(a, dict):
        return Call(name, (), a)
    if isinstance(a, list):
        return Call(name, tuple(a))
    return Call(name, error=f"{name}: \"arguments\" is a {type(a).__name__}; {want}")


@dataclass(frozen=True)
class CallFormat:
    """A tool-call format: the tags around a call in a model turn and the parser of the text between them (which
    returns a `Call`, with `error` set when the text cannot be read). The closing tag ends a `Tools` turn."""

    open: str
    close: str
    parse: Callable[[str], Call]

    @property
    def pattern(self) -> re.Pattern:
        return re.compile(re.escape(self.open) + "(.*?)" + re.escape(self.close), re.S)


# The tool-call formats a `Tools` environment reads, all of them in every turn: a new format is its parser and one
# line here.
CALL_FORMATS: dict[str, CallFormat] = {
    "python": CallFormat("<call>", "</call>", _parse_simple),  # <call>NAME(ARGS)</call>, Python literals
    "json": CallFormat("<tool_call>", "</tool_call>", _parse_json),  # Hermes/Qwen chat templates' JSON
}


class Tools:
    """An environment whose actions are tool calls (see the module docstring).

    Subclass it with `tools = [functions]` (or a dict name -> function) and `score(answer, example)`, or use
    `Tools(functions=[...])`. Class attributes read by the driver: `stop` (a turn ends at a call's closing tag),
    `max_new_tokens` (a subclass may set the turn's length). Attributes: `tool_calls`, `tool_errors` (this
    trajectory's), `example` (the one `reset` received)."""

    tools: Sequence[Callable] | Mapping[str, Callable] = ()
    stop = tuple(f.close for f in CALL_FORMATS.values())
    max_output_chars: int = 1000  # a result longer than this is cut (and marked)
    timeout: float = 10.0  # seconds per call in the sandbox (in the stage: --env-timeout bounds the whole step)

    def __init__(self, functions: Sequence[Callable] | Mapping[str, Callable] | None = None,
                 sandbox: Any = None) -> None:
        given = self.tools if functions is None else functions
        self.functions = _named(given, type(self).__name__)
        self.example = None
        self.tool_calls = 0
        self.tool_errors = 0
        self._sandbox = _as_sandbox(sandbox)
        self._sessions: dict[str, Any] = {}  # a session tool's name -> this instance's session (see BUILTIN_TOOLS)
        self._pools: list[_Pool] | None = None
        own = {name: spec for name, spec in _session_tools(given, type(self).__name__)}
        try:
            for name, spec in own.items():
                self._sessions[name] = spec.session(self._sandbox)
        except BaseException:
            self.close()
            raise
        if self._sandbox is not None:
            plain = {name: fn for name, fn in self.functions.items() if name not in own}
            self._pools = _pools_for(plain, self._sandbox, self.timeout, type(self).__name__)

    # -- the environment protocol -----------------------------------------------------------------------------------
    def reset(self, example):
        self.example = example
        self.tool_calls = self.tool_errors = 0
        return self.prompt(example)

    def step(self, action: str) -> Step:
        """The tool's result as the observation, or the final answer's score; a coroutine giving that Step when the
        tool (or `score`) is async."""
        call = parse_call(action)
        if call is None:
            reward = self.score(action, self.example)
            if inspect.isawaitable(reward):
                return self._scored(reward)
            return Step(None, reward, terminated=True)
        self.tool_calls += 1
        out = self.call(call)
        if inspect.isawaitable(out):
            return self._answered(out)
        return self._answer(*out)

    def _answer(self, ok: bool, text: str) -> Step:
        if not ok:
            self.tool_errors += 1
        return Step([{"role": "tool", "content": text}], 0.0)

    def tool_schemas(self) -> tuple[dict, ...]:
        """The tools' JSON schemas, for the chat template (`tools=`; see the module docstring)."""
        return tuple(json_schema(fn, name) for name, fn in self.functions.items())

    @classmethod
    def declared_tool_schemas(cls) -> tuple[dict, ...]:
        """The schemas of the class's own `tools`, read without an instance (for chat-formatted prompts, before any
        trajectory starts); empty for a class whose tools are given to its constructor."""
        return tuple(json_schema(fn, name) for name, fn in _named(cls.tools, cls.__name__).items())

    async def _answered(self, out) -> Step:
        return self._answer(*(await out))

    async def _scored(self, reward) -> Step:
        return Step(None, await reward, terminated=True)

    def close(self) -> None:
        """Release this instance's share of the sandboxed workers (the last instance stops them)."""
        pools, self._pools = self._pools, None
        for p in pools or ():
            p.release()
        sessions, self._sessions = self._sessions, {}
        for s in sessions.values():
            s.close()  # a session tool's sandbox (the python interpreter) dies with its trajectory

    # -- what a subclass may change --------------------------------------------------------------------------------
    def prompt(self, example):
        """The episode's first observation: the example's prompt (override to add `describe()` or messages)."""
        return example.prompt

    def score(self, answer: str, example) -> float:  # noqa: ARG002 (a subclass's)
        """The reward of the final answer (a turn without a tool call). Default 0.0."""
        return 0.0

    def describe(self) -> str:
        """One line per tool, `name(signature): first docstring line`, and the call format: for a prompt."""
        lines = []
        for name, fn in self.functions.items():
            sig = _signature(fn)
            sig = "(...)" if sig is None else str(sig)
            doc = (inspect.getdoc(fn) or "").strip().splitlines()
            lines.append(f"{name}{sig}" + (f": {doc[0]}" if doc else ""))
        return "Tools:\n" + "\n".join(lines) + "\nCall one as <call>NAME(ARGS)</call>; its result comes back as " \
                                              "<tool>RESULT</tool>."

    # -- running a call ----------------------------------------------------------------------------------------------
    def call(self, call: Call):
        """(ok, the observation's text) for one parsed call: the result, or `error: ...`; for an async tool, a
        coroutine giving that pair."""
        if call.error is not None:
            return False, f"error: {call.error}"
        fn = self.functions.get(call.name)
        if fn is None:
            return False, f"error: unknown tool {call.name!r}; tools: {', '.join(self.functions) or 'none'}"
        try:
            args, kwargs = check_arguments(fn, call.name, call.args, call.kwargs)
        except ValueError as e:
            return False, f"error: {e}"
        session = self._sessions.get(call.name)
        if session is not None:
            return session.call(*args, **kwargs)  # (ok, text), cut by the tool itself
        if self._pools is not None:
            ok, out = _pool_of(self._pools, call.name).call(call.name, args, kwargs)
            if not ok:
                return False, f"error: {out}"
            return True, self._cut(out)
        from rlkit.plugins.user_code import one_line

        try:
            out = fn(*args, **kwargs)
            if inspect.isawaitable(out):
                return self._awaited(call.name, out)
            text = out if isinstance(out, str) else str(out)
        except (Exception, SystemExit) as e:  # the tool's failure is the model's observation (as in the sandbox)
            return False, f"error: {call.name} raised {one_line(e)}"
        return True, self._cut(text)

    async def _awaited(self, name: str, out) -> tuple[bool, str]:
        from rlkit.plugins.user_code import one_line

        try:
            out = await out
            text = out if isinstance(out, str) else str(out)
        except (Exception, SystemExit) as e:
            return False, f"error: {name} raised {one_line(e)}"
        return True, self._cut(text)

    def _cut(self, text: str) -> str:
        n = self.max_output_chars
        return text if len(text) <= n else f"{text[:n]}...[{len(text) - n} characters cut]"


_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", tuple: "array",
               dict: "object", type(None): "null"}


@functools.cache
def json_schema(fn: Callable, name: str) -> dict:
    """Tool `name`'s JSON schema for the chat template's `tools=`: transformers' `get_json_schema` of `fn` (type
    hints and a Google-style docstring, as TRL builds its tools'), named `name`. A function it cannot describe (an
    argument without a docstring line, an untyped one) gets its first docstring line and its parameters' types from
    its hints (JSON's integer, number, string, boolean, array, object; no type where the hint is another)."""
    try:
        from transformers.utils import get_json_schema

        schema = get_json_schema(fn)
    except Exception:  # noqa: BLE001 (transformers refuses it: the schema from the signature)
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        props: dict = {}
        required = []
        sig = _signature(fn)
        hints = {}
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # noqa: BLE001 (an annotation that does not resolve: untyped)
            pass
        for p in (sig.parameters.values() if sig is not None else ()):
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            hint = hints.get(p.name)
            members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
            kinds = [_JSON_TYPES.get(typing.get_origin(m) or m) for m in members]
            props[p.name] = {} if None in kinds else {"type": kinds[0] if len(kinds) == 1 else kinds}
            if p.default is p.empty:
                required.append(p.name)
        schema = {"type": "function", "function": {"name": name, "description": doc[0] if doc else "",
                                                   "parameters": {"type": "object", "properties": props,
                                                                  **({"required": required} if required else {})}}}
    if schema["function"].get("name") != name:  # a tool named otherwise than its function (a dict name -> function)
        schema = {**schema, "function": {**schema["function"], "name": name}}
    return schema


def _builtin(item, owner: str):
    """`item` as a tool: a name of BUILTIN_TOOLS becomes that session tool (with its defaults); anything else is
    returned as it is (a function, or a session tool object)."""
    if not isinstance(item, str):
        return item
    if item not in BUILTIN_TOOLS:
        raise RlkitError(f"environment {owner}: no built-in tool {item!r}; built-in tools: "
                         f"{', '.join(BUILTIN_TOOLS)} (or pass a function)")
    import importlib

    module, _, attr = BUILTIN_TOOLS[item].partition(":")
    return getattr(importlib.import_module(module), attr)()


def _is_session(item) -> bool:
    """Whether `item` is a session tool (`name`, `function`, `session(sandbox)`; see BUILTIN_TOOLS)."""
    return not inspect.isroutine(item) and not isinstance(item, type) and isinstance(getattr(item, "name", None), str) \
        and callable(getattr(item, "function", None)) and callable(getattr(item, "session", None))


def _items(functions, owner: str) -> list[tuple]:
    """[(name, function or session tool)] of a `tools` list or mapping, built-in tools' names resolved."""
    if isinstance(functions, Mapping):
        return [(name, _builtin(f, owner)) for name, f in functions.items()]
    if isinstance(functions, Sequence) and not isinstance(functions, str):
        tools = [_builtin(f, owner) for f in functions]
        return [(f.name if _is_session(f) else getattr(f, "__name__", None), f) for f in tools]
    raise RlkitError(f"environment {owner}: tools is a {type(functions).__name__}; expected a list of functions "
                     f"or a dict name -> function (a built-in tool by its name in the list: {', '.join(BUILTIN_TOOLS)})")


def _session_tools(functions, owner: str) -> list[tuple]:
    """[(name, session tool)] of a `tools` list or mapping."""
    return [(name, item) for name, item in _items(functions, owner) if _is_session(item)]


def _named(functions, owner: str) -> dict[str, Callable]:
    """{tool name: function} from a list of functions (named after them; a built-in tool's name or object gives its
    schema function) or a mapping; checked."""
    items = [(name, item.function if _is_session(item) else item) for name, item in _items(functions, owner)]
    out: dict[str, Callable] = {}
    for name, fn in items:
        if not callable(fn):
            raise RlkitError(f"environment {owner}: tool {name!r} is a {type(fn).__name__}, not a function")
        if not isinstance(name, str) or not name.isidentifier():
            raise RlkitError(f"environment {owner}: tool name {name!r} is not an identifier (a lambda? name it "
                             "with a def, or pass a dict name -> function)")
        if name in out:
            raise RlkitError(f"environment {owner}: two tools are named {name!r}")
        out[name] = fn
    return out


def check_arguments(fn: Callable, name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args`/`kwargs` bound to `fn`'s signature and checked against its int/float/str/bool annotations (an int
    passed for a float becomes a float) -> (args, kwargs) to call it with; ValueError (one line) otherwise."""
    sig = _signature(fn)
    if sig is None:
        return args, kwargs  # a builtin without a signature: it will tell when called
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise ValueError(f"{name}{sig}: {e}") from None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 (an annotation that does not resolve: nothing to check)
        hints = {}
    for p, value in list(bound.arguments.items()):
        kind = sig.parameters[p].kind
        allowed = _allowed_types(hints.get(p))
        if allowed is None or kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if not any(_is(value, t) for t in allowed):
            want = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{name}: argument {p} must be {_a(want)}, got {value!r:.40} ({type(value).__name__})")
        if float in allowed and int not in allowed and type(value) is int:
            bound.arguments[p] = float(value)
    return bound.args, bound.kwargs


def _signature(fn: Callable) -> inspect.Signature | None:
    """`fn`'s signature with its annotations resolved (`(a: int, b: int) -> int`, not `'int'`), or None."""
    try:
        return inspect.signature(fn, eval_str=True)
    except Exception:  # noqa: BLE001 (an annotation that does not resolve: the raw one)
        try:
            return inspect.signature(fn)
        except (TypeError, ValueError):
            return None


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _allowed_types(hint) -> tuple | None:
    """The types a value may have for annotation `hint` when rlkit checks it (int, float, str, bool, unions of them
    with None); None: not checked."""
    if hint in _SIMPLE_TYPES:
        return (hint,)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = typing.get_args(hint)
        if all(m in _SIMPLE_TYPES or m is type(None) for m in members):
            return members
    return None


def _is(value, t) -> bool:
    if t is type(None):
        return value is None
    if t is bool:
        return type(value) is bool
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if t is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, t)


# -- the sandbox ---------------------------------------------------------------------------------------------------

def _as_sandbox(sandbox):
    """None, or the sandbox the tools run in (an rlkit.sandbox.Sandbox; "bwrap"/"none" make one), checked now."""
    if sandbox is None or sandbox == "":
        return None
    from rlkit.sandbox import KINDS, Sandbox

    if isinstance(sandbox, str):
        if sandbox not in KINDS:
            raise RlkitError(f"sandbox={sandbox!r}: expected one of {', '.join(KINDS)}")
        sandbox = Sandbox(sandbox)
    if not isinstance(sandbox, Sandbox):
        raise RlkitError(f"sandbox is a {type(sandbox).__name__}; expected an rlkit.sandbox.Sandbox, 'bwrap' or 'none'")
    if not sandbox.backend.isolated:
        if not _WARNED:
            from rlkit import console

            console.warn("sandbox none: tool calls run in worker processes with resource limits but no isolation")
            _WARNED.append(True)
    else:
        sandbox.check()
    return sandbox


_WARNED: list[bool] = []  # sandbox none's warning is said once a process
_POOLS: dict[tuple, _Pool] = {}  # (sandbox, module, tools, timeout) -> the workers its instances share
_LOCK = threading.Lock()  # _POOLS, and each pool's users and idle workers (instances call from many threads)


class _Pool:
    """The sandboxed workers running the tools of one module, shared by every instance that uses them: each call
    takes an idle worker (or starts one, up to the sandbox's `workers` at once) and gives it back after."""

    def __init__(self, key: tuple, sandbox, ref, tools: list[tuple[str, str]], timeout: float, owner: str):
        from dataclasses import replace

        self.key, self.users, self.tools, self.timeout = key, 0, tools, timeout
        self.make = lambda: _ToolWorkers(replace(sandbox, workers=1), ref, owner, f"{owner}'s tools", timeout)
        self.idle: list[_ToolWorkers] = []
        self.slots = threading.BoundedSemaphore(sandbox.n_workers)
        self.extra: dict = {"tools": tools}  # [[tool name, attribute in the module], ...]
        self.binds: list = []
        # the tools' module imports rlkit (its environment class subclasses Tools): rlkit's own folder, read-only,
        # when it is not in the Python installation or the venv the sandbox shows already (an editable install)
        import sys
        from pathlib import Path

        import rlkit

        pkg = Path(rlkit.__file__).resolve().parent
        if not any(Path(p).resolve() in pkg.parents for p in {sys.prefix, sys.base_prefix}):
            self.binds = [pkg]
            self.extra["rlkit_path"] = str(pkg.parent)

    def _worker(self) -> _ToolWorkers:
        with _LOCK:
            if self.idle:
                return self.idle.pop()
        w = self.make()
        w.config.update(self.extra)
        w.binds = [*w.binds, *self.binds]
        return w

    def call(self, name: str, args: tuple, kwargs: dict) -> tuple[bool, str]:
        try:
            payload = json.dumps({"tool": name, "args": list(args), "kw": kwargs},
                                 default=_unsendable).encode() + b"\n"
        except (TypeError, ValueError) as e:
            return False, f"{name}: an argument of type {e} cannot be sent to the sandbox (arguments travel as JSON)"
        while not self.slots.acquire(timeout=0.1):  # short waits: the driver's time limit can reach this thread
            pass
        try:
            w = self._worker()
            try:
                with on_cancel(w.kill):  # the driver gave the call up: its worker dies now, not at its own timeout
                    (reply,) = w.run([payload])
            except BaseException:  # noqa: BLE001 (a time limit of the driver's, an interrupt: no worker left mid-call)
                w.close()
                raise
            with _LOCK:
                kept = self.users > 0
                if kept:
                    self.idle.append(w)
            if not kept:
                w.close()
        finally:
            self.slots.release()
        reply = reply or {}
        if isinstance(reply.get("result"), str):
            return True, reply["result"]
        if "timeout" in reply:
            return False, f"{name} did not return within {self.timeout:g} s"
        if "error" in reply:
            return False, f"{name} raised {reply['error']}"
        return False, f"{name}: {reply.get('died', 'its sandboxed call sent a malformed reply')}"

    def release(self) -> None:
        with _LOCK:
            self.users -= 1
            if self.users > 0 or _POOLS.get(self.key) is not self:
                return
            del _POOLS[self.key]
            idle, self.idle = self.idle, []
        for w in idle:
            w.close()


def _unsendable(v):
    raise TypeError(type(v).__name__)


def _pool_of(pools: list[_Pool], name: str) -> _Pool:
    return next(p for p in pools if any(t == name for t, _ in p.tools))


def _pools_for(functions: dict[str, Callable], sandbox, timeout: float, owner: str) -> list[_Pool]:
    """The pools (one per module) that run `functions` in `sandbox`, made or shared; each counts this user."""
    import sys

    from rlkit.plugins.user_code import Ref

    groups: dict[str, list[tuple[str, str]]] = {}
    for name, fn in functions.items():
        mod_name, attr = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
        mod = sys.modules.get(mod_name or "")
        if mod is None or mod_name == "__main__" or getattr(mod, attr or "", None) is not fn:
            raise RlkitError(f"environment {owner}: tool {name!r} cannot run in the sandbox: it is not a module-level "
                             "function of a file or an importable module (the sandboxed worker imports it by name)")
        groups.setdefault(mod_name, []).append((name, attr))
    pools = []
    for mod_name, tools in groups.items():
        mod = sys.modules[mod_name]
        if mod_name.startswith("_rlkit_user_") and getattr(mod, "__file__", None):
            ref = Ref(mod.__file__, tools[0][1])  # a file rlkit imported (path/to/file.py:CLASS)
        else:
            ref = Ref(mod_name, tools[0][1])
        key = (sandbox, mod_name, tuple(tools), timeout)
        with _LOCK:
            pool = _POOLS.get(key)
            if pool is None:
                pool = _POOLS[key] = _Pool(key, sandbox, ref, [list(t) for t in tools], timeout, owner)
            pool.users += 1
        pools.append(pool)
    return pools


# The worker: rlkit.sandbox.reward_worker's (the import, the per-call forked process, the limits, the JSON lines), with
# `load` returning every tool of the module and `result` calling one by name and replying with its text.
_WORKER_TOOLS = '''
_load_function = load


def load(cfg):
    if cfg.get("rlkit_path") and cfg["rlkit_path"] not in sys.path:
        sys.path.append(cfg["rlkit_path"])
    first = _load_function(dict(cfg, name=cfg["tools"][0][1]))
    mod = sys.modules[first.__module__]
    return {tool: getattr(mod, attr) for tool, attr in cfg["tools"]}


def result(fns, req):
    out = fns[req["tool"]](*req["args"], **req["kw"])
    if hasattr(out, "__await__"):  # an async tool
        import asyncio

        async def awaited():
            return await out

        out = asyncio.run(awaited())
    text = out if isinstance(out, str) else str(out)
    return {"result": text[:1 << 20]}


main()
'''


def worker_source() -> str:
    from rlkit.sandbox.workers import worker_source as reward_worker_source

    head, sep, _ = reward_worker_source().rpartition('\nif __name__ == "__main__":')
    if not sep:
        raise RlkitError("rlkit/sandbox/reward_worker.py has no __main__ block: the tool worker cannot be built")
    return head + "\n" + _WORKER_TOOLS


class _ToolWorkers(Workers):
    """`rlkit.sandbox.workers.Workers` running the tool worker (`worker_source`)."""

    def kill(self) -> None:
        """Kill its worker processes, from any thread (the one waiting on them sees them die and cleans up)."""
        from rlkit.sandbox import kill

        for w in list(self.live):
            kill(w.proc)

    def _what(self) -> str:
        return f"environment {self.name}: the sandboxed worker of {self.label}"

    def _source(self) -> str:
        return worker_source()
