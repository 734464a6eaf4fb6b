"""The `code` task: the response is a Python program, the reward is whether it passes the problem's unit
tests, run in a sandbox (`rlkit.sandbox`: bubblewrap namespaces plus resource limits).

Spec: `code[:data=FILE,question=COL,tests=COL,solution=COL,heldout=F,reward=all|fraction,timeout=S,memory=MB,
ops=LO-HI,max=N]`.

Problems
- Without `data`: a generated task the embedded tiny model can learn, one-line functions over integers.
  The prompt lists a chain of operations, `# f(x): +3, *2, -1`, and the program that passes is
  `def f(x): return (x+3)*2-1` (parenthesised as Python needs it); `ops` (default 2-3) is the chain's length
  range and `max` (default 9) the largest constant. Its tests call `f` on seven integers.
- `data=FILE` (.jsonl/.parquet/.arrow, or a datasets spec `NAME[:CONFIG][@SPLIT]`) in the layout of the
  public code-RL sets; `data=sample` is the ~20 problems shipped in `rlkit/tasks/data_files/code_sample.jsonl`.
  `question` names the statement column (default `question`), `tests` the tests column (default
  `input_output` when the data has it, else `tests`), `solution` a column of reference programs for SFT
  (default `solutions` when present: APPS's JSON list, the first one is used). A `starter_code` column,
  when present, is shown under the statement. `heldout` (default 0.1) is the held-out share, a hash partition of
  the statements (`rlkit.tasks.base.heldout_keys`: a small file gets problems on both sides).

Tests (the gold answer of an example is its tests, as text; `parse_tests` reads every form below)
- APPS / TACO / DeepCoder `input_output`: JSON `{"inputs": [...], "outputs": [...]}` of stdin/stdout pairs
  (outputs given as text or as a list of lines), or with `"fn_name"`: each input an argument list, each
  output the return value (APPS wraps it in a list: `[v]` matches `v`).
- A list of `{"input": ..., "output": ...}` stdin/stdout pairs.
- Assertions (MBPP / HumanEval style): a JSON or Python list of `assert ...` strings, or the statements as
  text. `assert EXPR == LITERAL` is split: EXPR runs in the sandbox, the literal stays outside and the two
  are compared there, so a program never sees an expected value; any other assertion runs whole inside.

Reward and extraction
- The program is the last fenced code block of the response (```` ```python ... ``` ```` or a bare ```` ``` ````
  fence; an opened fence the response never closes counts to the end), else the whole response.
- `reward=all` (default): 1.0 when every test passes, else 0.0; `reward=fraction`: the fraction passed.
- Each verdict has a reason (`rlkit.sandbox.REASONS`: passed, wrong_answer, runtime_error, syntax_error,
  timeout, memory); `rollout` writes it as the `verdict/verifier` column and counts it. `timeout` (seconds
  per program, all its tests; default 10) and `memory` (MB of address space, default 1024) are the
  sandbox limits, part of the task's identity because they decide rewards.
- A response cut at max-new-tokens (it never ended) has the verdict `truncated` instead, unless it passed.
  The task's generation length (`max_new_tokens`, what a stage samples up to without --max-new-tokens) is 40
  tokens for the generated task, 512 with `data`.
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from rlkit.errors import RlkitError
from rlkit.tasks.base import Example, Problem, Scores, TaskBase, check, heldout_keys, span

if TYPE_CHECKING:
    from rlkit.sandbox import Sandbox
    from rlkit.sandbox.programs import TestSuite

SAMPLE = Path(__file__).parent / "data_files" / "code_sample.jsonl"
INSTRUCTION = {
    "stdio": "Write a Python 3 program that reads standard input and prints the answer to standard output.",
    "call": "Write a Python 3 function `{fn}` that returns the answer.",
    "assert": "Write Python 3 code that passes the tests.",
}
PROMPT = "{instruction} Give the program in one ```python code block.\n\n{question}\n"
_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.S)
_OPEN_FENCE = re.compile(r"```[^\n`]*\n")
OPS = ("+", "-", "*")
TEST_XS = (0, 1, 2, 3, 5, -4, 10)  # the synthetic task's test inputs


def extract_program(response: str) -> str:
    """The program in a response: the last closed ```` ``` ```` block's content, else what follows an opened
    fence that is never closed (a response cut at its token limit), else the whole response."""
    blocks = _FENCE.findall(response)
    if blocks:
        return blocks[-1]
    opened = list(_OPEN_FENCE.finditer(response))
    if opened:
        return response[opened[-1].end():]
    return response


# ---------------------------------------------------------------------------------------------
# Tests: the forms of the public data sets -> rlkit.sandbox.programs.TestSuite


def _literal(text: str):
    """JSON first, then a Python literal (a list column read as text is its repr); None when neither."""
    try:
        return json.loads(text)
    except (ValueError, TypeError):
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def _as_text(v) -> str:
    """A stdin/stdout value as text: a list of lines joined by newlines."""
    return "\n".join(map(str, v)) if isinstance(v, list) else str(v)


def _jsonable(v):
    """v as a JSON value (tuples as lists), or raise ValueError for anything JSON cannot carry."""
    return json.loads(json.dumps(v))


def _assert_cases(statements: Sequence[str]):
    from rlkit.sandbox.programs import TestCase

    cases = []
    for s in statements:
        try:
            tree = ast.parse(s.strip())
        except SyntaxError:
            raise ValueError(f"the test {s[:60]!r} is not Python") from None
        for node in tree.body:
            if not isinstance(node, ast.Assert):
                raise ValueError(f"the test {s[:60]!r} is not an assert statement")
            src = ast.get_source_segment(s.strip(), node) or ast.unparse(node)
            t = node.test
            if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
                try:
                    expected = _jsonable(ast.literal_eval(t.comparators[0]))
                except (ValueError, TypeError, SyntaxError, RecursionError):
                    expected = None
                else:
                    cases.append(TestCase("expr", ast.unparse(t.left), expected))
                    continue
            cases.append(TestCase("assert", src))
    return cases


def parse_tests(text: str) -> TestSuite:
    """A problem's tests (see the module docstring for the forms) -> TestSuite; ValueError naming what is
    wrong when `text` is none of them."""
    from rlkit.sandbox.programs import TestCase, TestSuite

    value = _literal(text) if isinstance(text, str) else text
    if value is None and isinstance(text, str) and "assert" in text:
        value = text
    if isinstance(value, dict) and "inputs" in value and "outputs" in value:
        ins, outs = value["inputs"], value["outputs"]
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs) or not ins:
            raise ValueError("inputs and outputs must be lists of the same non-zero length")
        fn = value.get("fn_name")
        if fn:
            if not isinstance(fn, str) or not fn.isidentifier():
                raise ValueError(f"fn_name {fn!r} is not a Python name")
            cases = tuple(TestCase("call", _jsonable(a if isinstance(a, list) else [a]), _jsonable(o))
                          for a, o in zip(ins, outs, strict=True))
            return TestSuite(cases, fn)
        return TestSuite(tuple(TestCase("stdio", _as_text(a), _as_text(o)) for a, o in zip(ins, outs, strict=True)))
    if isinstance(value, list) and value and all(isinstance(v, dict) and "input" in v and "output" in v for v in value):
        if any(str(v.get("testtype", "stdin")).startswith("func") for v in value):
            raise ValueError("functional tests in a list need a fn_name; use the input_output form with fn_name")
        return TestSuite(tuple(TestCase("stdio", _as_text(v["input"]), _as_text(v["output"])) for v in value))
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return TestSuite(tuple(_assert_cases(value)))
    if isinstance(value, str) and value.strip():
        return TestSuite(tuple(_assert_cases([value])))
    raise ValueError("expected APPS-style JSON {\"inputs\": [...], \"outputs\": [...]} (with fn_name for function "
                     "tests), a list of {\"input\", \"output\"} pairs, or assert statements")


def _suite_kind(suite: TestSuite) -> str:
    kinds = {c.kind for c in suite.cases}
    return "stdio" if kinds == {"stdio"} else "call" if suite.fn_name else "assert"


# ---------------------------------------------------------------------------------------------
# The generated task


def _chain(rng: random.Random, lo: int, hi: int, top: int) -> list[tuple[str, int]]:
    return [(rng.choice(OPS), rng.randint(1, top)) for _ in range(rng.randint(lo, hi))]


def chain_program(chain: Sequence[tuple[str, int]]) -> str:
    """The one-line program of an operation chain: [('+', 3), ('*', 2), ('-', 1)] -> 'def f(x): return (x+3)*2-1'."""
    e = "x"
    for op, k in chain:
        e = f"({e}){op}{k}" if op == "*" and any(c in e for c in "+-") else f"{e}{op}{k}"
    return f"def f(x): return {e}"


def _chain_value(chain: Sequence[tuple[str, int]], x: int) -> int:
    for op, k in chain:
        x = x + k if op == "+" else x - k if op == "-" else x * k
    return x


@dataclass(frozen=True)
class Code(TaskBase):
    """Programs verified by unit tests in a sandbox; see the module docstring for the options."""

    name = "code"
    runs_code = True  # stages check the sandbox before any sampling
    widen = "widen the task (ops=, max=)"

    data: str | None = None  # None: generated; "sample": the shipped problems
    question: str = "question"
    tests: str | None = None  # None: input_output when the data has it, else tests
    solution: str | None = None  # None: solutions when the data has it
    heldout_fraction: float = 0.1
    reward_mode: str = "all"
    timeout_s: float = 10.0
    memory_mb: int = 1024
    min_ops: int = 2
    max_ops: int = 3
    max_constant: int = 9
    OPTIONS = {"data": ("data", str, "FILE|sample"), "question": ("question", str, "COL"),
               "tests": ("tests", str, "COL"), "solution": ("solution", str, "COL"),
               "heldout": ("heldout_fraction", float, "F"), "reward": ("reward_mode", str, "all|fraction"),
               "timeout": ("timeout_s", float, "S"), "memory": ("memory_mb", int, "MB"),
               "ops": (("min_ops", "max_ops"), span, "LO-HI"), "max": ("max_constant", int, "N")}

    def checked(self) -> Code:
        check("--task code",
              (0 < self.heldout_fraction < 1, f"heldout={self.heldout_fraction:g}", "0 < heldout < 1"),
              (self.reward_mode in ("all", "fraction"), f"reward={self.reward_mode}", "all or fraction"),
              (0 < self.timeout_s <= 3600, f"timeout={self.timeout_s:g}", "0 < seconds <= 3600"),
              (self.memory_mb >= 64, f"memory={self.memory_mb}", "at least 64 (MB)"),
              (1 <= self.min_ops <= self.max_ops <= 8, f"ops={self.min_ops}-{self.max_ops}", "1 <= LO <= HI <= 8"),
              (self.max_constant >= 1, f"max={self.max_constant}", "max >= 1"),
              (self.data != "-", "data=-", "a file or datasets spec, not stdin"))
        return self

    @property
    def spec(self) -> str:
        opts = ([f"data={self.data}", f"question={self.question}", *([f"tests={self.tests}"] if self.tests else []),
                 *([f"solution={self.solution}"] if self.solution else [])] if self.data else
                [f"ops={self.min_ops}-{self.max_ops}", f"max={self.max_constant}"])
        opts += [f"heldout={self.heldout_fraction}", f"reward={self.reward_mode}", f"timeout={self.timeout_s:g}",
                 f"memory={self.memory_mb}"]
        return "code:" + ",".join(opts)

    @property
    def max_new_tokens(self) -> int:
        """The task's generation length: 40 tokens for the generated task (its longest program is 28
        characters), 512 with `data` (APPS-style programs)."""
        return 40 if self.data is None else 512

    @property
    def fingerprint(self) -> str:
        """The data's identity: a changed file reruns every stage that used it (nothing for the generated task)."""
        return self._loaded[1] if self.data else ""

    # -- the sandbox ---------------------------------------------------------------------------

    def limits(self):
        from rlkit.sandbox import Limits

        return Limits(wall_s=self.timeout_s, cpu_s=max(1, int(self.timeout_s + 0.999)), memory_mb=self.memory_mb)

    def score_batch(self, responses: Sequence[str], answers: Sequence[str], sandbox: Sandbox | None = None) -> Scores:
        """Rewards and verdict reasons of `responses`, each run against its row's tests (`answers`) in its own
        sandbox, `sandbox.workers` at a time; in row order."""
        from dataclasses import replace

        from rlkit.sandbox import Sandbox
        from rlkit.sandbox.programs import run_programs

        sb = replace(sandbox or Sandbox(), limits=self.limits())
        jobs = [(extract_program(r), self._suite(a)) for r, a in zip(responses, answers, strict=True)]
        outcomes = run_programs(sb, jobs)
        if self.reward_mode == "all":
            values = [float(o.total > 0 and o.passed == o.total) for o in outcomes]
        else:
            values = [o.passed / o.total if o.total else 0.0 for o in outcomes]
        return Scores(values, [o.reason for o in outcomes])

    def reward(self, response: str, answer: str) -> float:
        return self.score_batch([response], [answer]).values[0]

    def _suite(self, answer: str) -> TestSuite:
        cached = self._suites.get(answer)
        if cached is None:
            try:
                cached = parse_tests(answer)
            except ValueError as e:
                raise RlkitError(f"task code: the gold answer {answer[:80]!r} is not a test set: {e}") from None
            if len(self._suites) > 65536:
                self._suites.clear()
            self._suites[answer] = cached
        return cached

    @cached_property
    def _suites(self) -> dict:
        return {}

    # -- examples ------------------------------------------------------------------------------

    def problem(self, rng: random.Random) -> tuple[str, str]:
        """A generated problem: (prompt, tests)."""
        chain = _chain(rng, self.min_ops, self.max_ops, self.max_constant)
        prompt = "# f(x): " + ", ".join(f"{op}{k}" for op, k in chain) + "\n"
        tests = json.dumps({"fn_name": "f", "inputs": [[x] for x in TEST_XS],
                            "outputs": [_chain_value(chain, x) for x in TEST_XS]})
        return prompt, tests

    def problem_space(self) -> int:
        per = len(OPS) * self.max_constant
        return sum(per ** k for k in range(self.min_ops, self.max_ops + 1))

    def rows(self, split: str) -> list[Problem] | None:
        """From data: the split's problems (shuffled by the seed, each once when unique, always for heldout, else
        pass after pass without end); generated: None (endless problems, held-out ones unique)."""
        return self._splits[split] if self.data else None

    def empty(self, split: str) -> str:
        return (f"task {self.spec}: the {split} split is empty ({len(self._loaded[0])} problems); use more data or "
                "another heldout fraction")

    def completion(self, ex: Example) -> str:
        """The SFT target: the generated task's one-line program (bare, as the tiny model writes it), a data
        problem's reference solution in a ```python block."""
        if not self.data:
            return self._solution_of_prompt(ex.prompt)
        sol = self._solutions.get(ex.prompt)
        if not sol:
            raise RlkitError(f"task {self.spec}: no reference solution for {ex.prompt_id!r} to train on; pass "
                             "solution=COL (a column of programs) or train sft on a data file (--data)")
        return f"```python\n{sol.strip()}\n```"

    def _solution_of_prompt(self, prompt: str) -> str:
        head = prompt.removeprefix("# f(x): ").strip()
        try:
            chain = [(part[0], int(part[1:])) for part in head.split(", ")]
        except (ValueError, IndexError):
            raise RlkitError(f"task {self.spec}: {prompt[:60]!r} is not one of its prompts") from None
        return chain_program(chain)

    # -- data ----------------------------------------------------------------------------------

    @cached_property
    def _loaded(self) -> tuple[list[Problem], str]:
        return self._read(str(SAMPLE) if self.data == "sample" else self.data)

    @cached_property
    def _splits(self) -> dict[str, list[Problem]]:
        rows = self._loaded[0]
        key = lambda p: " ".join(p.prompt.split())  # noqa: E731
        held_keys = heldout_keys(map(key, rows), self.heldout_fraction)
        train = [p for p in rows if key(p) not in held_keys]
        seen: set[str] = set()
        held = [p for p in rows if key(p) in held_keys and not (key(p) in seen or seen.add(key(p)))]
        return {"train": train, "heldout": held}

    @cached_property
    def _solutions(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for p in self._loaded[0]:
            if p.solution:
                out.setdefault(p.prompt, p.solution)
        return out

    def _read(self, source: str) -> tuple[list[Problem], str]:
        from rlkit import console
        from rlkit.io import data

        src = data.load_source(source, "prompts", {"prompt": self.question})
        t = src.table
        if src.chat:
            raise RlkitError(f"{source}: task code reads a statement column ({self.question!r}), not chat messages; "
                             "pass question=COL")
        names = t.column_names
        tests_col = self.tests or ("input_output" if "input_output" in names else "tests")
        sol_col = self.solution or ("solutions" if "solutions" in names else None)
        for col, opt in ((tests_col, "tests"), (sol_col, "solution")):
            if col is not None and col not in names:
                raise RlkitError(f"{source}: no column {col!r} for task code (columns: {', '.join(src.columns)}); "
                                 f"pass {opt}=COL")
        starters = t.column("starter_code").to_pylist() if "starter_code" in t.column_names else [None] * t.num_rows
        sols = t.column(sol_col).to_pylist() if sol_col else [None] * t.num_rows
        out, skipped = [], 0
        for pid, q, a, start, sol in zip(t.column("prompt_id").to_pylist(), t.column("prompt").to_pylist(),
                                         t.column(tests_col).to_pylist(), starters, sols, strict=True):
            if a is not None and not isinstance(a, str):  # a nested column (list of asserts, input_output object)
                a = json.dumps(a)
            try:
                suite = parse_tests(a) if isinstance(a, str) else None
            except ValueError:
                suite = None
            if suite is None or not isinstance(q, str) or not q.strip():
                skipped += 1
                continue
            kind = _suite_kind(suite)
            question = q.strip() + (f"\n\n```python\n{start.rstrip()}\n```" if isinstance(start, str) and start.strip()
                                    else "")
            prompt = PROMPT.format(instruction=INSTRUCTION[kind].format(fn=suite.fn_name), question=question)
            out.append(Problem(pid, prompt, a, _first_solution(sol)))
        if skipped:
            console.warn(f"{source}: {skipped} rows without a statement or readable tests were left out")
        if not out:
            raise RlkitError(f"{source}: no usable rows for task code (need a {self.question!r} statement and "
                             f"{tests_col!r} tests)")
        return out, src.fingerprint


def _first_solution(value) -> str | None:
    """APPS's `solutions` (a JSON list of programs) -> the first; a plain program -> itself."""
    if isinstance(value, list):
        return next((v for v in value if isinstance(v, str) and v.strip()), None)
    if not isinstance(value, str) or not value.strip():
        return None
    if value.lstrip().startswith("["):
        parsed = _literal(value)
        if isinstance(parsed, list):
            return _first_solution(parsed)
    return value
