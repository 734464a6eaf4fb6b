"""Reward components from the user's own functions: `--reward-fn NAME=path/to/file.py:FUNC` (or
`NAME=package.module:FUNC`, or without `NAME=`: named after FUNC) on `rollout` and `score-ref` adds a
`reward/NAME` column beside `reward/verifier` and `reward/rm:*`; `update` sums the components (or
weighs them with `--reward NAME=W`).

A function says what it wants by its parameter names, and whether it takes one row or a batch:

- one row per call: any of `prompt`, `completion`, `answer` (None when the data has none) and `row`
  (a dict of every column of the row: prompt_id, group_id, sample_idx, finish_reason, prompt_ids,
  completion_ids, other rewards ...); it returns a number;
- a batch per call: the same names in the plural, `prompts`, `completions`, `answers`, `rows`; it
  returns a sequence of numbers, one per row, in order (TRL's `def f(completions, **kwargs)` works), and
  `completion_ids` (each row's completion_ids column, as TRL passes its token ids) is one of them; a None in
  the sequence is a row the function does not score (TRL's convention, e.g. another environment's row): 0.0;
- `**kwargs` receives every column by its own name (values, or lists in the batched form);
- TRL's trainer hooks, in either form, by name or in `**kwargs` (TRL passes them to every call): `trainer_state`
  (`PolicyState`: `global_step`, the sampling policy's optimizer steps, the rows' policy_step), `log_metric(name,
  value)` (the stage's closing lines give each name's mean) and `log_extra(column, values)` (accepted; the table's
  columns are fixed when it starts, so the stage names the columns it did not keep). A sandboxed worker gets
  none of them (rows travel as JSON): one that names them without a default is refused there;
- under `rollout --env`, `environment` (one row) or `environments` (a batch; TRL's `reward_funcs(...,
  environments=)`) receives the trajectories' environment instances, as they are when the episode has ended (the
  object a TRL class's adapter wraps: the user's own instance), and `**kwargs` gets `environments` too. They exist
  only while rollout runs: a function that names them is refused by score-ref and by rollout without --env
  (`check_environments`), and runs in the stage even with a sandbox (an instance cannot travel to a worker; the
  stage says so when it starts).

What text `completion` is on a multi-turn row (the final turn, the model's turns or the whole conversation) is the
function's reading (`rlkit.tasks.multi_turn`; `--reads NAME=READING`, default the whole conversation).

Parameters with defaults may have any other name. The signature is checked when the stage starts,
before any sampling; the function runs in the stage's main thread. A value that is not a finite number
(bool, int, float, numpy or torch scalar), a wrong-length batch, an exception inside the function, or a
call that does not return within `--reward-timeout` seconds (default 60, 0: no limit) stops the stage
with one line naming the function and the row, and nothing is written at --out.

With a sandbox (`load_all(..., sandbox=Sandbox(...))`: `--sandbox bwrap|none`) the function runs in worker
processes inside it instead (`rlkit.sandbox.workers`: a verifier may then execute the model's output), with
the same values and the same error lines; `close_all` ends the workers. A function that names `environment(s)`
stays in the stage (above).

`RewardFnScorer` is one function as score-ref's scorer (`reward/NAME`, on its reading of each row).

In the stage (the default), the time limit is a real-time timer (`setitimer(ITIMER_REAL)`) whose SIGALRM raises in the stage's main
thread, so it stops a function looping in Python as well as one asleep or waiting; a call into C code
that never comes back to Python cannot be stopped. rlkit arms the timer around each call only, and sets
its SIGALRM handler only while it scores a batch of rows (the previous one is restored after); code that
uses SIGALRM itself inside the function (e.g. math-verify's own timeouts) cancels the limit for the rest
of that call.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from rlkit.errors import RlkitError
from rlkit.plugins.timer import TimedOut, alarm_handler, timed
from rlkit.scorers.base import Rows, Scorer

if TYPE_CHECKING:
    from rlkit.sandbox import Sandbox
    from rlkit.sandbox.workers import Workers

ROW_INPUTS = {"prompt": "prompt", "completion": "completion", "answer": "answer", "row": None, "environment": None}
BATCH_INPUTS = {"prompts": "prompt", "completions": "completion", "answers": "answer", "rows": None,
                "environments": None, "completion_ids": "completion_ids"}
ENVIRONMENT_INPUTS = ("environment", "environments")  # not columns: the trajectories' instances (rollout --env)
TRAINER_INPUTS = ("trainer_state", "log_metric", "log_extra")  # TRL's trainer hooks: in the stage only
_NAME = re.compile(r"^[A-Za-z0-9_][\w.:-]*$")
DEFAULT_TIMEOUT_S = 60.0  # --reward-timeout: seconds one call may run (0: no limit)
CONVENTION = ("name its parameters prompt, completion, answer, row (one row per call, returning a number) or "
              "prompts, completions, answers, rows (a batch per call, returning a list)")


class PolicyState(NamedTuple):
    """What a function's `trainer_state` (TRL's `TrainerState`) is in rlkit, which has no trainer while it scores:
    `global_step`, the optimizer steps of the policy that sampled the rows (their `policy_step`; 0 without it)."""

    global_step: int


@dataclass(frozen=True)
class RewardFn:
    """A checked user reward function and how to call it."""

    name: str  # the component: column reward/<name>
    label: str  # what messages call it: 'rewards.py:brevity'
    fn: Callable
    batched: bool
    takes: tuple[str, ...]  # the parameters rlkit fills (names from ROW_INPUTS or BATCH_INPUTS)
    takes_kwargs: bool
    fingerprint: str
    timeout: float = DEFAULT_TIMEOUT_S  # seconds per call (0: no limit)
    workers: Workers | None = field(default=None, compare=False, repr=False)  # sandboxed: where the calls run
    unboxed: str | None = None  # the --sandbox it does not run in (it names the environment instances)
    hooks: tuple[str, ...] = ()  # the TRAINER_INPUTS it names
    logged: dict = field(default_factory=dict, compare=False, repr=False)  # log_metric: name -> values
    unkept: dict = field(default_factory=dict, compare=False, repr=False)  # log_extra: the columns not kept

    @property
    def needs_all_columns(self) -> bool:
        return self.takes_kwargs or "row" in self.takes or "rows" in self.takes

    @property
    def takes_environments(self) -> bool:
        """Whether it names `environment(s)`: the trajectories' environment instances (rollout --env only)."""
        return any(p in ENVIRONMENT_INPUTS for p in self.takes)

    @property
    def reads_environments(self) -> bool:
        """Whether it is given the instances under rollout --env: it names them, or takes **kwargs (TRL's way)
        and runs in the stage (a sandboxed worker gets rows as JSON)."""
        return self.takes_environments or (self.takes_kwargs and self.workers is None)

    def score(self, cols: Mapping[str, Sequence], row0: int = 0, environments: Sequence | None = None) -> list[float]:
        """Rewards for the rows of `cols` (column name -> values; prompt and completion at least), which
        start at row `row0` of the output table (for the messages); `environments`: each row's environment
        instance (rollout --env), for a function that reads them."""
        n = len(cols["completion"])
        if n == 0:
            return []
        if self.workers is not None:
            return self._score_sandboxed(cols, row0, n)
        if self.batched:
            kwargs = self._inputs(cols, None, environments)
            with alarm_handler(self.timeout) as limit:
                out = self._call(kwargs, _batch_label(cols, row0, n), limit)
            if isinstance(out, str | bytes) or not hasattr(out, "__len__") or len(out) != n:
                got = f"{len(out)} values" if hasattr(out, "__len__") and not isinstance(out, str | bytes) else repr(out)[:60]
                raise self._bad_length(got, row0, n)
            values = [0.0 if v is None else v for v in out]  # TRL's None: not this function's row (NaN, left out)
        else:
            with alarm_handler(self.timeout) as limit:  # the handler once for these rows, a timer per call
                values = [self._call(self._inputs(cols, i, environments), _row_label(cols, i, row0), limit)
                          for i in range(n)]
        return [self._check(v, cols, i, row0) for i, v in enumerate(values)]

    def _inputs(self, cols: Mapping[str, Sequence], i: int | None, environments: Sequence | None = None) -> dict:
        """Keyword arguments for row i, or for the whole batch when i is None."""
        def col(name: str):
            values = cols.get(name)
            if values is None:
                values = [None] * len(cols["completion"])
            return list(values) if i is None else values[i]

        kw = {}
        inputs = BATCH_INPUTS if self.batched else ROW_INPUTS
        for p in self.takes:
            if inputs[p] is not None:
                kw[p] = col(inputs[p])
            elif p in ENVIRONMENT_INPUTS:
                kw[p] = list(environments or ()) if i is None else (environments or [None] * (i + 1))[i]
            elif i is None:
                names = list(cols)
                kw[p] = [dict(zip(names, vals, strict=True)) for vals in zip(*(cols[c] for c in names), strict=True)]
            else:
                kw[p] = {c: cols[c][i] for c in cols}
        if self.takes_kwargs:
            kw.update({c: col(c) for c in cols if c not in kw})
            if environments is not None:  # TRL's reward functions read kwargs["environments"]
                kw.setdefault("environments", list(environments))
        if self.workers is None:
            for p in TRAINER_INPUTS:
                if p in self.hooks or self.takes_kwargs:
                    kw[p] = self._hook(p, cols, i)
        return kw

    def _hook(self, name: str, cols: Mapping[str, Sequence], i: int | None):
        """TRL's trainer hook `name` for row i (the batch's first row when i is None)."""
        from rlkit.plugins.user_code import as_number

        if name == "trainer_state":
            steps = cols.get("policy_step")
            return PolicyState(int(steps[i or 0]) if steps and steps[i or 0] is not None else 0)
        if name == "log_metric":
            def log_metric(metric: str, value) -> None:
                v = as_number(value)
                if v is not None:
                    self.logged.setdefault(str(metric), []).append(v)
            return log_metric

        def log_extra(column: str, values) -> None:  # noqa: ARG001 (TRL's signature)
            self.unkept[str(column)] = None
        return log_extra

    def _call(self, kwargs: dict, where: str, limit: float = 0):
        """The function's value on `kwargs`, stopped after `limit` seconds (0: no limit; see `rlkit.plugins.timer`)."""
        from rlkit.plugins.user_code import one_line

        try:
            return timed(self.fn, limit, **kwargs)
        except TimedOut as e:
            raise self._timed_out(where) from e
        except RlkitError:
            raise
        except Exception as e:
            raise self._raised(one_line(e), where) from e

    def _check(self, value, cols: Mapping[str, Sequence], i: int, row0: int) -> float:
        from rlkit.plugins.user_code import as_number

        v = as_number(value)
        if v is None:
            raise self._not_a_number(f"{value!r:.60}", cols, i, row0)
        return v

    # the error lines, the same in the stage and in a sandboxed worker
    def _timed_out(self, where: str) -> RlkitError:
        return RlkitError(f"--reward-fn {self.name} ({self.label}) did not return within {self.timeout:g} s on {where}; "
                          "raise --reward-timeout (0: no limit) or fix the function")

    def _raised(self, what: str, where: str) -> RlkitError:
        return RlkitError(f"--reward-fn {self.name} ({self.label}) raised {what} on {where}")

    def _bad_length(self, got: str, row0: int, n: int) -> RlkitError:
        return RlkitError(f"--reward-fn {self.name} ({self.label}) returned {got} for the batch of rows "
                          f"{row0}-{row0 + n - 1}; a batched reward function returns one number per row ({n})")

    def _not_a_number(self, shown: str, cols: Mapping[str, Sequence], i: int, row0: int) -> RlkitError:
        return RlkitError(f"--reward-fn {self.name} ({self.label}) returned {shown:.60} for {_row_label(cols, i, row0)}; "
                          "expected a finite number")

    def _score_sandboxed(self, cols: Mapping[str, Sequence], row0: int, n: int) -> list[float]:
        """`score` through the sandboxed workers: the batch in one request, or one request per row spread over
        the workers; the same values and the same error lines as in the stage."""
        import json

        calls = [(self._inputs(cols, None), n, _batch_label(cols, row0, n))] if self.batched else \
            [(self._inputs(cols, i), None, _row_label(cols, i, row0)) for i in range(n)]

        def unsendable(v):
            raise TypeError(type(v).__name__)

        payloads = []
        for kwargs, size, where in calls:
            try:
                payloads.append(json.dumps({"kwargs": kwargs, "n": size}, default=unsendable).encode() + b"\n")
            except (TypeError, ValueError) as e:
                raise RlkitError(f"--reward-fn {self.name} ({self.label}): {where} holds a value of type {e} that the "
                                 "sandboxed worker cannot receive (rows go to it as JSON)") from None
        values: list = []
        for reply, (_, size, where) in zip(self.workers.run(payloads), calls, strict=True):
            reply = reply or {}
            if "values" in reply and isinstance(reply["values"], list) and len(reply["values"]) == (size or 1):
                values += reply["values"]
            elif "timeout" in reply:
                raise self._timed_out(where)
            elif "error" in reply:
                raise self._raised(reply["error"], where)
            elif "badlen" in reply:
                raise self._bad_length(reply["badlen"], row0, n)
            else:
                died = reply.get("died", "its sandboxed call sent a malformed reply")
                raise RlkitError(f"--reward-fn {self.name} ({self.label}): {died} on {where}")
        if self.batched:  # None (the worker's {"bad": "None"}): not this function's row, as in the stage
            values = [0.0 if v == {"bad": "None"} else v for v in values]
        for i, v in enumerate(values):
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise self._not_a_number(v["bad"] if isinstance(v, dict) and "bad" in v else repr(v), cols, i, row0)
        return [float(v) for v in values]

    def close(self) -> None:
        """Stop the sandboxed workers (nothing without a sandbox)."""
        if self.workers is not None:
            self.workers.close()


