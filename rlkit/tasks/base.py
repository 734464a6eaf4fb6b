"""What every task shares: the example record, the Task protocol, splits, the built-in verifiers, and `TaskBase`, the
base class of the built-in tasks (examples, splits and options)."""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from rlkit.errors import EmptySplit, RlkitError
from rlkit.plugins.extras import library_version  # noqa: F401 (the task vocabulary)
from rlkit.plugins.options import as_bool  # noqa: F401 (the task vocabulary: tasks' boolean options)

SPLITS = ("train", "heldout")
# the generation length (max new tokens) of a task that names none: a user task without a `max_new_tokens`
DEFAULT_MAX_NEW_TOKENS = 16
TRUNCATED = "truncated"  # the verdict of a response cut at max-new-tokens (it never ended with eos)
PASSED = "passed"  # the verdict of full credit (rlkit.sandbox.REASONS), which a cut response keeps
VERBOSE = (  # the prose forms of an answer: SFT targets under `prose=F`, and build-prefs' verbose negatives
    "The total is {}.",
    "Adding the terms one by one gives {}.",
    "Let me add them up carefully: the sum is {}.",
    "Working left to right, the result is {}.",
)
_INT = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Example:
    prompt_id: str
    prompt: str
    answer: str
    split: str


class Transcript(str):
    """An SFT target that is a trajectory: the model's turns and the environment's text between them, in order
    (`turns`: the model's first). It is the text they make together (a `str`: every stage that reads a target as
    text reads it as such), and `sft` trains on the model's turns only: the environment's text (tool results,
    feedback) is context, masked as a rollout's `loss_mask` masks it, each part tokenised on its own as a rollout
    appends it (TRL's assistant-only loss, verl's response mask).

        Transcript.turns("<call>mul(37,48)</call>", "<tool>1776</tool>", "1776")
    """

    parts: tuple[tuple[str, bool], ...]  # (text, written by the model)

    def __new__(cls, parts):
        parts = tuple((str(t), bool(m)) for t, m in parts)
        obj = super().__new__(cls, "".join(t for t, _ in parts))
        obj.parts = parts
        return obj

    @classmethod
    def turns(cls, *texts: str) -> Transcript:
        """Alternating texts: the model's turn, the environment's answer, the model's turn, ..."""
        return cls((t, i % 2 == 0) for i, t in enumerate(texts))


def last_integer(response: str, answer: str) -> float:
    """1.0 if the last integer in the response equals the gold answer's last integer, else 0.0.

    A chain of thought before the answer is fine; the final number decides.
    """
    got, gold = _INT.findall(response), _INT.findall(answer)
    return float(bool(got) and bool(gold) and int(got[-1]) == int(gold[-1]))


VERIFIERS: dict[str, Callable[[str, str], float]] = {"last-integer": last_integer}


@dataclass(frozen=True)
class Scores:
    """A batch of verifier rewards, in row order, and, from a verifier that has them, each row's verdict
    reason (the code task's: passed, wrong_answer, runtime_error, ...)."""

    values: list[float]
    reasons: list[str] | None = None


def verify(task, responses: Sequence[str], answers: Sequence[str], sandbox=None,
           finish_reasons: Sequence[str] | None = None) -> Scores:
    """The task's rewards for a batch of (response, gold answer) rows: through its `score_batch(responses,
    answers, sandbox)` when it has one (the code task runs its programs concurrently, in `sandbox`, an
    `rlkit.sandbox.Sandbox`), else `reward` row by row.

    `finish_reasons` (the engine's, "eos" | "length", one per row): a row cut at max-new-tokens ("length")
    gets the verdict `truncated` in place of the verifier's reason, unless that reason is `passed` (full
    credit: the cut did not matter). Its reward stays the verifier's; a verifier without reasons gives none."""
    batch = getattr(task, "score_batch", None)
    if batch is None:
        return Scores([task.reward(r, a) for r, a in zip(responses, answers, strict=True)])
    scores = batch(list(responses), list(answers), sandbox)
    if finish_reasons is None or scores.reasons is None:
        return scores
    cut = [TRUNCATED if f == "length" and r != PASSED else r
           for r, f in zip(scores.reasons, finish_reasons, strict=True)]
    return Scores(scores.values, cut)


