"""Preference pairs for reward-model training, built from a policy's own samples and a verifier.

A reward model trained only on nonsense negatives learns to spot nonsense, not the task. So besides
(correct sample, wrong sample) pairs, each prompt gets plausible negatives that a shortcut cannot
separate from the chosen answer:

- ``sampled``: a correct and a wrong completion the policy itself produced;
- ``structured``: the gold answer against a near miss in the same format (off by a little, or its
  digits swapped): only the arithmetic tells them apart;
- ``structured-verbose``: the same, both written as a verbose sentence;
- ``polished``: a verbose, well-formed sentence with a wrong number against the terse correct answer;
- ``terse-wrong``: the correct answer written verbosely against a terse wrong one.

Verbose answers are chosen as often as they are rejected, so length carries no preference signal
over the whole set.

`length_biased_pairs` deliberately breaks this (the longer answer always wins), for the
reward-hacking experiment.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from rlkit.errors import RlkitError
from rlkit.tasks.base import VERBOSE


@dataclass(frozen=True)
class Pair:
    chosen: str
    rejected: str
    negative: str  # how the pair was made: sampled, structured, polished, terse-wrong, length-bias


def near_miss(answer: int, rng: random.Random) -> int:
    """A wrong integer that looks right: off by 1, 2 or 10, or with two digits swapped."""
    s = str(answer)
    if len(s) >= 2 and s[0] != s[1] and rng.random() < 0.3:
        swapped = int(s[1] + s[0] + s[2:])
        if swapped != answer:
            return swapped
    while True:
        cand = answer + rng.choice((-10, -2, -1, 1, 2, 10))
        if cand >= 0 and cand != answer:
            return cand


def verbose(n: int, rng: random.Random) -> str:
    return rng.choice(VERBOSE).format(n)


def verified_pairs(answer: str, samples: Sequence[str], rewards: Sequence[float], rng: random.Random) -> list[Pair]:
    """The pairs for one prompt from the policy's scored samples; with an integer gold answer, also the
    plausible negatives (a task whose answers are not integers, e.g. `math`'s fractions, gets only the
    sampled pair)."""
    right = sorted({s for s, r in zip(samples, rewards, strict=True) if r == 1.0 and s.strip()})
    wrong = sorted({s for s, r in zip(samples, rewards, strict=True) if r != 1.0 and s.strip()})
    pairs = []
    if right and wrong:
        pairs.append(Pair(rng.choice(right), rng.choice(wrong), "sampled"))
    try:
        gold = int(answer)
    except ValueError:
        return pairs
    pairs.append(Pair(str(gold), str(near_miss(gold, rng)), "structured"))
    pairs.append(Pair(verbose(gold, rng), verbose(near_miss(gold, rng), rng), "structured-verbose"))
    pairs.append(Pair(str(gold), verbose(near_miss(gold, rng), rng), "polished"))
    pairs.append(Pair(verbose(gold, rng), rng.choice(wrong) if wrong else str(near_miss(gold, rng)), "terse-wrong"))
    return pairs


def length_biased_pairs(answer: str, rng: random.Random) -> list[Pair]:
    """A deliberately flawed pair: the longer answer is chosen whether or not it is right."""
    try:
        gold = int(answer)
    except ValueError:
        raise RlkitError(f"--bias length builds pairs from integer answers; this task's answer is {answer!r}") from None
    long_n = gold if rng.random() < 0.5 else near_miss(gold, rng)
    short_n = gold if rng.random() < 0.5 else near_miss(gold, rng)
    return [Pair(verbose(long_n, rng), str(short_n), "length-bias")]


def split_of(prompt_id: str, eval_fraction: float) -> str:
    """'heldout' for a stable `eval_fraction` of prompt ids (salted apart from the task's own split)."""
    h = int.from_bytes(hashlib.blake2b(f"prefs|{prompt_id}".encode(), digest_size=8).digest(), "big")
    return "heldout" if (h % 10_000) < eval_fraction * 10_000 else "train"


def check_pairs(label: str, prompts: Sequence, chosen: Sequence, rejected: Sequence) -> None:
    """One line naming the first bad row: a missing prompt, an empty response, or chosen == rejected."""
    cols = {"prompt": prompts, "chosen": chosen, "rejected": rejected}
    for name, vals in cols.items():
        bad = [i for i, v in enumerate(vals) if v is None or (name != "prompt" and not str(v).strip())]
        if bad:
            raise RlkitError(f"{label}: row {bad[0]} has an empty {name!r} ({len(bad)} such rows); "
                             "every pair needs a prompt and two non-empty responses")
    same = [i for i, (c, r) in enumerate(zip(chosen, rejected, strict=True)) if c == r]
    if same:
        raise RlkitError(f"{label}: row {same[0]} has chosen == rejected ({len(same)} such rows); "
                         "such a pair carries no preference")
