"""The `arithmetic` task: sums like `<3+4+5>=` whose answer is the integer total, generated (nothing to download);
the embedded tiny model learns it in seconds."""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlkit.tasks.base import VERBOSE, VERIFIERS, Example, TaskBase, check, span


@dataclass(frozen=True)
class Arithmetic(TaskBase):
    """Sums like `<3+4+5>=` whose answer is the integer total.

    Knobs: `terms` (range of the number of terms, e.g. 2-4), `max` (largest operand, 0..max), `heldout`
    (fraction of the problem space held out) and `prose` (fraction of SFT targets written as a sentence,
    "The total is 12.", instead of the bare number; the prompts are the same whatever `prose` is).
    Generation length 16 tokens: a bare answer is a few characters.
    """

    name = "arithmetic"
    verifier = "last-integer"
    max_new_tokens = 16  # the task's generation length (Task.max_new_tokens)

    min_terms: int = 2
    max_terms: int = 4
    max_operand: int = 19
    heldout_fraction: float = 0.1
    prose: float = 0.0
    OPTIONS = {"terms": (("min_terms", "max_terms"), span, "LO-HI"), "max": ("max_operand", int, "N"),
               "heldout": ("heldout_fraction", float, "F"), "prose": ("prose", float, "F")}

    def checked(self) -> Arithmetic:
        check("--task arithmetic",
              (1 <= self.min_terms <= self.max_terms, f"terms={self.min_terms}-{self.max_terms}", "1 <= LO <= HI"),
              (self.max_operand >= 1, f"max={self.max_operand}", "max >= 1"),
              (0 < self.heldout_fraction < 1, f"heldout={self.heldout_fraction:g}", "0 < heldout < 1"),
              (0 <= self.prose <= 1, f"prose={self.prose:g}", "0 <= prose <= 1"))
        return self

    @property
    def spec(self) -> str:
        return self.problems_spec + (f",prose={self.prose}" if self.prose else "")

    @property
    def problems_spec(self) -> str:  # what decides the prompts (not `prose`, which only shapes SFT targets)
        return f"arithmetic:terms={self.min_terms}-{self.max_terms},max={self.max_operand},heldout={self.heldout_fraction}"

    def problem(self, rng: random.Random) -> tuple[str, str]:
        terms = [rng.randint(0, self.max_operand) for _ in range(rng.randint(self.min_terms, self.max_terms))]
        return f"<{'+'.join(map(str, terms))}>=", str(sum(terms))

    def problem_space(self) -> int:
        return sum((self.max_operand + 1) ** k for k in range(self.min_terms, self.max_terms + 1))

    def completion(self, ex: Example) -> str:
        """The SFT target for an example (the eos token is appended by the tokenization step): the bare
        answer, or with probability `prose` (fixed per prompt) one of the VERBOSE sentences around it."""
        if not self.prose:
            return ex.answer
        rng = random.Random(f"prose|{ex.prompt}")
        return rng.choice(VERBOSE).format(ex.answer) if rng.random() < self.prose else ex.answer

    def reward(self, response: str, answer: str) -> float:
        return VERIFIERS[self.verifier](response, answer)