def generation_length(task, given: int | None) -> int:
    """The max new tokens a stage samples with: `given` (--max-new-tokens) when set, else the task's own
    generation length (`task.max_new_tokens`; DEFAULT_MAX_NEW_TOKENS for a task without one)."""
    if given is not None:
        return given
    n = getattr(task, "max_new_tokens", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else DEFAULT_MAX_NEW_TOKENS


def truncation_warning(stage: str, cut: int, n: int, max_new_tokens: int, task=None, share: float = 0.5) -> str | None:
    """One line when more than `share` of `n` responses (`cut` of them) were cut at `max_new_tokens` or the model's
    context (they never ended with eos): their rewards score cut-off text, usually wrong. None otherwise."""
    if not n or cut <= share * n:
        return None
    own = f"; task {task.name}'s own length is {generation_length(task, None)}" if task is not None else ""
    return (f"{stage}: {cut} of {n} responses ({cut / n:.0%}) hit --max-new-tokens {max_new_tokens} (or the "
            f"model's context) before they ended, so their rewards score cut-off text{own}; raise --max-new-tokens")


def heldout_examples(task, n: int, seed: int, stage: str, flag: str) -> list[Example]:
    """The first `n` examples of the task's held-out split; a split that holds fewer (a small data file, a generator
    with few distinct held-out prompts) is taken whole, with one line saying so (`flag`: the option that asked for
    `n`). Every stage that evaluates on a task's held-out split takes it here: one rule for every task."""
    from rlkit import console

    held = list(itertools.islice(task.iter_examples("heldout", seed), n))
    name = getattr(task, "spec", None) or task.name
    if len(held) < n:
        if not held:
            raise RlkitError(f"{stage}: the held-out split of task {name} is empty; nothing to evaluate")
        some = f"{len(held)} example" + ("s" if len(held) > 1 else "")
        console.info(f"{stage}: the held-out split of task {name} holds {some}, fewer than {flag} {n}: "
                     f"evaluating {'all ' * (len(held) > 1)}{some}")
    return held


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def is_heldout(text: str, fraction: float) -> bool:
    """Whether `text` (a prompt, a question) falls in the held-out `fraction` of a stable hash partition."""
    return (_hash(text) % 10_000) < fraction * 10_000


def heldout_keys(keys: Iterable[str], fraction: float) -> set[str]:
    """The held-out keys (prompts, questions) of a data file's `keys`: those `is_heldout` puts there. When that
    leaves one side empty (a small file: 20 problems at heldout 0.1 may all hash into train) and `fraction` of the
    distinct keys, rounded, is at least one and leaves one for train, it is those keys nearest the held-out side of
    the partition instead (the lowest hashes), so a small file has both splits. A file the partition already
    splits is split exactly as `is_heldout` says."""
    distinct = set(keys)
    held = {k for k in distinct if is_heldout(k, fraction)}
    n = int(fraction * len(distinct) + 0.5)
    if 0 < len(held) < len(distinct) or not 0 < n < len(distinct):
        return held
    ranked = sorted((_hash(k) % 10_000, _hash(k), k) for k in distinct)  # the partition's order: held ones first
    return {k for _, _, k in ranked[:n]}


class Task(Protocol):
    """What every stage asks of a task (`get_task` returns one).

    - `name`, `spec`: the task's name and the spec string that rebuilds it (`get_task(t.spec) == t`),
      recorded in manifests;
    - `iter_examples(split, seed, unique)`: Examples of split 'train' or 'heldout', deterministic in
      `seed`; endless for a generator, or as many as the data holds when `unique`; the held-out split
      is always unique and never shares a prompt with train;
    - `examples(split, n, seed, unique)`: the first n of those, exactly (`rollout` streams `iter_examples`
      chunk by chunk instead of building this list, so --num-prompts can be any count);
    - `completion(example)`: the SFT target (the eos token is appended by the tokenization step); a
      `Transcript` when it is a trajectory, so that sft trains on the model's turns only;
    - `reward(response, gold answer)`: the verifier, a finite float (1.0 = correct), never raising on
      a malformed response;
    - `max_new_tokens`: the task's generation length, what eval, rollout, build-prefs and sft's held-out
      eval sample up to when no --max-new-tokens is given (TRL's max_completion_length, verl's
      response_length); a user class may set it, else DEFAULT_MAX_NEW_TOKENS.

    A task may also have `score_batch(responses, answers, sandbox) -> Scores` (a batch at once, with verdict
    reasons; `verify` prefers it) and `runs_code = True` (its verifier runs model-written programs: stages
    check the sandbox before they sample).
    """

    @property
    def name(self) -> str: ...

    @property
    def spec(self) -> str: ...

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]: ...

    def examples(self, split: str, n: int, seed: int, unique: bool = False) -> list[Example]: ...

    def completion(self, ex: Example) -> str: ...

    def reward(self, response: str, answer: str) -> float: ...

    @property
    def max_new_tokens(self) -> int: ...


def shuffled_passes(rows: Sequence, rng, unique: bool) -> Iterator:
    """The rows of a data split in an order shuffled by `rng`: once when `unique`, else pass after pass
    (each reshuffled) without end."""
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for j in order:
            yield rows[j]
        if unique:
            return


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise RlkitError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")


def span(text: str) -> tuple[int, int]:
    """An option's `LO-HI` (or `N`, for N-N) as (lo, hi): `terms=2-4` -> (2, 4); ValueError when not integers."""
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def check(where: str, *rules: tuple[bool, str, str]) -> None:
    """Each rule is (holds, the option as given, what is expected); the first that does not hold is one error line,
    `{where}: {given}: expected {expected}` (e.g. `--task arithmetic: max=0: expected max >= 1`)."""
    for ok, given, expected in rules:
        if not ok:
            raise RlkitError(f"{where}: {given}: expected {expected}")


