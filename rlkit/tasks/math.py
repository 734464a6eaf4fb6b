"""The `math` task: word problems from a data file (GSM8K-style and MATH-style answers), verified with
math-verify.

Spec: `math[:data=FILE,question=COL,answer=COL,solution=COL,test=FILE,verifier=NAME,heldout=F]`.
`data` is a .jsonl/.parquet/.arrow file or a `datasets` spec `NAME[:CONFIG][@SPLIT]`, read with
`rlkit.io.data`'s reader (default: the ~50 grade-school problems shipped in `rlkit/tasks/data_files/`).
`question` and `answer` name its columns (default `question`, `answer`). An answer may be GSM8K's
"reasoning ... #### 42", a solution ending in `\\boxed{...}`, or a bare answer; the gold answer is what
follows the last `####`, else the content of the last `\\boxed{}`, else the whole text. The SFT target
is the `solution` column when given, else the answer text (GSM8K's calculator annotations `<<..>>`
removed), so a model learns to reason and end in the same format.

Held-out questions are a stable hash partition of the question text (`heldout`, default 0.1), or,
with `test=FILE`, that whole file (its questions are then removed from train): a held-out question is
never trained on. Verifiers: `math-verify` (default; LaTeX, fractions, equivalent forms, via
`math_verify.parse/verify` with a timeout; imported on first use) and `last-integer` (the last integer
of the response; cheap, for integer answers). Both return 0.0 for garbage and never raise.

Generation length (`max_new_tokens`, what a stage samples up to without --max-new-tokens): 96 tokens on
the shipped sample, 256 with `data`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from rlkit.errors import RlkitError
from rlkit.tasks.base import Example, Problem, TaskBase, is_heldout, last_integer

SAMPLE = Path(__file__).parent / "data_files" / "math_sample.jsonl"
PROMPT = "Question: {question}\nAnswer:"  # the completion starts with a space
VERIFY_TIMEOUT_S = 1  # per parse and per comparison (math-verify's signal alarm: whole seconds)
RESPONSE_TAIL = 4000  # characters of a response the verifier reads: the final answer is at its end
_ANNOTATION = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations, e.g. <<48/2=24>>
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # unbalanced: no answer


def extract_answer(text: str) -> str:
    """The final answer of a gold answer or solution: GSM8K's `... #### 42` -> '42', a solution with
    `\\boxed{\\frac{3}{4}}` -> '\\frac{3}{4}', a bare '42' -> '42' (thousands separators dropped)."""
    if "####" in text:
        ans = text.rsplit("####", 1)[1].strip()
    else:
        boxed = last_boxed(text)
        ans = boxed if boxed is not None else text.strip()
    return _THOUSANDS.sub("", ans)


def solution_text(text: str) -> str:
    """A solution as an SFT target: GSM8K's calculator annotations removed, whitespace kept."""
    return _ANNOTATION.sub("", text).strip()


@functools.cache
def _math_verify():
    """math-verify's (parse, verify), imported on first use (it pulls in sympy), its logging quieted."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # timeouts are answered 0.0, not logged
    return parse, verify


def _timeout() -> int | None:
    """math-verify's timeout uses SIGALRM, which only the main thread may set: elsewhere, none."""
    import threading

    return VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=8192)
def _parse_gold(gold: str) -> tuple:
    parse, _ = _math_verify()
    return tuple(parse(f"\\boxed{{{gold}}}", parsing_timeout=_timeout()) or parse(gold, parsing_timeout=_timeout()))


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals the gold answer under math-verify (LaTeX, fractions,
    decimals, equivalent expressions), else 0.0; 0.0 for anything unparsable, on a timeout, or on error.

    The response's answer is what follows its last `####` when it has one, else what math-verify finds
    (the last `\\boxed{}`, 'the answer is ...', the last expression)."""
    try:
        gold = _parse_gold(extract_answer(answer))
        if not gold:
            return 0.0
        parse, verify = _math_verify()
        text = response[-RESPONSE_TAIL:]
        if "####" in text:
            tail = text.rsplit("####", 1)[1].strip()
            pred = parse(f"\\boxed{{{tail}}}", parsing_timeout=_timeout()) or parse(tail, parsing_timeout=_timeout())
        else:
            pred = parse(text, parsing_timeout=_timeout())
        return float(bool(pred) and verify(list(gold), pred, timeout_seconds=_timeout()))
    except Exception:  # math-verify's own TimeoutException included: garbage scores 0, never stops a run
        return 0.0


def last_integer_reward(response: str, answer: str) -> float:
    """`last-integer` on the response and the extracted gold answer, thousands separators dropped."""
    return last_integer(_THOUSANDS.sub("", response), extract_answer(answer))


VERIFIERS: dict[str, Callable[[str, str], float]] = {"math-verify": math_verify_reward,
                                                     "last-integer": last_integer_reward}


def _float_or_text(v: str) -> float | str:
    """`heldout`'s value: a float when it reads as one, else its text (`from_options` then names it)."""
    try:
        return float(v)
    except ValueError:
        return v


