"""The built-in `guess` environment and task: guess a secret number in 1..high with "higher"/"lower" feedback.

`--env guess[:high=20,turns=6,heldout=0]` (`GuessNumber`) brings its own prompts (`Guess 1-20:` and a newline;
the secret is the example's answer). A model turn is one line, the guess (`stop` is a newline; `max_new_tokens`
5): its first integer is the guess. The environment answers `higher` or `lower` on a line of its own; a turn
without an integer, or with one outside 1..high, gets `invalid` and counts as a turn. A right guess ends the game
(terminated, reward 1.0); the `turns`-th wrong one loses it (terminated, reward 0.0). A game reads, token for
token as the trajectory holds it:

    Guess 1-20:
    10
    higher
    15
    lower
    12

The reward is win/loss only. A shaped reward (closeness of the guess, a bonus for a narrower range) would pay a
policy that ignores the feedback, "always guess 10" collecting a good share of it every game; the mean number of
turns is the figure that shows a better strategy (a bisection wins 1..20 in at most 5 turns, 3.7 on average).
`--max-turns` is the driver's own limit, a truncation (not a loss); keep it at or above `turns`.

All games of one `high` share one prompt, so no prompt can be held out; by default the held-out split plays every
secret once (`rlkit eval --env guess`: each secret's game, greedily), the train split every secret in shuffled
passes. Holding secrets out (`heldout=F`, a fixed share of 1..high) is an option, not the default: trained on games
whose secret is never x, a policy rightly learns never to guess x (it never wins), so held-out secrets measure the
prior over secrets the training games taught, not the strategy. (In one run of `recipes/guess.sh` with
`heldout=0.2` the tiny model won every training secret's game greedily and none of the held-out ones.) Those held out are secrets that
bisection guesses as the middle of a range some training secret is also in (`Game.heldout_secrets`), so the SFT
transcripts reach the positions a bisecting game against them runs through.

`--task guess[:high=20,turns=6,heldout=0,bisect=0.4,linear=0.3]` (`Guess`) has the same prompts and secrets,
and as SFT target the transcript of a game against the secret, exactly as a rollout against `GuessNumber`
tokenises it (sft appends eos; a `Transcript`: sft trains on the guesses, the feedback lines are context, masked
as a rollout's loss_mask masks them). Its player is noisy on purpose, so RL has room to improve: each guess is the
middle of the range still possible with probability `bisect`, its lowest number with probability `linear`
(counting up), else a random number of that range; it never guesses against the feedback. At the defaults it
wins ~85% of games within 6 turns, in ~4.4 turns, where bisection wins all in ~3.7. As a single-turn task (eval
--task guess) the model writes the whole game, feedback included; its verifier replays the guesses through
`GuessNumber` and pays 1.0 for a game won whose feedback lines are the environment's own.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from rlkit.envs.base import Step
from rlkit.errors import RlkitError
from rlkit.tasks.base import Example, TaskBase, Transcript, check, check_split, shuffled_passes

STOP = "\n"  # a model turn is one line
FEEDBACK = {"higher": "higher\n", "lower": "lower\n", "invalid": "invalid\n"}
MAX_HIGH = 9999  # a guess and its newline fit GuessNumber.max_new_tokens
_INT = re.compile(r"-?\d+")


def first_integer(text: str) -> int | None:
    """The first integer in `text` (a leading minus sign kept), or None when there is none."""
    m = _INT.search(text)
    return int(m.group()) if m else None


@dataclass(frozen=True)
class Game:
    """The rules shared by the environment and the task: the range, the turn limit and the held-out secrets."""

    high: int = 20
    turns: int = 6
    heldout: float = 0.0

    def checked(self, who: str) -> Game:
        check(who, (2 <= self.high <= MAX_HIGH, f"high={self.high}", f"2 <= high <= {MAX_HIGH}"),
              (self.turns >= 1, f"turns={self.turns}", "turns >= 1"),
              (0 <= self.heldout < 1, f"heldout={self.heldout:g}", "0 <= heldout < 1"))
        return self

    @property
    def prompt(self) -> str:
        return f"Guess 1-{self.high}:\n"

    def bisection_ranges(self) -> dict[int, tuple[int, int]]:
        """Each secret's range (lo, hi) when bisection (the middle, rounded down) guesses it: every secret is the
        middle of exactly one range of bisection's tree; (x, x) for one it only pins down by elimination."""
        out, todo = {}, [(1, self.high)]
        while todo:
            lo, hi = todo.pop()
            if lo <= hi:
                mid = (lo + hi) // 2
                out[mid] = (lo, hi)
                todo += [(lo, mid - 1), (mid + 1, hi)]
        return out

    def heldout_secrets(self) -> frozenset[int]:
        """A fixed `heldout` share of 1..high (whatever the seeds; none at 0, else at least one, never all): secrets
        that bisection guesses as the middle of a range that also holds a training secret, so that a policy which
        learnt to bisect on the training games reaches the guess through positions those games reach too. (A secret pinned down by
        elimination, the range shrunk to it alone, ends in a position no training game ever reaches: the tiny
        model does not win those.) Where too few secrets qualify (a large share of a small range), any others."""
        if not self.heldout:
            return frozenset()
        k = min(self.high - 1, max(1, round(self.heldout * self.high)))
        pool = list(range(1, self.high + 1))
        random.Random(f"guess-heldout|{self.high}").shuffle(pool)
        ranges = self.bisection_ranges()

        def reached(x: int, held: set[int]) -> bool:  # x's range holds a secret that is not held out
            lo, hi = ranges[x]
            return any(s not in held for s in range(lo, hi + 1))

        held: set[int] = set()
        for x in pool:
            if len(held) < k and all(reached(y, held | {x}) for y in held | {x}):
                held.add(x)
        for x in pool:  # too few qualified
            if len(held) < k:
                held.add(x)
        return frozenset(held)

    def secrets(self, split: str) -> list[int]:
        """The secrets of `split`: without held-out secrets (heldout=0) both splits have them all."""
        held = self.heldout_secrets()
        if not held:
            return list(range(1, self.high + 1))
        return [s for s in range(1, self.high + 1) if (s in held) == (split == "heldout")]

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        """Games of `split`, deterministic in `seed`: the split's secrets in shuffled passes, endless (every secret
        once a pass: a batch's games are spread evenly over the secrets), or (unique, and always for the held-out
        split) one pass."""
        check_split(split)
        rng = random.Random(f"guess:high={self.high},heldout={self.heldout}|{split}|{seed}")
        draws = shuffled_passes(self.secrets(split), rng, unique or split == "heldout")
        for i, secret in enumerate(draws):
            yield Example(f"{split}-{seed}-{i}", self.prompt, str(secret), split)

    def judge(self, guess: int | None, secret: int) -> str:
        """'correct', 'higher' (the secret is higher), 'lower' or 'invalid' (no integer, or out of range)."""
        if guess is None or not 1 <= guess <= self.high:
            return "invalid"
        return "correct" if guess == secret else "higher" if secret > guess else "lower"


