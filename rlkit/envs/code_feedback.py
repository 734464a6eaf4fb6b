"""The built-in `code-feedback` environment and task: the code task as a multi-turn environment, where the model
reads what its failing program did and tries again.

`--env code-feedback[:attempts=3,visible=2,reward=all,discount=1,credit=all,messages=0,data=FILE,...]`
(`CodeFeedbackEnv`)
brings the code task's prompts (`rlkit.tasks.code`: the generated task without `data`, `data=FILE|sample` and its
column options `question`, `tests`, `heldout`, `ops`, `max`, `timeout`, `memory` as the code task reads them). A model
turn is a program (extracted as the code task extracts it). Each problem's tests are split: the first `visible`
(default 2, at most all but one) are the visible tests, as the public tests of the code-RL sets; the others are
hidden. After each program:

- it does not compile: the observation is the SyntaxError (its last lines), and the model tries again;
- a visible test fails: the observation is that test as a programmer would see it, the first failing one, in
  order: its input (the call, the expression, the assertion or stdin), the expected and the actual output, or
  the error's traceback, its last `FEEDBACK_TB_FRAMES` frames in the program, and the model tries again;
- every visible test passes, or this was attempt `attempts`: the episode ends, and the reward is the code task's
  on the final program against all tests, visible and hidden (`reward=all`: 1.0 when every test passes;
  `reward=fraction`: the share passed), times `discount` ** (attempts used - 1) (default 1: no discount).

`credit` says which programs a trajectory's reward trains (the environment's `credit` attribute, read by the
rollout driver, `rlkit.sampling.driver`). `credit=all` (default): every program, with the trajectory's reward.
`credit=final`: only the final program (the earlier ones' `loss_mask` 0), so the reward of a repaired trajectory
reinforces its fix and not the wrong first program it repaired. `credit=turn`: every program with its own result (a
row a program, rewarded with its own step's reward: 0 for a program that failed a visible test, the final
program's reward for the last), so GRPO's group baseline is taken over programs: a first program is judged as
single-turn RL judges it, and a second by whether it fixed the first.

A hidden test's input and expected value never reach the model: only its pass or fail, through the reward. The
feedback runs only visible tests; the reward's run is the code task's (`rlkit.sandbox.programs`: the expected values
stay on the host). The observation is text (`messages=1`: a user message, for chat models; `reset`'s prompt too),
at most `FEEDBACK_CHARS` characters. The trajectory's `turns` column is the number of attempts it used, `reward/env`
its reward. The generated task's model turn is one line (`stop` is a newline, 40 tokens); with `data` a turn ends
at eos (512 tokens).

Every program runs in its own sandbox (`--sandbox`, bwrap unless `none`), with the code task's limits; the calls of
different trajectories run at once (`--env-workers` threads; nothing here holds a lock while a program runs).

`--task code-feedback[:visible=2,fix=0.5,ops=2-3,max=9,heldout=0.1]` (`CodeFeedback`) has the generated
code task's prompts and split, and as SFT target a `fix` share (fixed per prompt) of transcripts with a wrong first
program, the environment's feedback on it (masked from the loss) and the right program, exactly as a rollout
against `CodeFeedbackEnv` tokenises them (no chat template); the others write the right program at once. As a
single-turn task its verifier scores the first program (pass at attempt 1).
"""

from __future__ import annotations

import json
import marshal
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from rlkit.envs.base import Step, on_cancel
from rlkit.errors import RlkitError
from rlkit.tasks.base import Example, Scores, TaskBase, Transcript, check, span
from rlkit.tasks.code import Code, chain_program, extract_program, parse_tests

FEEDBACK_CHARS = 1000  # an observation's length at most (then cut, with "...")
FEEDBACK_VALUE_CHARS = 200  # one shown value (an input, an expected or actual output) at most
JUDGED_CHARS = 1 << 20  # a visible test's output (stdout, a value as JSON) compared at most: longer is wrong
FEEDBACK_TB_FRAMES = 2  # an error's traceback is shown with its last frames in the program (and the error)
STOP = "\n"  # the generated task's model turn: one line
CREDITS = ("all", "final", "turn")  # the programs of a trajectory its reward trains (`CodeFeedbackEnv.credit`)
SANDBOX_MB = 10  # a sandboxed run's resident memory, Python and the feedback runner (max RSS measured: 10.3 MB)