@dataclass(frozen=True)
class Math(TaskBase):
    """Word problems from a data file; see the module docstring for the options."""

    name = "math"

    data: str | None = None  # None: the shipped sample
    question: str = "question"
    answer: str = "answer"
    solution: str | None = None
    test: str | None = None
    verifier: str = "math-verify"
    heldout_fraction: float = 0.1
    OPTIONS = {"data": ("data", str, "FILE"), "question": ("question", str, "COL"), "answer": ("answer", str, "COL"),
               "solution": ("solution", str, "COL"), "test": ("test", str, "FILE"),
               "verifier": ("verifier", str, "math-verify|last-integer"),
               "heldout": ("heldout_fraction", _float_or_text, "F")}

    @classmethod
    def from_options(cls, opts: dict[str, str]) -> Math:
        t = cls(**cls.option_values(opts))
        if t.verifier not in VERIFIERS:
            raise RlkitError(f"task math: unknown verifier {t.verifier!r}; expected one of {', '.join(VERIFIERS)}")
        if not isinstance(t.heldout_fraction, float) or not 0 < t.heldout_fraction < 1:
            raise RlkitError(f"task math: heldout={opts.get('heldout')!r} must be a fraction between 0 and 1")
        if "-" in (t.data, t.test):
            raise RlkitError("task math: data and test are files or datasets specs, not stdin ('-')")
        return t

    @property
    def spec(self) -> str:
        opts = [*([f"data={self.data}"] if self.data else []), *([f"test={self.test}"] if self.test else []),
                f"question={self.question}", f"answer={self.answer}",
                *([f"solution={self.solution}"] if self.solution else []), f"verifier={self.verifier}",
                f"heldout={self.heldout_fraction}"]
        return "math:" + ",".join(opts)

    @property
    def max_new_tokens(self) -> int:
        """The task's generation length: 96 tokens on the shipped sample (its longest solution is about 100
        characters), 256 on a data file (GSM8K-style reasoning ends well within it)."""
        return 96 if self.data is None else 256

    @property
    def fingerprint(self) -> str:
        """The data's identity (and the test file's): a changed file reruns every stage that used it."""
        return "+".join(fp for fp in (self._loaded[1], self._loaded[3]) if fp)

    @cached_property
    def _loaded(self) -> tuple[list[Problem], str, list[Problem] | None, str]:
        main, fp = self._read(self.data or str(SAMPLE))
        test, test_fp = self._read(self.test) if self.test else (None, "")
        return main, fp, test, test_fp

    @cached_property
    def _splits(self) -> dict[str, list[Problem]]:
        main, _, test, _ = self._loaded
        if test is not None:
            held_keys = {_key(p) for p in test}
            train = [p for p in main if _key(p) not in held_keys]
            held = test
        else:
            train = [p for p in main if not is_heldout(_key(p), self.heldout_fraction)]
            held = [p for p in main if is_heldout(_key(p), self.heldout_fraction)]
        seen: set[str] = set()
        held = [p for p in held if not (_key(p) in seen or seen.add(_key(p)))]  # held-out questions once each
        return {"train": train, "heldout": held}

    @cached_property
    def _solutions(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for p in self._loaded[0]:
            out.setdefault(p.prompt, p.solution)
        return out

    def _read(self, source: str) -> tuple[list[Problem], str]:
        from rlkit import console
        from rlkit.io import data

        src = data.load_source(source, "prompts", {"prompt": self.question, "answer": self.answer})
        t = src.table
        if src.chat:
            raise RlkitError(f"{source}: task math reads a question column ({self.question!r}), not chat messages; "
                             "pass question=COL")
        for col in ("answer", *([self.solution] if self.solution else [])):
            if col not in t.column_names:
                raise RlkitError(f"{source}: no column {col!r} for task math (columns: {', '.join(src.columns)}); "
                                 "pass answer=COL (and solution=COL)")
        sols = t.column(self.solution).to_pylist() if self.solution else t.column("answer").to_pylist()
        out, skipped = [], 0
        for pid, q, a, s in zip(t.column("prompt_id").to_pylist(), t.column("prompt").to_pylist(),
                                t.column("answer").to_pylist(), sols, strict=True):
            gold = extract_answer(a) if isinstance(a, str) else ""
            if not isinstance(q, str) or not q.strip() or not gold:
                skipped += 1
                continue
            out.append(Problem(pid, PROMPT.format(question=q.strip()), gold, solution_text(str(s or a))))
        if skipped:
            console.warn(f"{source}: {skipped} rows without a question or a final answer were left out")
        if not out:
            raise RlkitError(f"{source}: no usable rows for task math (need a question and an answer)")
        return out, src.fingerprint

    def rows(self, split: str) -> list[Problem]:
        """The split's problems, shuffled by the seed: each once when unique (always for heldout), else reshuffled
        pass after pass without end."""
        return self._splits[split]

    def empty(self, split: str) -> str:
        return (f"task {self.spec}: the {split} split is empty ({len(self._loaded[0])} questions); use more data, "
                "another heldout fraction, or test=FILE")

    def completion(self, ex: Example) -> str:
        """The solution (reasoning ending in the answer) after a space, or the bare answer."""
        return " " + self._solutions.get(ex.prompt, ex.answer)

    def reward(self, response: str, answer: str) -> float:
        return VERIFIERS[self.verifier](response, answer)


def _key(p: Problem) -> str:
    return " ".join(p.prompt.split())
