"""The built-in `calc` environment and task: products like `<37*48>=` that the tiny model cannot compute in its
head, with a `mul` tool that can.

`--env calc[:digits=2,heldout=0.1]` (`CalcEnv`, a `Tools` environment) brings its own prompts; a turn
`<call>mul(37,48)</call>` gets the observation `<tool>1776</tool>` (tokenizers without a chat template), and the
final answer earns 1.0 when its last integer is the product (`last_integer`), else 0.0.

`--task calc[:digits=2,heldout=0.1,tool=1.0]` (`Calc`) has the same prompts, split the same way (the
`is_heldout` hash partition, as `arithmetic`), and as SFT target the tool-use transcript exactly as a rollout
against `CalcEnv` tokenises it for a tokenizer without a chat template: `<call>mul(37,48)</call><tool>1776</tool>1776`
(sft appends eos), a `Transcript` whose tool result sft masks as a rollout's loss_mask does: the model learns to
call the tool and to answer, never to write the tool's result. `tool` is the fraction of prompts (fixed per prompt) whose target uses the tool; the others'
target answers without it, `The product is 1776.`, a product the model then has to guess. Below tool=0.5 such a
model answers without the tool when greedy (its first token is more likely `T` than `<`) though it samples tool
calls: recipes/tools.sh's starting point, from which RL moves it to the tool. As a single-turn task (eval --task
calc) the model writes the tool's result itself; its verifier is the last integer of the whole response.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from rlkit.envs.tools import Tools
from rlkit.tasks.base import Example, TaskBase, Transcript, check, last_integer


def mul(a: int, b: int) -> int:
    """Multiply two integers: mul(37, 48) -> 1776.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


@dataclass(frozen=True)
class Calc(TaskBase):
    """Products of two `digits`-digit numbers, `<37*48>=` -> `1776` (see the module docstring).

    Knobs: `digits` (1-6), `heldout` (fraction of the problem space held out), `tool` (fraction of SFT targets
    that call the tool; the prompts are the same whatever `tool` is)."""

    name = "calc"
    verifier = "last-integer"
    widen = "raise digits"

    digits: int = 2
    heldout_fraction: float = 0.1
    tool: float = 1.0
    OPTIONS = {"digits": ("digits", int, "N"), "heldout": ("heldout_fraction", float, "F"), "tool": ("tool", float, "F")}

    def checked(self) -> Calc:
        check("calc", (1 <= self.digits <= 6, f"digits={self.digits}", "1 <= digits <= 6"),
              (0 < self.heldout_fraction < 1, f"heldout={self.heldout_fraction:g}", "0 < heldout < 1"),
              (0 <= self.tool <= 1, f"tool={self.tool:g}", "0 <= tool <= 1"))
        return self

    @property
    def spec(self) -> str:
        return self.problems_spec + (f",tool={self.tool}" if self.tool != 1.0 else "")

    @property
    def problems_spec(self) -> str:  # what decides the prompts (not `tool`, which only shapes SFT targets)
        return f"calc:digits={self.digits},heldout={self.heldout_fraction}"

    @property
    def max_new_tokens(self) -> int:
        """The whole transcript's length (single-turn: the model writes the tool's result too), plus room."""
        top = 10 ** self.digits - 1
        return len(self.transcript(top, top)) + 4

    def problem_space(self) -> int:
        return (9 * 10 ** (self.digits - 1)) ** 2

    def problem(self, rng: random.Random) -> tuple[str, str]:
        lo, hi = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10 ** self.digits - 1
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        return f"<{a}*{b}>=", str(a * b)

    @staticmethod
    def transcript(a: int, b: int) -> Transcript:
        """The tool-use turns for a*b as the rollout's tokens read (the tiny tokenizer, no chat template): the model's
        call, the tool's result (the environment's text: sft masks it) and the model's answer."""
        p = mul(a, b)
        return Transcript.turns(f"<call>mul({a},{b})</call>", f"<tool>{p}</tool>", str(p))

    def completion(self, ex: Example) -> str:
        """The SFT target: the tool-use transcript, or, for a `1 - tool` share of the prompts (fixed per prompt), an
        answer without the tool, `The product is 1776.`"""
        if self.tool < 1.0 and random.Random(f"tool|{ex.prompt}").random() >= self.tool:
            return f"The product is {ex.answer}."
        a, b = ex.prompt[1:-2].split("*")
        return self.transcript(int(a), int(b))

    def reward(self, response: str, answer: str) -> float:
        return last_integer(response, answer)


class CalcEnv(Tools):
    """`--env calc`: the `Calc` problems with the `mul` tool; reward 1.0 when the final answer's last integer is
    the product. Options `digits`, `heldout` as the task's (same prompts, same split)."""

    tools = [mul]
    max_new_tokens = 32  # one turn: a call <call>mul(9999,9999)</call> (27 tokens at digits=4) or the answer

    def __init__(self, digits: int = 2, heldout: float = 0.1, sandbox=None) -> None:
        self.problems = Calc(digits, heldout).checked()  # before the sandbox starts: a bad option is one line
        super().__init__(sandbox=sandbox)

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        return self.problems.iter_examples(split, seed, unique)

    def score(self, answer: str, example) -> float:
        return last_integer(answer, example.answer)
