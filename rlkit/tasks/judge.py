"""The `judge` task (`--task judge:task=arithmetic,rubric=FILE[|FILE...]`): a judge's training data made from a
generated task: the task's prompts with proposed answers (the gold one or a near miss) and the verdict a rubric
(`rlkit.rubrics`) asks for, so `rlkit sft` trains a judge and its held-out evaluation is the judge's agreement
with the task's verifier. The judge that scores rows is `rlkit.scorers.judge`.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from rlkit.errors import RlkitError
from rlkit.rubrics import Rubric, load_rubric, taken_by
from rlkit.tasks.base import Example, check_split


@dataclass(frozen=True)
class JudgeTask:
    """Judgments of a generated task as SFT and evaluation data for a judge: `judge:task=arithmetic,rubric=FILE`.

    Each example is one of the task's problems with proposed answers, rendered by a rubric (several rubrics,
    `|`-separated, take turns): a yes-no rubric shows the gold answer or a near miss (half each) and wants its
    yes or no choice; a pairwise rubric shows the gold answer and a near miss in a random order and wants the
    choice naming the gold one. The target is that choice; the verifier checks the judge's answer starts with
    it, so sft's held-out evaluation is the judge's agreement with the task's verifier on held-out problems.
    """

    base: object  # the task whose problems are judged (arithmetic)
    rubrics: tuple[Rubric, ...]
    name: str = field(default="judge", init=False)
    max_new_tokens: int = field(default=4, init=False)

    @classmethod
    def from_options(cls, opts: dict[str, str], get_task) -> JudgeTask:
        """`get_task`: `rlkit.tasks.get_task`, which resolves task=NAME (passed in: this module imports no
        registry)."""
        unknown = sorted(set(opts) - {"task", "rubric"})
        if unknown:
            raise RlkitError(f"unknown option {unknown[0]!r} for task judge; expected task=NAME, rubric=FILE[|FILE]")
        if "rubric" not in opts:
            raise RlkitError("task judge needs rubric=FILE (or FILE|FILE...): the rubric the judge learns to answer")
        base = get_task(opts.get("task", "arithmetic"))
        if base.name != "arithmetic":
            raise RlkitError(f"task judge makes judgments of arithmetic problems (near misses of an integer answer); "
                             f"got task={base.name}")
        rubrics = tuple(load_rubric(f, taken_by("task judge"), "task judge: rubric")
                        for f in opts["rubric"].split("|"))
        return cls(base, rubrics)

    @property
    def spec(self) -> str:
        return f"judge:task={self.base.spec.partition(':')[0]},rubric={'|'.join(r.path for r in self.rubrics)}"

    @property
    def fingerprint(self) -> str:
        """The rubrics' bytes decide the examples: an edited rubric is another task (`task_inputs`)."""
        return "sha256:" + hashlib.sha256("|".join(r.sha256 for r in self.rubrics).encode()).hexdigest()

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        from rlkit.tasks.prefs import near_miss

        check_split(split)
        for i, ex in enumerate(self.base.iter_examples(split, seed, unique)):
            rubric = self.rubrics[i % len(self.rubrics)]
            rng = random.Random(f"judge|{rubric.sha256}|{ex.prompt}|{seed}|{i}")
            gold = int(ex.answer)
            wrong = str(near_miss(gold, rng))
            text, verdict = rubric.spec.example(rubric, rng, ex.prompt, str(gold), wrong)  # rlkit.rubrics.KINDS
            yield Example(f"judge-{ex.prompt_id}", text, verdict, split)

    def examples(self, split: str, n: int, seed: int, unique: bool = False) -> list[Example]:
        return list(itertools.islice(self.iter_examples(split, seed, unique), n))

    def completion(self, ex: Example) -> str:
        return ex.answer

    def reward(self, response: str, answer: str) -> float:
        return 1.0 if response.strip().startswith(answer.strip()) else 0.0
