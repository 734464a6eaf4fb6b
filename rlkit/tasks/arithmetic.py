"""The `arithmetic` task: sums like `<3+4+5>=` whose answer is the integer total, generated (nothing to download);
the embedded tiny model learns it in seconds."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from rlkit.errors import RlkitError
from rlkit.tasks.base import VERBOSE, VERIFIERS, Example, check_split, is_heldout


@dataclass(frozen=True)
class Arithmetic:
    """Sums like `<3+4+5>=` whose answer is the integer total.

    Knobs: `terms` (range of the number of terms, e.g. 2-4), `max` (largest operand, 0..max), `heldout`
    (fraction of the problem space held out) and `prose` (fraction of SFT targets written as a sentence,
    "The total is 12.", instead of the bare number; the prompts are the same whatever `prose` is).
    Generation length 16 tokens: a bare answer is a few characters.
    """

    min_terms: int = 2
    max_terms: int = 4
    max_operand: int = 19
    heldout_fraction: float = 0.1
    prose: float = 0.0
    name: str = field(default="arithmetic", init=False)
    verifier: str = field(default="last-integer", init=False)
    max_new_tokens: int = field(default=16, init=False)  # the task's generation length (Task.max_new_tokens)

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
        for ok, given, expected in (
                (1 <= t.min_terms <= t.max_terms, f"terms={t.min_terms}-{t.max_terms}", "1 <= LO <= HI"),
                (t.max_operand >= 1, f"max={t.max_operand}", "max >= 1"),
                (0 < t.heldout_fraction < 1, f"heldout={t.heldout_fraction:g}", "0 < heldout < 1"),
                (0 <= t.prose <= 1, f"prose={t.prose:g}", "0 <= prose <= 1")):
            if not ok:
                raise RlkitError(f"--task arithmetic: {given}: expected {expected}")
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
        check_split(split)
        unique = unique or split == "heldout"
        want_heldout = split == "heldout"
        rng = random.Random(f"{self._problems_spec}|{split}|{seed}")
        seen: set[str] = set()
        misses, i = 0, 0
        while True:
            prompt, answer = self._problem(rng)
            if is_heldout(prompt, self.heldout_fraction) != want_heldout or (unique and prompt in seen):
                misses += 1
                if misses > 10_000 + 200 * i:
                    raise RlkitError(
                        f"task {self.spec}: ran out of distinct {split} prompts after {i} "
                        f"(problem space {self.problem_space()}); ask for fewer or widen the task"
                    )
                continue
            if unique:  # only a unique stream remembers its prompts: an endless one stays flat in memory
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
