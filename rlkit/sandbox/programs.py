"""Run model-written programs against tests, each program in its own sandbox; compare on the host.

Only the tests' inputs enter the sandbox: the program's outputs leave it as plain JSON values (stdout text,
or the value a call/expression returned: exact int/float/str/bool/None/list/dict, anything else is a wrong
answer) and are compared here with the expected outputs, which the program can never read. The generic
`assert` form is the exception: the assertion runs inside and its pass/fail is the program's word (a program
can forge it: docs/sandbox.md).

Comparison rules: stdio — equal after stripping trailing whitespace per line and trailing blank lines; else
token-wise equal where tokens that differ both parse as floats within 1e-6 (APPS/TACO practice). call/expr —
JSON-normalised equality (tuples as lists), numbers within rel 1e-6; an APPS-style expected `[v]` also
matches v.
"""

from __future__ import annotations

import json
import marshal
import math
import os
import selectors
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rlkit.errors import SandboxUnavailable
from rlkit.sandbox.process import kill, launcher_argv, popen
from rlkit.sandbox.sandbox import Sandbox

TEST_KINDS = ("stdio", "call", "expr", "assert")


@dataclass(frozen=True)
class TestCase:
    __test__ = False  # not a pytest class

    kind: str  # "stdio" | "call" | "expr" | "assert"
    input: object  # stdin text | list of JSON args | an expression's source | an assert statement's source
    expected: object = None  # stdout text | JSON value | JSON value | None

    def __post_init__(self):
        if self.kind not in TEST_KINDS:
            raise ValueError(f"test kind {self.kind!r}: expected one of {', '.join(TEST_KINDS)}")


@dataclass(frozen=True)
class TestSuite:
    __test__ = False

    cases: tuple[TestCase, ...]
    fn_name: str | None = None  # for "call" cases


@dataclass(frozen=True)
class Outcome:
    passed: int
    total: int
    reason: str  # one of REASONS: "passed" iff passed == total; else the first failing test's


def run_program(sb: Sandbox, program: str, suite: TestSuite) -> Outcome:
    return run_programs(sb, [(program, suite)])[0]


def run_programs(sb: Sandbox, jobs: Sequence[tuple[str, TestSuite]]) -> list[Outcome]:
    """Each (program, suite) in its own sandbox, sb.n_workers at a time; Outcomes in job order. Never raises
    for what a program does; SandboxUnavailable when the sandbox itself cannot start."""
    jobs = list(jobs)
    if not jobs:
        return []
    sb.check()
    if len(jobs) == 1 or sb.n_workers == 1:
        return [_run_one(sb, prog, suite) for prog, suite in jobs]
    with ThreadPoolExecutor(max_workers=min(sb.n_workers, len(jobs)), thread_name_prefix="sandbox") as ex:
        return list(ex.map(lambda job: _run_one(sb, *job), jobs))


def _run_one(sb: Sandbox, program: str, suite: TestSuite) -> Outcome:
    cases = suite.cases
    results: list[str] = ["runtime_error"] * len(cases)  # per test: a REASON
    groups = {"stdio": [i for i, c in enumerate(cases) if c.kind == "stdio"],
              "fn": [i for i, c in enumerate(cases) if c.kind != "stdio"]}
    for mode, idx in groups.items():
        if not idx and (mode == "fn" or groups["fn"]):
            continue  # a suite with no tests still has its syntax checked (in stdio mode)
        got = _sandboxed(sb, program, mode, [cases[i] for i in idx], suite.fn_name)
        if got is None:
            return Outcome(0, len(cases), "syntax_error")
        for i, reason in zip(idx, got, strict=True):
            results[i] = reason
    passed = sum(r == "passed" for r in results)
    first = next((r for r in results if r != "passed"), "passed")
    return Outcome(passed, len(cases), first)