def _row_label(cols: Mapping[str, Sequence], i: int, row0: int) -> str:
    extra = [f"{k} {cols[k][i]!r}" for k in ("prompt_id", "sample_idx") if cols.get(k) is not None]
    return f"row {row0 + i}" + (f" ({', '.join(extra)})" if extra else "")


def _batch_label(cols: Mapping[str, Sequence], row0: int, n: int) -> str:
    ids = cols.get("prompt_id")
    return f"the batch of rows {row0}-{row0 + n - 1}" + (f" (prompt_id {ids[0]!r} to {ids[-1]!r})" if ids else "")


def load(spec: str, timeout: float = DEFAULT_TIMEOUT_S, sandbox: Sandbox | None = None) -> RewardFn:
    """`NAME=REF` or `REF` (REF: path/to/file.py:FUNC or package.module:FUNC) -> a checked RewardFn whose
    calls may each run `timeout` seconds (0: no limit), in workers in `sandbox` when one is given (started
    when it first scores; `load_all` starts one at once)."""
    from rlkit.plugins import user_code

    name, eq, ref_text = spec.partition("=")
    if not eq or not _NAME.match(name.strip()):
        name, ref_text = "", spec
    name = name.strip()
    parsed = user_code.parse_ref(ref_text.strip())
    if parsed is None or parsed[1] is not None:
        raise RlkitError(f"--reward-fn {spec!r}: expected NAME=path/to/file.py:FUNC or NAME=package.module:FUNC")
    ref = parsed[0]
    name = name or ref.name
    fn = user_code.load(ref, "function")
    label = str(ref)
    if not callable(fn):
        raise RlkitError(f"--reward-fn {name}: {label} is a {type(fn).__name__}, not a function")
    batched, takes, takes_kwargs = _convention(fn, f"--reward-fn {name} ({label})")
    params = inspect.signature(fn).parameters
    hooks = tuple(p for p in TRAINER_INPUTS if p in params)
    needed = [p for p in hooks if params[p].default is params[p].empty]
    if sandbox is not None and needed and not any(p in ENVIRONMENT_INPUTS for p in takes):
        raise RlkitError(f"--reward-fn {name} ({label}) takes {needed[0]}, which a sandboxed worker cannot receive "
                         f"(rows go to it as JSON); give it a default ({needed[0]}=None) or run it without --sandbox")
    workers = None
    if sandbox is not None and not any(p in ENVIRONMENT_INPUTS for p in takes):  # instances stay in the stage
        from rlkit.sandbox.workers import Workers

        workers = Workers(sandbox, ref, name, label, timeout)
    unboxed = sandbox.backend.name if sandbox is not None and workers is None else None
    return RewardFn(name, label, fn, batched, takes, takes_kwargs, user_code.fingerprint(fn, label), timeout, workers,
                    unboxed, hooks)


