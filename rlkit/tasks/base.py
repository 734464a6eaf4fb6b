"""What every task shares: the example record, the Task protocol, splits and the built-in verifiers."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from rlkit.errors import RlkitError

SPLITS = ("train", "heldout")
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


def verify(task, responses: Sequence[str], answers: Sequence[str], sandbox=None) -> Scores:
    """The task's rewards for a batch of (response, gold answer) rows: through its `score_batch(responses,
    answers, sandbox)` when it has one (the code task runs its programs concurrently, in `sandbox`, an
    `rlkit.sandbox.Sandbox`), else `reward` row by row."""
    batch = getattr(task, "score_batch", None)
    if batch is not None:
        return batch(list(responses), list(answers), sandbox)
    return Scores([task.reward(r, a) for r, a in zip(responses, answers, strict=True)])


def is_heldout(text: str, fraction: float) -> bool:
    """Whether `text` (a prompt, a question) falls in the held-out `fraction` of a stable hash partition."""
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return (h % 10_000) < fraction * 10_000


class Task(Protocol):
    """What every stage asks of a task (`get_task` returns one).

    - `name`, `spec`: the task's name and the spec string that rebuilds it (`get_task(t.spec) == t`),
      recorded in manifests;
    - `iter_examples(split, seed, unique)`: Examples of split 'train' or 'heldout', deterministic in
      `seed`; endless for a generator, or as many as the data holds when `unique`; the held-out split
      is always unique and never shares a prompt with train;
    - `examples(split, n, seed, unique)`: the first n of those, exactly (`rollout` streams `iter_examples`
      chunk by chunk instead of building this list, so --num-prompts can be any count);
    - `completion(example)`: the SFT target (the eos token is appended by the tokenization step);
    - `reward(response, gold answer)`: the verifier, a finite float (1.0 = correct), never raising on
      a malformed response.

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
