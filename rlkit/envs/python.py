"""The built-in `python` tool (a sandboxed Python interpreter) and the `python` environment: products too large to
compute in one's head, with the interpreter to compute them.

The tool, by name in any `Tools` environment: `Tools(functions=[mul, "python"])`, `tools = ["python"]`, or
configured, `tools = [PythonTool(timeout=5, memory=512, max_output=2000)]`. The model calls it as any tool,
`<tool_call>{"name": "python", "arguments": {"code": "print(12345 * 6789)"}}</tool_call>` or
`<call>python("print(12345 * 6789)")</call>`; the code runs in a sandboxed interpreter (`rlkit.sandbox.interpreter`:
bubblewrap, the code task's limits, no network, writes only to its private /tmp) and the observation is the call's
stdout, stderr and exit status (`CodeRun.text`), cut at `max_output` characters. Each trajectory (each `Tools`
instance) has an interpreter of its own, started at its first call and killed when the trajectory ends
(`close()`): names defined by one call are there in the next (`state=0`: a fresh interpreter for every call).
The interpreter runs in the sandbox of the environment's `sandbox` (`--sandbox KIND`), bwrap when none is given.

`--env python[:digits=5,heldout=0.1,timeout=10,memory=1024,max_output=1000,state=1,sandbox=...]` (`PythonEnv`)
brings the `calc` problems at a larger size (`<12345*67890>=`, products of two `digits`-digit numbers, split as
`calc`'s) and the tool; the final answer (a turn without a call) earns 1.0 when its last integer is the product.
"""

from __future__ import annotations

from collections.abc import Iterator

from rlkit.envs.base import on_cancel
from rlkit.envs.tools import Tools
from rlkit.errors import RlkitError
from rlkit.tasks.base import Example, last_integer


def python(code: str) -> str:
    """Run Python code in a sandboxed interpreter; returns its stdout, stderr and exit status.

    Args:
        code: the Python source to run (the value of a final expression is shown, as in a notebook)
    """
    from rlkit.sandbox.interpreter import run_code

    return run_code(code).text()  # called directly: a fresh interpreter (a Tools environment keeps one per trajectory)


class PythonTool:
    """The `python` tool with its limits: `timeout` (wall-clock seconds per call), `memory` (MB of address space per
    process), `max_output` (characters of stdout, and of stderr, shown), `state` (keep the interpreter across the
    calls of a trajectory), `sandbox` (a kind or an `rlkit.sandbox.Sandbox`; None: the environment's, else bwrap).

    A `Tools` session tool: `name`, `function` (whose signature and docstring are the tool's schema) and
    `session(sandbox)`, an object per trajectory with `call(*args, **kwargs) -> (ok, text)`, `kill()` and
    `close()`."""

    name = "python"
    function = staticmethod(python)

    def __init__(self, timeout: float = 10.0, memory: int = 1024, max_output: int = 1000, state: bool = True,
                 sandbox=None) -> None:
        from rlkit.sandbox import Limits

        try:
            self.limits = Limits(memory_mb=int(memory))
        except ValueError as e:
            raise RlkitError(f"python tool: memory={memory}: {e}") from None
        checks = ((timeout > 0, f"timeout={timeout:g}", "timeout > 0 (seconds)"),
                  (isinstance(max_output, int) and max_output > 0, f"max_output={max_output}", "max_output >= 1"))
        for ok, got, want in checks:
            if not ok:
                raise RlkitError(f"python tool: {got}; expected {want}")
        self.timeout, self.max_output, self.state, self.sandbox = float(timeout), max_output, bool(state), sandbox

    def session(self, sandbox=None) -> _Session:
        """A fresh interpreter for one trajectory (started at its first call), its sandbox checked now."""
        from dataclasses import replace

        from rlkit.sandbox import Sandbox
        from rlkit.sandbox.interpreter import Interpreter

        sb = self.sandbox if self.sandbox is not None else sandbox
        sb = Sandbox(sb or "bwrap") if sb is None or isinstance(sb, str) else sb
        py = Interpreter(replace(sb, limits=self.limits), self.timeout, self.max_output, self.state)
        py.check()
        return _Session(py)


class _Session:
    """One trajectory's interpreter as a `Tools` session."""

    def __init__(self, py) -> None:
        self.py = py

    def call(self, code: str) -> tuple[bool, str]:
        with on_cancel(self.py.kill):  # the driver gave the call up (--env-timeout): the sandbox dies now
            run = self.py.run(code)
        return run.ok, run.text(self.py.timeout)

    def kill(self) -> None:
        self.py.kill()

    def close(self) -> None:
        self.py.close()


IDLE_MB = 15  # an idle interpreter's sandbox, resident (bwrap twice and python -I -S; about 6 MB of it private)


def python_resources(memory: int, trajectories: int, env_workers: int, state: int = 1) -> list[str]:
    """The python tool's cost for a rollout: sandboxes alive at once, memory, concurrent calls (see `rlkit plan`)."""
    live = trajectories if state else min(trajectories, env_workers)
    held = "one per trajectory, alive from its first call to its end" if state else "one per call running"
    return [f"up to {live:,} sandboxed Python interpreters at once ({held}), about {IDLE_MB} MB of host memory each "
            f"when idle ({live * IDLE_MB / 1024:.1f} GiB), each process up to {memory:,} MB of address space",
            f"at most {min(trajectories, env_workers):,} tool calls run at once (--env-workers), each using up to a "
            "CPU core: size --env-workers to the host's cores"]


def _checked(digits: int = 5, heldout: float = 0.1, timeout: float = 10.0, memory: int = 1024,
             max_output: int = 1000, state: int = 1):
    """(the problems, the tool) of `PythonEnv`'s options; RlkitError (one line) for a bad one. Starts nothing."""
    from rlkit.envs.calc import Calc

    problems = Calc(digits, heldout).checked()
    if state not in (0, 1):
        raise RlkitError(f"python: state={state}; expected 1 (one interpreter per trajectory) or 0 (one per call)")
    return problems, PythonTool(timeout, memory, max_output, bool(state))


class PythonEnv(Tools):
    """`--env python`: the `calc` problems at `digits` (5) with the `python` tool; reward 1.0 when the final
    answer's last integer is the product (see the module docstring)."""

    tools = ["python"]
    max_new_tokens = 96  # one turn: a call (the JSON form with a short program) or the answer

    def __init__(self, digits: int = 5, heldout: float = 0.1, timeout: float = 10.0, memory: int = 1024,
                 max_output: int = 1000, state: int = 1, sandbox=None) -> None:
        self.problems, tool = _checked(digits, heldout, timeout, memory, max_output, state)
        super().__init__(functions=[tool], sandbox=sandbox)

    @classmethod
    def check_options(cls, options: dict) -> None:
        """The options checked when the spec is read, before any model loads (one line for a bad one)."""
        _checked(**{k: v for k, v in options.items() if k != "sandbox"})

    @classmethod
    def resources(cls, options: dict, trajectories: int, env_workers: int) -> list[str]:
        """What a rollout of `trajectories` trajectories holds beside the GPU (`rlkit plan rollout --env python`)."""
        return python_resources(options.get("memory", 1024), trajectories, env_workers, options.get("state", 1))

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        return self.problems.iter_examples(split, seed, unique)

    def score(self, answer: str, example) -> float:
        return last_integer(answer, example.answer)