def _convention(fn: Callable, where: str) -> tuple[bool, tuple[str, ...], bool]:
    """(batched, the parameters rlkit fills, takes **kwargs) from the signature, or one error line."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise RlkitError(f"{where}: cannot read its signature ({e}); {CONVENTION}") from None
    params = sig.parameters.values()
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    by_name = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    row = tuple(p.name for p in by_name if p.name in ROW_INPUTS)
    batch = tuple(p.name for p in by_name if p.name in BATCH_INPUTS)
    if row and batch:
        raise RlkitError(f"{where}: its parameters mix one row ({', '.join(row)}) and a batch ({', '.join(batch)}); "
                         f"{CONVENTION}")
    unknown = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
               and p.name not in ROW_INPUTS and p.name not in BATCH_INPUTS and p.name not in TRAINER_INPUTS]
    if unknown:
        raise RlkitError(f"{where}: rlkit cannot fill its parameter {unknown[0]!r} (signature {sig}); {CONVENTION}")
    if not row and not batch:
        raise RlkitError(f"{where}: its signature {sig} takes none of rlkit's inputs; {CONVENTION}")
    return bool(batch), row or batch, takes_kwargs


def load_all(specs: Iterable[str], taken: Iterable[str] = (), timeout: float = DEFAULT_TIMEOUT_S,
             sandbox: Sandbox | None = None) -> list[RewardFn]:
    """Load every --reward-fn, each call limited to `timeout` seconds (--reward-timeout, 0: no limit); a
    name already used by another component (`taken`, e.g. 'verifier' or the input table's) or given twice
    is an error. With `sandbox` (--sandbox bwrap|none; None: in the stage, the default) the functions run
    in sandboxed workers (`rlkit.sandbox.workers`): the sandbox is checked and one worker per function
    started (the function imported inside) now, before any sampling; `close_all` stops them."""
    specs = list(specs)
    if not (timeout >= 0 and math.isfinite(timeout)):
        raise RlkitError(f"--reward-timeout {timeout:g} must be a number of seconds >= 0 (0: no limit)")
    taken = set(taken)
    out: list[RewardFn] = []
    try:
        for spec in specs:
            f = load(spec, timeout, sandbox)
            out.append(f)
            if f.name in taken or any(g.name == f.name for g in out[:-1]):
                raise RlkitError(f"--reward-fn {f.name} ({f.label}): there is already a reward component named "
                                 f"{f.name!r}; name it differently (--reward-fn OTHER={f.label})")
        boxed = [f for f in out if f.workers is not None]
        if boxed:
            if not sandbox.backend.isolated:
                from rlkit import console

                console.warn(f"--sandbox none: --reward-fn {', '.join(f.name for f in boxed)} run in worker processes "
                             "with resource limits but no isolation (unsafe for code that executes model output)")
            else:
                sandbox.check()
            for f in boxed:
                f.workers.begin()  # all import at once
            for f in boxed:
                f.workers.start()
    except BaseException:
        close_all(out)
        raise
    return out


def close_all(fns: Iterable[RewardFn]) -> None:
    """Stop the sandboxed workers of `fns` (kill them and everything they started); for the stage's end,
    also after an error. Nothing to do for functions that run in the stage."""
    for f in fns:
        f.close()


@contextmanager
def closing(fns: Sequence[RewardFn], stage: str = "rollout") -> Iterator[Sequence[RewardFn]]:
    """`with closing(load_all(...)) as fns:` the workers are stopped when the block ends, however; when it ends
    well, `stage`'s closing lines give what the functions logged (`say_logged`)."""
    try:
        yield fns
    finally:
        close_all(fns)
    say_logged(fns, stage)


def say_logged(fns: Sequence[RewardFn], stage: str) -> None:
    """One line per function that called TRL's `log_metric` (each name's mean over its calls) or `log_extra` (the
    columns, which a table whose columns are fixed when it starts does not keep)."""
    from rlkit import console

    for f in fns:
        if f.logged:
            console.info(f"{stage}: --reward-fn {f.name} logged " + ", ".join(
                f"{k} {sum(v) / len(v):.4g}" for k, v in f.logged.items()) + " (each the mean over its calls)")
        if f.unkept:
            console.info(f"{stage}: --reward-fn {f.name}'s log_extra columns {', '.join(f.unkept)} are not kept (the "
                         "table's columns are fixed when it starts)")


def fingerprints(fns: Sequence[RewardFn]) -> dict[str, str]:
    """Input fingerprints for a stage's manifest: editing a reward function's file reruns the stage."""
    return {f"reward_fn:{f.name}": f.fingerprint for f in fns}


def check_environments(fns: Sequence[RewardFn], where: str | None) -> None:
    """A function that names `environment(s)` runs only where the instances exist: `where` says why they do not
    (score-ref, rollout without --env; None: they do). One line. Where they exist, a sandbox does not hold the
    function (an instance cannot travel to a worker): it runs in the stage, and a warning says so."""
    for f in fns:
        if f.takes_environments and where is not None:
            raise RlkitError(f"--reward-fn {f.name} ({f.label}) takes the trajectories' environment instances "
                             f"(environment/environments), which exist only while `rollout --env` runs; {where}")
    for f in fns:
        if f.unboxed is not None:
            from rlkit import console

            console.warn(f"--sandbox {f.unboxed}: --reward-fn {f.name} ({f.label}) takes the trajectories' environment "
                         "instances, which cannot travel to a sandboxed worker: it runs in the stage, as your own code "
                         "(it must not execute the model's output)")


def columns_of(batch, fns: Sequence[RewardFn]) -> dict[str, list]:
    """The columns of an Arrow record batch that `fns` read, as Python lists."""
    names = batch.schema.names
    if any(f.needs_all_columns for f in fns):
        want = names
    else:
        named = {BATCH_INPUTS.get(p) for f in fns for p in f.takes}
        if any("trainer_state" in f.hooks for f in fns):
            named.add("policy_step")
        want = [c for c in ("prompt_id", "sample_idx", "prompt", "completion", "answer", "completion_ids",
                            "policy_step") if c in names and (c not in ("completion_ids", "policy_step") or c in named)]
    return {c: batch.column(c).to_pylist() for c in want}


class RewardFnScorer(Scorer):
    """A --reward-fn as score-ref's scorer: `reward/NAME`, the function's value on each row, its `completion` the
    row's text under the function's reading; run on the host (or in its sandboxed workers)."""

    kind = "--reward-fn"

    def __init__(self, fn: RewardFn) -> None:
        self.fn, self.name, self.column, self.said = fn, fn.name, f"reward/{fn.name}", f"{fn.name} ({fn.label})"

    def inputs(self) -> dict[str, str]:
        return fingerprints([self.fn])

    def manifest_entry(self) -> dict:
        return {"reward_fns": {self.fn.name: self.fn.label}}

    def score(self, rows: Rows) -> dict:
        import pyarrow as pa

        from rlkit.tasks import multi_turn

        cols, texts = columns_of(rows.batch, [self.fn]), rows.texts(self.reads)

        def run(keep):
            sub = multi_turn.subset(cols, keep)
            sub["completion"] = [texts[i] for i in keep]
            return self.fn.score(sub, row0=rows.row0)

        return {self.column: pa.array(rows.kept(run), pa.float64())}