class GuessNumber:
    """`--env guess`: guess the secret in 1..high within `turns` turns, told "higher" or "lower" after each wrong
    guess; reward 1.0 for a win, 0.0 for a loss (see the module docstring)."""

    stop = (STOP,)
    max_new_tokens = 5  # a guess up to MAX_HIGH and its newline
    max_turns = 6  # the game's own turn limit (`turns=`); rollout warns when --max-turns is below it

    @staticmethod
    def option_attribute(name: str, options: dict):
        """`max_turns` as `turns=` sets it (`EnvSpec.attribute`); None: the class's own."""
        if name == "max_turns" and options.get("turns"):
            return int(options["turns"])
        return None

    def __init__(self, high: int = 20, turns: int = 6, heldout: float = 0.0) -> None:
        self.game = Game(high, turns, heldout).checked("environment guess")
        self.secret: int | None = None
        self.turn = 0

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        return self.game.iter_examples(split, seed, unique)

    def reset(self, example) -> str:
        secret = first_integer(str(example.answer))
        if secret is None or not 1 <= secret <= self.game.high:
            raise RlkitError(f"environment guess: the example's answer {example.answer!r:.40} is not a secret "
                             f"number in 1..{self.game.high}")
        self.secret, self.turn = secret, 0
        return example.prompt

    def step(self, action: str) -> Step:
        if self.secret is None:
            raise RlkitError("environment guess: step() before reset()")
        self.turn += 1
        verdict = self.game.judge(first_integer(action), self.secret)
        if verdict == "correct":
            return Step(None, 1.0, terminated=True)
        if self.turn >= self.game.turns:
            return Step(None, 0.0, terminated=True)  # out of turns: lost
        # the feedback on a line of its own, also after a turn cut before its newline
        return Step(("" if action.endswith(STOP) else STOP) + FEEDBACK[verdict], 0.0)