# The feedback run, inside the sandbox (`python -I -S -c RUNNER`, under the code task's limits): the program against
# the visible tests only, in order, to the first that errs; one JSON line per test on a private descriptor, with what
# it printed (stdio) or returned (call/expr), or the error's last traceback lines. It judges nothing: the host
# compares, and the reward never comes from this run (a program that forges its output here only ends its episode).
RUNNER = r'''
import io, json, linecache, marshal, os, sys, traceback
job = marshal.loads(sys.stdin.buffer.read())
res = os.dup(1)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
write, dumps, cap, keep, big = os.write, json.dumps, job["cap"], job["tb_frames"], job["judged"]
def emit(obj):
    write(res, (dumps(obj) + "\n").encode())
def tail(e):
    frames = [f for f in traceback.extract_tb(e.__traceback__)[-50:] if f.filename in ("main.py", "<test>")][-keep:]
    lines = "".join(traceback.format_list(frames) + traceback.format_exception_only(type(e), e)).splitlines()
    lines = [ln for ln in lines if ln.strip() and not set(ln.strip()) <= set("~^")]  # no caret lines
    return "\n".join(["Traceback (most recent call last):"] * bool(frames) + lines)[:4 * cap]
src = job["program"]
linecache.cache["main.py"] = (len(src), None, src.splitlines(True), "main.py")
try:
    code = compile(src, "main.py", "exec", dont_inherit=True)
except BaseException as e:
    emit({"syntax_error": "".join(traceback.format_exception_only(type(e), e)).strip()[-4 * cap:]})
    raise SystemExit(0)
emit({"compiled": 1})
if job["mode"] == "stdio":
    for i, inp in enumerate(job["cases"]):
        out = io.StringIO()
        sys.stdin, sys.stdout, sys.stderr = io.StringIO(inp), out, io.StringIO()
        err = None
        try:
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as e:
            if e.code not in (None, 0):
                err = "SystemExit: %r" % (e.code,)
        except BaseException as e:
            err = tail(e)
        r = {"i": i, "stdout": out.getvalue()[:big + 1]}
        if err:
            r["error"] = err
        emit(r)
        if err:
            break
else:
    g = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(code, g)
    except BaseException as e:
        emit({"i": 0, "error": tail(e)})
        raise SystemExit(0)
    fn_name = job["fn_name"]
    for i, (kind, inp) in enumerate(job["cases"]):
        try:
            ns = dict(g)
            if kind == "call":
                fn = g.get(fn_name)
                if fn is None and "Solution" in g:
                    fn = getattr(g["Solution"](), fn_name)
                if fn is None:
                    raise NameError("name %r is not defined" % fn_name)
                v = fn(*inp) if type(inp) is list else fn(inp)
            elif kind == "expr":
                v = eval(compile(inp, "<test>", "eval"), ns)
            else:
                exec(compile(inp, "<test>", "exec"), ns)
                v = True
        except BaseException as e:
            emit({"i": i, "error": tail(e)})
            break
        r = {"i": i, "repr": repr(v)[:cap + 1]}
        try:
            text = dumps(v)
            if len(text) <= big:
                r["value"] = json.loads(text)
        except Exception:
            pass
        emit(r)
'''


# ---------------------------------------------------------------------------------------------
# What a programmer sees of a failing test


def _cut(text: str, n: int = FEEDBACK_VALUE_CHARS) -> str:
    return text if len(text) <= n else text[:n] + "..."


def shown_test(case, fn_name: str | None) -> str:
    """A test as the feedback names it: the call `f(2)`, the expression or assertion, or its stdin."""
    if case.kind == "call":
        args = case.input if isinstance(case.input, list) else [case.input]
        return _cut(f"{fn_name}({', '.join(map(repr, args))})")
    if case.kind in ("expr", "assert"):
        return _cut(str(case.input))
    return "input:\n" + _cut(str(case.input).rstrip("\n"))


