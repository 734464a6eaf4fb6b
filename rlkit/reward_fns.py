"""Reward components from the user's own functions: `--reward-fn NAME=path/to/file.py:FUNC` (or
`NAME=package.module:FUNC`, or without `NAME=`: named after FUNC) on `rollout` and `score-ref` adds a
`reward/NAME` column beside `reward/verifier` and `reward/rm:*`; `update` sums the components (or
weighs them with `--reward NAME=W`).

A function says what it wants by its parameter names, and whether it takes one row or a batch:

- one row per call: any of `prompt`, `completion`, `answer` (None when the data has none) and `row`
  (a dict of every column of the row: prompt_id, group_id, sample_idx, finish_reason, prompt_ids,
  completion_ids, other rewards ...); it returns a number;
- a batch per call: the same names in the plural, `prompts`, `completions`, `answers`, `rows`; it
  returns a sequence of numbers, one per row, in order (TRL's `def f(completions, **kwargs)` works);
- `**kwargs` receives every column by its own name (values, or lists in the batched form).

Parameters with defaults may have any other name. The signature is checked when the stage starts,
before any sampling; the function runs in the stage's main thread. A value that is not a finite number
(bool, int, float, numpy or torch scalar), a wrong-length batch, or an exception inside the function
stops the stage with one line naming the function and the row, and nothing is written at --out.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from rlkit.errors import RlkitError

ROW_INPUTS = {"prompt": "prompt", "completion": "completion", "answer": "answer", "row": None}
BATCH_INPUTS = {"prompts": "prompt", "completions": "completion", "answers": "answer", "rows": None}
_NAME = re.compile(r"^[A-Za-z0-9_][\w.:-]*$")
CONVENTION = ("name its parameters prompt, completion, answer, row (one row per call, returning a number) or "
              "prompts, completions, answers, rows (a batch per call, returning a list)")


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

    @property
    def needs_all_columns(self) -> bool:
        return self.takes_kwargs or "row" in self.takes or "rows" in self.takes

    def score(self, cols: Mapping[str, Sequence], row0: int = 0) -> list[float]:
        """Rewards for the rows of `cols` (column name -> values; prompt and completion at least), which
        start at row `row0` of the output table (for the messages)."""
        n = len(cols["completion"])
        if n == 0:
            return []
        if self.batched:
            kwargs = self._inputs(cols, None)
            out = self._call(kwargs, f"the batch of rows {row0}-{row0 + n - 1}")
            if isinstance(out, str | bytes) or not hasattr(out, "__len__") or len(out) != n:
                got = f"{len(out)} values" if hasattr(out, "__len__") and not isinstance(out, str | bytes) else repr(out)[:60]
                raise RlkitError(f"--reward-fn {self.name} ({self.label}) returned {got} for the batch of rows "
                                 f"{row0}-{row0 + n - 1}; a batched reward function returns one number per row ({n})")
            values = list(out)
        else:
            values = [self._call(self._inputs(cols, i), _row_label(cols, i, row0)) for i in range(n)]
        return [self._check(v, cols, i, row0) for i, v in enumerate(values)]

    def _inputs(self, cols: Mapping[str, Sequence], i: int | None) -> dict:
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
            elif i is None:
                names = list(cols)
                kw[p] = [dict(zip(names, vals, strict=True)) for vals in zip(*(cols[c] for c in names), strict=True)]
            else:
                kw[p] = {c: cols[c][i] for c in cols}
        if self.takes_kwargs:
            kw.update({c: col(c) for c in cols if c not in kw})
        return kw

    def _call(self, kwargs: dict, where: str):
        from rlkit.user_code import one_line

        try:
            return self.fn(**kwargs)
        except RlkitError:
            raise
        except Exception as e:
            raise RlkitError(f"--reward-fn {self.name} ({self.label}) raised {one_line(e)} on {where}") from e

    def _check(self, value, cols: Mapping[str, Sequence], i: int, row0: int) -> float:
        from rlkit.user_code import as_number

        v = as_number(value)
        if v is None:
            raise RlkitError(f"--reward-fn {self.name} ({self.label}) returned {value!r:.60} for {_row_label(cols, i, row0)}; "
                             "expected a finite number")
        return v


def _row_label(cols: Mapping[str, Sequence], i: int, row0: int) -> str:
    extra = [f"{k} {cols[k][i]!r}" for k in ("prompt_id", "sample_idx") if cols.get(k) is not None]
    return f"row {row0 + i}" + (f" ({', '.join(extra)})" if extra else "")


def load(spec: str) -> RewardFn:
    """`NAME=REF` or `REF` (REF: path/to/file.py:FUNC or package.module:FUNC) -> a checked RewardFn."""
    from rlkit import user_code

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
    return RewardFn(name, label, fn, batched, takes, takes_kwargs, user_code.fingerprint(fn, label))


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
               and p.name not in ROW_INPUTS and p.name not in BATCH_INPUTS]
    if unknown:
        raise RlkitError(f"{where}: rlkit cannot fill its parameter {unknown[0]!r} (signature {sig}); {CONVENTION}")
    if not row and not batch:
        raise RlkitError(f"{where}: its signature {sig} takes none of rlkit's inputs; {CONVENTION}")
    return bool(batch), row or batch, takes_kwargs


def load_all(specs: Iterable[str], taken: Iterable[str] = ()) -> list[RewardFn]:
    """Load every --reward-fn; a name already used by another component (`taken`, e.g. 'verifier' or the
    input table's) or given twice is an error."""
    taken = set(taken)
    out: list[RewardFn] = []
    for spec in specs:
        f = load(spec)
        if f.name in taken or any(g.name == f.name for g in out):
            raise RlkitError(f"--reward-fn {f.name} ({f.label}): there is already a reward component named "
                             f"{f.name!r}; name it differently (--reward-fn OTHER={f.label})")
        out.append(f)
    return out


def fingerprints(fns: Sequence[RewardFn]) -> dict[str, str]:
    """Input fingerprints for a stage's manifest: editing a reward function's file reruns the stage."""
    return {f"reward_fn:{f.name}": f.fingerprint for f in fns}


def columns_of(batch, fns: Sequence[RewardFn]) -> dict[str, list]:
    """The columns of an Arrow record batch that `fns` read, as Python lists."""
    names = batch.schema.names
    if any(f.needs_all_columns for f in fns):
        want = names
    else:
        want = [c for c in ("prompt_id", "sample_idx", "prompt", "completion", "answer") if c in names]
    return {c: batch.column(c).to_pylist() for c in want}