def _sandboxed(sb: Sandbox, program: str, mode: str, cases: list[TestCase], fn_name: str | None) -> list | None:
    """One sandbox run of `program` over `cases` (all stdio, or all call/expr/assert): a REASON per case, or
    None for a program that does not compile."""
    lim = sb.limits
    payload = {"program": program, "mode": mode, "fn_name": fn_name, "wall_s": lim.wall_s,
               "output_bytes": lim.output_bytes,
               "cases": [c.input for c in cases] if mode == "stdio" else [[c.kind, c.input] for c in cases]}
    data = marshal.dumps(payload)  # host -> harness only: it needs no json (and so no re) to read it
    cap = len(cases) * (6 * lim.output_bytes + 256) + 4096  # JSON escapes a byte as at most 6
    p = popen(sb, launcher_argv(sb, "harness"))
    try:
        out, err, timed_out = _communicate(p, data, time.monotonic() + lim.wall_s + 0.5, cap)
    finally:
        kill(p)
    lines = out.split(b"\n")
    if not lines or lines[0] != b'{"ready": 1}':
        if timed_out:
            return ["timeout"] * len(cases)
        first = next((ln.strip() for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()),
                     f"exit status {p.returncode}")
        raise SandboxUnavailable(f"the sandbox did not start: {first}; {sb.backend.how}")
    reasons: list[str] = []
    for line in lines[1:]:
        if len(reasons) >= len(cases):
            break
        try:  # call/expr/assert lines come from the program's process: anything may be in them
            r = json.loads(line)
        except (ValueError, RecursionError):
            r = None
        if type(r) is not dict:
            break
        if r.get("syntax_error"):
            return None
        if r.get("i") != len(reasons):
            break
        reasons.append(_judge(cases[len(reasons)], r))
    missing = "timeout" if timed_out else "runtime_error"
    return reasons + [missing] * (len(cases) - len(reasons))


def _communicate(p: subprocess.Popen, data: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, bool]:
    """Write data to p's stdin, read its stdout (up to cap bytes) and stderr (64 KiB) until both close or the
    deadline passes; (stdout, stderr, timed out)."""
    out, err = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    assert p.stdin is not None and p.stdout is not None and p.stderr is not None
    sent = 0
    if data:
        sel.register(p.stdin, selectors.EVENT_WRITE)
    else:
        p.stdin.close()
    sel.register(p.stdout, selectors.EVENT_READ)
    sel.register(p.stderr, selectors.EVENT_READ)
    for f in (p.stdin, p.stdout, p.stderr):
        os.set_blocking(f.fileno(), False)
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), bytes(err), True
            for key, _ in sel.select(left):
                f = key.fileobj
                if f is p.stdin:
                    try:
                        sent += os.write(p.stdin.fileno(), data[sent:sent + 65536])
                    except BlockingIOError:
                        continue
                    except OSError:
                        sent = len(data)
                    if sent >= len(data):
                        sel.unregister(p.stdin)
                        p.stdin.close()
                    continue
                try:
                    chunk = os.read(f.fileno(), 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(f)
                    continue
                buf = out if f is p.stdout else err
                if f is p.stdout and len(out) + len(chunk) > cap:
                    out += chunk[:cap - len(out)]
                    return bytes(out), bytes(err), False
                if f is p.stderr and len(err) > 65536:
                    continue
                buf += chunk
    finally:
        sel.close()
    return bytes(out), bytes(err), False


def _judge(case: TestCase, r: dict) -> str:
    err = r.get("error")
    if err is not None:
        return err if err in ("runtime_error", "timeout", "memory") else "wrong_answer"
    if case.kind == "stdio":
        got = r.get("stdout")
        return "passed" if isinstance(got, str) and stdio_equal(got, case.expected) else "wrong_answer"
    if case.kind == "assert":
        return "passed" if r.get("ok") is True else "wrong_answer"
    if "value" not in r:
        return "runtime_error"
    return "passed" if value_equal(r["value"], case.expected) else "wrong_answer"


def _lines(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _float(tok: str) -> float | None:
    try:
        x = float(tok)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def stdio_equal(got: str, expected: object) -> bool:
    """stdout against the expected text (a list of lines is joined)."""
    if isinstance(expected, list):
        expected = "\n".join(map(str, expected))
    expected = "" if expected is None else str(expected)
    if _lines(got) == _lines(expected):
        return True
    a, b = got.split(), expected.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x != y:
            fx, fy = _float(x), _float(y)
            if fx is None or fy is None or not math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-6):
                return False
    return True


def _norm(v: object) -> object:
    return json.loads(json.dumps(v))  # tuples as lists, keys as strings: what a result looks like


def _equal(a: object, b: object) -> bool:
    num = (int, float)
    if isinstance(a, num) and isinstance(b, num):
        if isinstance(a, bool) or isinstance(b, bool):
            return a == b
        return a == b or math.isclose(a, b, rel_tol=1e-6, abs_tol=0.0)
    if type(a) is list and type(b) is list:
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict and type(b) is dict:
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def value_equal(got: object, expected: object) -> bool:
    """A call/expr result (plain JSON data) against the expected value."""
    try:
        expected = _norm(expected)
    except (TypeError, ValueError) as e:
        raise ValueError(f"a test's expected value is not JSON data: {e}") from None
    if _equal(got, expected):
        return True
    return type(expected) is list and len(expected) == 1 and _equal(got, expected[0])