def _shown(case, value) -> str:
    """An expected value as shown: stdout text as it is, a call/expr value as Python writes it."""
    if case.kind == "stdio":
        text = "\n".join(map(str, value)) if isinstance(value, list) else "" if value is None else str(value)
        return _cut(text.rstrip("\n"))
    return _cut(repr(value))


def feedback_text(case, fn_name: str | None, result: dict) -> str:
    """The observation for a failing visible test `case` (an `rlkit.sandbox.programs.TestCase`) and the feedback
    run's `result` for it (`stdout`, `repr`, `error`, or none of them: it never finished), ending with a newline.

        Failed test: f(1)
        Expected: 7
        Got: 8
    """
    head = f"Failed test: {shown_test(case, fn_name)}\n"
    if "error" in result:
        return _fit(head + str(result["error"]) + "\n")
    if "timeout" in result:
        return _fit(head + f"Timed out ({result['timeout']:g} s for all the tests)\n")
    if "crashed" in result:
        return _fit(head + f"{result['crashed']}\n")
    if case.kind == "assert":
        return _fit(head + "AssertionError\n")
    got = _cut(str(result.get("stdout", "")).rstrip("\n")) if case.kind == "stdio" else _cut(str(result.get("repr")))
    if case.kind == "stdio":
        return _fit(f"{head}Expected output:\n{_shown(case, case.expected)}\nGot:\n{got}\n")
    expected = case.expected  # APPS wraps a return value in a list: shown bare beside a value that is not a list
    if type(expected) is list and len(expected) == 1 and type(result.get("value")) is not list:
        expected = expected[0]
    return _fit(f"{head}Expected: {_shown(case, expected)}\nGot: {got}\n")


def syntax_feedback(error: str) -> str:
    return _fit(f"{error.strip()}\n")


def _fit(text: str) -> str:
    return text if len(text) <= FEEDBACK_CHARS else text[:FEEDBACK_CHARS - 4] + "...\n"


def _passes(case, result: dict) -> bool:
    from rlkit.sandbox.programs import stdio_equal, value_equal

    if any(k in result for k in ("error", "timeout", "crashed")):
        return False
    if case.kind == "stdio":
        return isinstance(result.get("stdout"), str) and stdio_equal(result["stdout"], case.expected)
    if case.kind == "assert":
        return "repr" in result
    return "value" in result and value_equal(result["value"], case.expected)


def split_tests(suite, visible: int):
    """(the visible cases, the hidden ones) of a TestSuite: the first `visible`, leaving at least one hidden."""
    v = max(0, min(visible, len(suite.cases) - 1))
    return suite.cases[:v], suite.cases[v:]


def _exchange(p, data: bytes, deadline: float, cap: int) -> tuple[bytes, bool]:
    """Write `data` to p's stdin (from a thread: the runner reads it whole first), read its stdout up to `cap` bytes
    until it closes or the deadline passes; (stdout, timed out). stderr is not read (the runner writes none)."""
    import os
    import selectors
    import threading

    def feed():
        try:
            p.stdin.write(data)
            p.stdin.close()
        except (OSError, ValueError):
            pass

    threading.Thread(target=feed, daemon=True).start()
    out = bytearray()
    fd = p.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while len(out) < cap:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), True
            if not sel.select(left):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out += chunk
    return bytes(out[:cap]), False


