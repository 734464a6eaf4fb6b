"""Tasks: prompt generators that carry their own verifier, chosen by name from a registry.

A task spec is `name[:key=value,...]`, e.g. `arithmetic` or `arithmetic:terms=2-5,max=20`.
A verifier is a reward function of (response, gold answer) -> float, so a verifier (RLVR) and a
reward model (RLHF) are interchangeable reward components.

Train and held-out prompts come from one deterministic partition of the problem space (a stable
hash of the prompt text), so a held-out prompt can never be drawn for training, whatever the seeds.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

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


def _heldout(prompt: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big")
    return (h % 10_000) < fraction * 10_000


@dataclass(frozen=True)
class Arithmetic:
    """Sums like `<3+4+5>=` whose answer is the integer total.

    Knobs: `terms` (range of the number of terms, e.g. 2-4), `max` (largest operand, 0..max), `heldout`
    (fraction of the problem space held out) and `prose` (fraction of SFT targets written as a sentence,
    "The total is 12.", instead of the bare number; the prompts are the same whatever `prose` is).
    """

    min_terms: int = 2
    max_terms: int = 4
    max_operand: int = 19
    heldout_fraction: float = 0.1
    prose: float = 0.0
    name: str = field(default="arithmetic", init=False)
    verifier: str = field(default="last-integer", init=False)

    @classmethod
    def from_options(cls, opts: dict[str, str]) -> Arithmetic:
        kw: dict = {}
        for k, v in opts.items():
            if k == "terms":
                lo, _, hi = v.partition("-")
                kw["min_terms"], kw["max_terms"] = int(lo), int(hi or lo)
            elif k == "max":
                kw["max_operand"] = int(v)
            elif k == "heldout":
                kw["heldout_fraction"] = float(v)
            elif k == "prose":
                kw["prose"] = float(v)
            else:
                raise RlkitError(f"unknown option {k!r} for task arithmetic; expected terms=LO-HI, max=N, heldout=F, "
                                 "prose=F")
        t = cls(**kw)
        if (not (1 <= t.min_terms <= t.max_terms) or t.max_operand < 1 or not (0 < t.heldout_fraction < 1)
                or not (0 <= t.prose <= 1)):
            raise RlkitError(f"bad arithmetic options {opts}: need 1 <= terms, low <= high, max >= 1, 0 < heldout < 1, "
                             "0 <= prose <= 1")
        return t

    @property
    def spec(self) -> str:
        return self._problems_spec + (f",prose={self.prose}" if self.prose else "")

    @property
    def _problems_spec(self) -> str:  # what decides the prompts (not `prose`, which only shapes SFT targets)
        return f"arithmetic:terms={self.min_terms}-{self.max_terms},max={self.max_operand},heldout={self.heldout_fraction}"

    def _problem(self, rng: random.Random) -> tuple[str, str]:
        terms = [rng.randint(0, self.max_operand) for _ in range(rng.randint(self.min_terms, self.max_terms))]
        return f"<{'+'.join(map(str, terms))}>=", str(sum(terms))

    def problem_space(self) -> int:
        return sum((self.max_operand + 1) ** k for k in range(self.min_terms, self.max_terms + 1))

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        """Endless problems of `split`, deterministic in `seed`. Held-out ones are always unique."""
        if split not in SPLITS:
            raise RlkitError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        unique = unique or split == "heldout"
        want_heldout = split == "heldout"
        rng = random.Random(f"{self._problems_spec}|{split}|{seed}")
        seen: set[str] = set()
        misses, i = 0, 0
        while True:
            prompt, answer = self._problem(rng)
            if _heldout(prompt, self.heldout_fraction) != want_heldout or (unique and prompt in seen):
                misses += 1
                if misses > 10_000 + 200 * i:
                    raise RlkitError(
                        f"task {self.spec}: ran out of distinct {split} prompts after {i} "
                        f"(problem space {self.problem_space()}); ask for fewer or widen the task"
                    )
                continue
            seen.add(prompt)
            yield Example(f"{split}-{seed}-{i}", prompt, answer, split)
            i += 1

    def examples(self, split: str, n: int, seed: int, unique: bool = False) -> list[Example]:
        return list(itertools.islice(self.iter_examples(split, seed, unique), n))

    def completion(self, ex: Example) -> str:
        """The SFT target for an example (the eos token is appended by the tokenization step): the bare
        answer, or with probability `prose` (fixed per prompt) one of the VERBOSE sentences around it."""
        if not self.prose:
            return ex.answer
        rng = random.Random(f"prose|{ex.prompt}")
        return rng.choice(VERBOSE).format(ex.answer) if rng.random() < self.prose else ex.answer

    def reward(self, response: str, answer: str) -> float:
        return VERIFIERS[self.verifier](response, answer)


TASKS: dict[str, Callable[[dict[str, str]], object]] = {"arithmetic": Arithmetic.from_options}


def get_task(spec: str) -> Arithmetic:
    name, _, rest = spec.partition(":")
    if name not in TASKS:
        raise RlkitError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    opts: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        k, eq, v = part.partition("=")
        if not eq:
            raise RlkitError(f"bad task option {part!r} in {spec!r}; expected key=value")
        opts[k.strip()] = v.strip()
    return TASKS[name](opts)
