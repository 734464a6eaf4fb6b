"""What every task shares: the example record, the Task protocol, splits and the built-in verifiers."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from rlkit.errors import RlkitError
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


def library_version(distribution: str) -> str:
    """The installed version of a distribution ('unknown' when it has none): what manifests record for the library
    an adapter runs (reasoning-gym, textarena, websockets)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise RlkitError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