def first_failure(sb, program: str, cases: Sequence, fn_name: str | None) -> str | None:
    """Run `program` against the visible `cases` in the sandbox `sb` (one sandbox, the code task's limits): the
    feedback on its syntax error or its first failing case, or None when it compiles and every case passes."""
    from rlkit.sandbox.process import kill, python, spawn

    lim = sb.limits
    cap = FEEDBACK_VALUE_CHARS
    mode = "stdio" if cases and all(c.kind == "stdio" for c in cases) else "fn"
    payload = {"program": program, "mode": mode, "fn_name": fn_name, "cap": cap, "tb_frames": FEEDBACK_TB_FRAMES,
               "judged": JUDGED_CHARS,
               "cases": [c.input for c in cases] if mode == "stdio" else [[c.kind, c.input] for c in cases]}
    sb.check()
    p = spawn(sb, [python(), "-I", "-S", "-X", "utf8", "-c", RUNNER])
    try:
        with on_cancel(lambda: kill(p)):
            out, timed_out = _exchange(p, marshal.dumps(payload), time.monotonic() + lim.wall_s,
                                       (len(cases) + 2) * (6 * JUDGED_CHARS + 8 * cap + 256))
    finally:
        kill(p)
    lines = []
    for line in out.split(b"\n"):
        try:
            r = json.loads(line)
        except (ValueError, RecursionError):
            break
        if type(r) is not dict:
            break
        lines.append(r)
    if lines and isinstance(lines[0].get("syntax_error"), str):
        return syntax_feedback(lines[0]["syntax_error"])
    results = {r["i"]: r for r in lines[1:] if isinstance(r.get("i"), int)}
    for i, case in enumerate(cases):
        r = results.get(i)
        if r is None:  # it never reported this test: out of time, or ended (a limit, os._exit) before
            why = {"timeout": lim.wall_s} if timed_out else \
                {"crashed": f"The program ended before this test finished (exit status {p.returncode})"}
            return feedback_text(case, fn_name, why)
        if not _passes(case, r):
            return feedback_text(case, fn_name, r)
    return None


# ---------------------------------------------------------------------------------------------
# The environment


def _problems(attempts: int = 3, visible: int = 2, reward: str = "all", discount: float = 1.0, credit: str = "all",
              messages: bool = False, data: str = "", question: str = "question", tests: str = "",  # noqa: ARG001
              heldout: float = 0.1, ops: str = "2-3", max: int = 9, timeout: float = 10.0,  # noqa: A002
              memory: int = 1024) -> Code:
    """The code task whose problems `CodeFeedbackEnv` poses, its options checked (one line for a bad one)."""
    check("environment code-feedback", (1 <= attempts <= 20, f"attempts={attempts}", "1 <= attempts <= 20"),
          (visible >= 0, f"visible={visible}", "visible >= 0 (tests shown as feedback)"),
          (0 < discount <= 1, f"discount={discount:g}", "0 < discount <= 1"),
          (credit in CREDITS, f"credit={credit}", ", ".join(CREDITS[:-1]) + " or " + CREDITS[-1]))
    try:
        lo, hi = span(ops)
    except ValueError:
        raise RlkitError(f"environment code-feedback: ops={ops!r}: expected LO-HI (integers)") from None
    return Code(data or None, question, tests or None, None, heldout, reward, timeout, memory, lo, hi, max).checked()