@dataclass(frozen=True)
class Guess(TaskBase):
    """`--task guess`: the `GuessNumber` games, with a noisy player's transcripts as SFT targets (see the module
    docstring). Knobs: `high`, `turns`, `heldout` as the environment's; `bisect`, `linear` the player's shares of
    middle and lowest guesses (the rest random in the range still possible)."""

    name = "guess"
    targets_are_gold = False  # the noisy player's games, some lost: demonstrations (rlkit.tasks.trust)

    high: int = 20
    turns: int = 6
    heldout_fraction: float = 0.0
    bisect: float = 0.4
    linear: float = 0.3
    OPTIONS = {"high": ("high", int, "N"), "turns": ("turns", int, "N"), "heldout": ("heldout_fraction", float, "F"),
               "bisect": ("bisect", float, "F"), "linear": ("linear", float, "F")}
    NOT_A = {int: "an integer"}

    def checked(self) -> Guess:
        self.game.checked("task guess")
        if not (0 <= self.bisect and 0 <= self.linear and self.bisect + self.linear <= 1):
            raise RlkitError(f"task guess: bisect={self.bisect:g}, linear={self.linear:g}: expected shares >= 0 that "
                             "sum to at most 1 (the rest are random guesses)")
        return self

    @property
    def game(self) -> Game:
        return Game(self.high, self.turns, self.heldout_fraction)

    @property
    def spec(self) -> str:
        return (f"guess:high={self.high},turns={self.turns},heldout={self.heldout_fraction},bisect={self.bisect},"
                f"linear={self.linear}")

    @property
    def max_new_tokens(self) -> int:
        """A whole game written in one go (single-turn eval): every turn a guess and the longest feedback."""
        return self.turns * (len(str(self.high)) + len(STOP) + max(map(len, FEEDBACK.values()))) + 4

    def iter_examples(self, split: str, seed: int, unique: bool = False) -> Iterator[Example]:
        return self.game.iter_examples(split, seed, unique)

    def guesses(self, ex: Example) -> list[int]:
        """The noisy player's guesses against the example's secret (fixed per example), up to the win or the
        turn limit; never against the feedback."""
        secret = int(ex.answer)
        rng = random.Random(f"guess-player|{ex.prompt_id}|{ex.answer}")
        lo, hi, out = 1, self.high, []
        while len(out) < self.turns:
            u = rng.random()
            g = (lo + hi) // 2 if u < self.bisect else lo if u < self.bisect + self.linear else rng.randint(lo, hi)
            out.append(g)
            if g == secret:
                break
            lo, hi = (g + 1, hi) if secret > g else (lo, g - 1)
        return out

    def completion(self, ex: Example) -> Transcript:
        """The SFT target: the noisy player's game, each guess a line (the model's turn) and each feedback the
        environment's (a `Transcript`: sft trains on the guesses, the feedback is context)."""
        secret, parts = int(ex.answer), []
        for g in self.guesses(ex):
            parts.append(f"{g}{STOP}")
            verdict = self.game.judge(g, secret)
            if verdict == "correct" or len(parts) == 2 * self.turns - 1:
                break
            parts.append(FEEDBACK[verdict])
        return Transcript.turns(*parts)

    def reward(self, response: str, answer: str) -> float:
        """1.0 when `response`, read as a game (a guess a line, each followed by the feedback line), is won
        against the secret `answer` with every feedback line the environment's own; else 0.0."""
        return replay(response, answer, self.game)[0]


def replay(transcript: str, secret: str, game: Game | None = None) -> tuple[float, int]:
    """(reward, turns) of `transcript` replayed through a `GuessNumber`: each turn is the text up to and with the
    next newline, stepped; the environment's observation must follow it verbatim. A game that breaks off before it
    ends, or whose feedback is not the environment's, scores 0.0."""
    game = game or Game()
    env = GuessNumber(game.high, game.turns, game.heldout)
    env.reset(Example("replay", game.prompt, secret, "train"))
    rest = transcript
    while rest:
        end = rest.find(STOP)
        action, rest = (rest, "") if end < 0 else (rest[:end + len(STOP)], rest[end + len(STOP):])
        st = env.step(action)
        if st.terminated:
            return st.reward, env.turn
        if not rest.startswith(st.observation):
            return 0.0, env.turn
        rest = rest[len(st.observation):]
    return 0.0, env.turn