class TaskBase:
    """What the built-in tasks share (nanochat's `tasks/common.py` is the model): `examples()`, the train/held-out
    split and the options, so that a task file holds its problems and its reward.

    - Options: `OPTIONS` maps each spec key to (the field it sets, or a pair of fields for `span`; its type; how the
      "expected ..." line shows it); `from_options` reads a spec's options through it into the constructor, then
      `checked()` (the task's own rules, through `check`). An unknown key or a value that is not of its type is one
      line naming the task.
    - Splits and examples: `iter_examples` draws a data task's `rows(split)` (its split's problems, each with
      `prompt_id`, `prompt` and `answer`) in passes shuffled by the seed, or a generator's `draws(rng, split, seed)`
      (endless (key, problem) pairs, `problem(rng) -> (prompt, answer)` keyed by the prompt unless a task says
      otherwise), split by the `is_heldout` partition of the key at `heldout_fraction`. Held-out examples are
      always unique, a train stream when asked; a generator whose held-out split runs out of new prompts (many
      draws without one) ends it there: that is the whole split (`heldout_examples`). The draws are seeded by
      `problems_spec` (what decides the prompts), the split and the seed. `examples` is the first n of
      `iter_examples`.
    """

    OPTIONS: ClassVar[dict[str, tuple]] = {}
    NOT_A: ClassVar[dict] = {}  # how a value that does not convert is named, by type ("a number" when not here)
    widen = "widen the task"  # what the line of a generator out of distinct prompts suggests

    @classmethod
    def from_options(cls, opts: dict[str, str]):
        return cls(**cls.option_values(opts)).checked()

    @classmethod
    def option_values(cls, opts: dict[str, str]) -> dict:
        """The spec's options as the constructor's keyword arguments, typed (`OPTIONS`)."""
        kw: dict = {}
        for k, v in opts.items():
            if k not in cls.OPTIONS:
                expected = ", ".join(f"{key}={shown}" for key, (_, _, shown) in cls.OPTIONS.items())
                raise RlkitError(f"unknown option {k!r} for task {cls.name}; expected {expected}")
            attr, kind, _ = cls.OPTIONS[k]
            try:
                value = kind(v)
            except ValueError:
                raise RlkitError(f"--task {cls.name}: {k}={v!r} is not {cls.NOT_A.get(kind, 'a number')}") from None
            kw.update(zip(attr, value, strict=True) if isinstance(attr, tuple) else {attr: value})
        return kw

    def checked(self):
        """The task itself when its options are valid, else one error line (`check`)."""
        return self

    @property
    def problems_spec(self) -> str:
        """What decides the prompts (the spec, less any option that only shapes SFT targets): the draws' seed."""
        return self.spec

    def rows(self, split: str) -> Sequence | None:
        """A data task's problems of `split` (None: a generator, whose problems come from `draws`)."""
        return None

    def draws(self, rng: random.Random, split: str, seed: int) -> Iterator[tuple[str, object]]:  # noqa: ARG002
        """A generator's endless (key, problem) pairs: the key splits and dedupes, `make(problem)` is (prompt,
        answer)."""
        while True:
            problem = self.problem(rng)
            yield problem[0], problem

    def make(self, problem) -> tuple[str, str]:
        """A drawn problem's (prompt, answer)."""
        return problem

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        """Endless examples of `split`, deterministic in `seed`; held-out ones (and, when `unique`, train ones) each
        once: a data split then ends after one pass."""
        check_split(split)
        unique = unique or split == "heldout"
        rng = random.Random(f"{self.problems_spec}|{split}|{seed}")
        rows = self.rows(split)
        if rows is not None:
            if not rows:
                raise EmptySplit(self.empty(split))
            for p in shuffled_passes(rows, rng, unique):
                yield Example(p.prompt_id, p.prompt, p.answer, split)
            return
        want_heldout = split == "heldout"
        seen: set[str] = set()
        misses = i = 0
        for key, problem in self.draws(rng, split, seed):
            if is_heldout(key, self.heldout_fraction) != want_heldout or (unique and key in seen):
                misses += 1
                if misses > 10_000 + 200 * i:
                    if want_heldout and i:  # the held-out split is whole: a stage asking more takes all of it
                        return
                    raise RlkitError(self.exhausted(split, i))
                continue
            if unique:  # only a unique stream remembers its prompts: an endless one stays flat in memory
                seen.add(key)
            prompt, answer = self.make(problem)
            yield Example(f"{split}-{seed}-{i}", prompt, answer, split)
            i += 1

    def examples(self, split: str, n: int, seed: int, unique: bool = False) -> list[Example]:
        return list(itertools.islice(self.iter_examples(split, seed, unique), n))

    def exhausted(self, split: str, i: int) -> str:
        """The line of a generator that found no new prompt of `split` in many draws, after `i`."""
        return (f"task {self.spec}: ran out of distinct {split} prompts after {i} (problem space "
                f"{self.problem_space()}); ask for fewer or {self.widen}")

    def empty(self, split: str) -> str:
        """The line of a data task whose `split` holds no problem."""
        return f"task {self.spec}: the {split} split is empty"


@dataclass(frozen=True)
class Problem:
    """A data task's problem: its id, prompt, gold answer (the verifier's) and reference solution (SFT's)."""

    prompt_id: str
    prompt: str
    answer: str
    solution: str | None