class CodeFeedbackEnv:
    """`--env code-feedback`: write a program; on failure read the first failing visible test (or the error) and
    try again, up to `attempts` programs; reward: the final program's on all tests (see the module docstring)."""

    stop = ()  # the generated task's turn ends at a newline (`option_attribute`); a data task's at eos
    max_new_tokens = 40
    max_turns = 3

    @staticmethod
    def option_attribute(name: str, options: dict):
        """`stop`, `max_new_tokens` and `max_turns` as the options set them (`EnvSpec.attribute`)."""
        data = bool(options.get("data"))
        if name == "stop":
            return None if data else (STOP,)
        if name == "max_new_tokens":
            return 512 if data else 40
        if name == "max_turns" and options.get("attempts"):
            return int(options["attempts"])
        return None

    @classmethod
    def resources(cls, options: dict, trajectories: int, env_workers: int) -> list[str]:
        """What a rollout of `trajectories` trajectories holds beside the GPU (`rlkit plan rollout --env code-feedback`):
        a sandbox per program run, alive while it runs, at most one per environment call running."""
        at_once = min(trajectories, env_workers)
        memory, attempts = int(options.get("memory", 1024)), int(options.get("attempts", 3))
        return [f"up to {at_once:,} sandboxed programs at once (one per --env-workers call running; a sandbox lives "
                f"while its program runs), about {SANDBOX_MB} MB of host memory each for Python itself "
                f"({at_once * SANDBOX_MB / 1024:.1f} GiB), each process up to {memory:,} MB of address space",
                f"up to {attempts} programs a trajectory: a sandboxed run of the visible tests for each but the "
                f"last, and one of all the tests for the final program; each run uses up to a CPU core: size "
                "--env-workers to the host's cores"]

    @staticmethod
    def check_options(options: dict) -> None:
        """The options checked when the spec is read, before any model loads (one line for a bad one)."""
        _problems(**{k: v for k, v in options.items() if k != "sandbox"})

    def __init__(self, attempts: int = 3, visible: int = 2, reward: str = "all", discount: float = 1.0,
                 credit: str = "all", messages: bool = False, data: str = "", question: str = "question", tests: str = "",
                 heldout: float = 0.1, ops: str = "2-3", max: int = 9, timeout: float = 10.0,  # noqa: A002
                 memory: int = 1024, sandbox: str = "bwrap") -> None:
        from rlkit.sandbox import Sandbox

        self.task = _problems(attempts, visible, reward, discount, credit, messages, data, question, tests, heldout, ops, max,
                              timeout, memory)
        if sandbox not in ("bwrap", "none"):
            raise RlkitError(f"environment code-feedback: sandbox={sandbox}: expected bwrap or none")
        self.attempts, self.visible, self.discount, self.messages = attempts, visible, discount, messages
        self.credit = credit  # read by the rollout driver: which programs train, with which reward
        self.sandbox = Sandbox(sandbox, limits=self.task.limits())
        self.sandbox.check()  # once a process: no bubblewrap is one line before any sampling
        self.suite = None
        self.turn = 0

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        return self.task.iter_examples(split, seed, unique)

    def reset(self, example):
        try:
            self.suite = parse_tests(example.answer)
        except ValueError as e:
            raise RlkitError(f"environment code-feedback: the example's tests {example.answer[:80]!r} are not a test "
                             f"set: {e}") from None
        self.turn = 0
        return [{"role": "user", "content": example.prompt}] if self.messages else example.prompt

    def step(self, action: str) -> Step:
        if self.suite is None:
            raise RlkitError("environment code-feedback: step() before reset()")
        self.turn += 1
        program = extract_program(action)
        shown, _ = split_tests(self.suite, self.visible)
        note = first_failure(self.sandbox, program, shown, self.suite.fn_name) if self.turn < self.attempts else None
        if note is not None:  # the last attempt gets no feedback: only its reward's run
            if self.messages:
                return Step([{"role": "user", "content": note}], 0.0)
            return Step(("" if action.endswith("\n") else "\n") + note, 0.0)
        from rlkit.sandbox.programs import run_program

        o = run_program(self.sandbox, program, self.suite)  # all tests; the expected values stay here
        r = float(o.total > 0 and o.passed == o.total) if self.task.reward_mode == "all" else o.passed / max(1, o.total)
        return Step(None, r * self.discount ** (self.turn - 1), terminated=True)


# ---------------------------------------------------------------------------------------------
# The SFT transcripts


def _wrong_programs(chain: list[tuple[str, int]], top: int, rng: random.Random) -> list[str]:
    """Plausible wrong programs for an operation chain, in a random order: a constant off, an operation swapped,
    one left out, the parentheses forgotten."""
    out = []
    for j, (op, k) in enumerate(chain):
        for k2 in sorted({max(1, k - 1), min(top, k + 1), rng.randint(1, top)} - {k}):
            out.append(chain_program([*chain[:j], (op, k2), *chain[j + 1:]]))
        for op2 in sorted({"+", "-", "*"} - {op}):  # sorted: a set of str iterates by PYTHONHASHSEED
            out.append(chain_program([*chain[:j], (op2, k), *chain[j + 1:]]))
        if len(chain) > 1:
            out.append(chain_program(chain[:j] + chain[j + 1:]))
    head, _, expr = chain_program(chain).partition("return ")
    flat = head + "return " + expr.replace("(", "").replace(")", "")
    if flat != chain_program(chain):
        out += [flat] * 3  # the commonest slip
    rng.shuffle(out)
    return out


def _value(program: str, x: int) -> int:
    """A generated program's value at x (its one-line arithmetic on the host: these programs are ours, not a
    model's)."""
    expr = program.split("return ", 1)[1]
    return eval(compile(expr, "<chain>", "eval"), {"__builtins__": {}}, {"x": x})  # noqa: S307


@dataclass(frozen=True)
class CodeFeedback(TaskBase):
    """`--task code-feedback`: the generated code task's prompts with repair transcripts as SFT targets (see the
    module docstring). Knobs: `visible` as the environment's; `fix` the share of transcripts with a wrong first
    program (two attempts: they fit any `attempts` of 2 or more); `ops`, `max`, `heldout`, `timeout`, `memory` as
    the code task's."""

    name = "code-feedback"
    runs_code = True
    widen = "widen the task (ops=, max=)"

    visible: int = 2
    fix: float = 0.5
    heldout_fraction: float = 0.1
    min_ops: int = 2
    max_ops: int = 3
    max_constant: int = 9
    timeout_s: float = 10.0
    memory_mb: int = 1024
    OPTIONS = {"visible": ("visible", int, "N"), "fix": ("fix", float, "F"),
               "heldout": ("heldout_fraction", float, "F"), "ops": (("min_ops", "max_ops"), span, "LO-HI"),
               "max": ("max_constant", int, "N"), "timeout": ("timeout_s", float, "S"),
               "memory": ("memory_mb", int, "MB")}

    @property
    def targets_are_gold(self) -> bool:
        """A repair transcript's first program is wrong by design, and the verifier scores the first program: with a
        `fix` share the targets are demonstrations, not gold answers (`rlkit.tasks.trust`)."""
        return self.fix == 0

    def checked(self) -> CodeFeedback:
        check("--task code-feedback", (1 <= self.visible, f"visible={self.visible}", "visible >= 1 (the feedback needs a visible test)"),
              (0 <= self.fix <= 1, f"fix={self.fix:g}", "0 <= fix <= 1"))
        self.code.checked()
        return self

    @property
    def code(self) -> Code:
        return Code(heldout_fraction=self.heldout_fraction, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                    min_ops=self.min_ops, max_ops=self.max_ops, max_constant=self.max_constant)

    @property
    def spec(self) -> str:
        return (f"code-feedback:visible={self.visible},fix={self.fix},"
                + self.code.spec.removeprefix("code:").replace(",reward=all", ""))

    @property
    def problems_spec(self) -> str:
        return self.code.problems_spec

    @property
    def max_new_tokens(self) -> int:
        return 41  # the first program and its newline

    @cached_property
    def _code(self) -> Code:
        return self.code

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        return self._code.iter_examples(split, seed, unique)

    def problem_space(self) -> int:
        return self._code.problem_space()

    def completion(self, ex: Example) -> Transcript:
        """The SFT target: for a `fix` share of the prompts (fixed per prompt) a wrong program, the environment's
        feedback on its first failing visible test, and the right program; else the right program alone."""
        right = self._code.completion(ex)
        rng = random.Random(f"code-feedback|{ex.prompt}")
        if rng.random() >= self.fix:
            return Transcript.turns(right + STOP)
        suite = parse_tests(ex.answer)
        shown, _ = split_tests(suite, self.visible)
        chain = [(part[0], int(part[1:])) for part in ex.prompt.removeprefix("# f(x): ").strip().split(", ")]
        for wrong in _wrong_programs(chain, self.max_constant, rng):
            for case in shown:
                got = _value(wrong, case.input[0])
                if got != case.expected:
                    note = feedback_text(case, suite.fn_name, {"repr": repr(got), "value": got})
                    return Transcript.turns(wrong + STOP, note, right + STOP)
        return Transcript.turns(right + STOP)  # no slip shows on the visible tests

    def score_batch(self, responses: Sequence[str], answers: Sequence[str], sandbox=None) -> Scores:
        """The first program (the first line) of each response, as the code task scores it: pass at attempt 1."""
        return self._code.score_batch([r.split(STOP, 1)[0] for r in responses], answers,
                                      replace(sandbox, limits=self._code.limits()) if sandbox else None)

    def reward(self, response: str, answer: str) -> float:
        return self.score_batch([response], [answer]).values[0]
