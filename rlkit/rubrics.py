"""The judge rubric kinds (a registry, as `rlkit.algorithms.registry` is for losses) and rubric files.

A rubric is a TOML file (`load_rubric`):

    kind = "yes-no"                 # or "pairwise", "score"
    template = "{prompt}{response} correct? "
    choices = ["Y", "N"]            # yes-no: (yes, no); pairwise: (the first response, the second)
    # score only: the judge writes its answer (greedy), the first group of `pattern` is read as a number in
    # [low, high] and mapped to [0, 1]
    pattern = "Score: (\\d+)"
    low = 1
    high = 10
    max_new_tokens = 16

The template's placeholders are `{prompt}` and `{response}` (yes-no, score) or `{prompt}`, `{response_a}` and
`{response_b}` (pairwise); `{{` and `}}` are literal braces. Each choice must be one token of the judge's
tokenizer, the token the judge writes right after the rendered template: a verdict is then read from one forward
pass, without sampling noise, as P(first choice) / (P(first) + P(second)) (`rlkit.scorers.judge.Judge`). The
rubric's sha256 (of its bytes) goes into every manifest that used it.

A kind is one `KINDS` entry: its template's placeholders, what its two choices name (or None: the judge writes
an answer that the rubric's `pattern` reads), how a judged value becomes a (reward, verdict), how the `judge`
task makes a training example of it, and which uses take it (`score-ref`, `build-prefs`, `task judge`). A leaf:
no torch, no other rlkit module but `errors` and `config_file`, so the `judge` task (`rlkit.tasks.judge`) and
the judge scorer (`rlkit.scorers.judge`) both read it.
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from rlkit.errors import RlkitError


@dataclass(frozen=True)
class Rubric:
    kind: str  # one of RUBRIC_KINDS
    template: str
    choices: tuple[str, str] = ("", "")  # yes-no: (yes, no); pairwise: (first response, second response)
    pattern: str = ""  # score: a regex whose first group is the score
    low: float = 0.0
    high: float = 1.0
    max_new_tokens: int = 16
    path: str = ""
    sha256: str = ""

    def render(self, prompt: str, response: str | None = None, response_a: str | None = None,
               response_b: str | None = None) -> str:
        """The judge's input text for one (prompt, response) or (prompt, response_a, response_b)."""
        return self.template.format(prompt=prompt, response=response, response_a=response_a, response_b=response_b)

    def parse_score(self, text: str) -> tuple[float, str]:
        """A score rubric's reward from the judge's answer: (value in [0, 1], verdict). An answer without the
        pattern, or a number outside [low, high], is 0.0 with the reason as its verdict."""
        m = re.search(self.pattern, text)
        if m is None or not m.groups():
            return 0.0, "unparseable"
        try:
            x = float(m.group(1))
        except ValueError:
            return 0.0, "unparseable"
        if not self.low <= x <= self.high:
            return 0.0, "out_of_range"
        return (x - self.low) / (self.high - self.low), "parsed"

    def manifest_entry(self) -> dict:
        return {"rubric": self.path, "rubric_sha256": self.sha256, "rubric_kind": self.kind}

    @property
    def spec(self) -> RubricKind:
        """Its kind's registry entry."""
        return KINDS[self.kind]


def _yes_no(rubric: Rubric, p: float) -> tuple[float, str]:
    """P(yes) / (P(yes) + P(no)) is the reward; the verdict says which side of 1/2 it is on."""
    return p, "yes" if p >= 0.5 else "no"


def _yes_no_example(rubric: Rubric, rng, prompt: str, gold: str, wrong: str) -> tuple[str, str]:
    """The gold answer or a near miss (half each); the verdict is the yes or the no choice."""
    right = rng.random() < 0.5
    return rubric.render(prompt=prompt, response=gold if right else wrong), rubric.choices[0 if right else 1]


def _pairwise_example(rubric: Rubric, rng, prompt: str, gold: str, wrong: str) -> tuple[str, str]:
    """The gold answer and a near miss in a random order; the verdict is the choice naming the gold one."""
    first = rng.random() < 0.5
    a, b = (gold, wrong) if first else (wrong, gold)
    return rubric.render(prompt=prompt, response_a=a, response_b=b), rubric.choices[0 if first else 1]


class RubricKind(NamedTuple):
    placeholders: frozenset[str]  # the placeholders its template must hold
    takes: tuple[str, ...]  # the uses that take it: score-ref, build-prefs, task judge
    choices: str | None = None  # what its two choices name ("[yes, no]"); None: the judge writes an answer
    # a judged value (P(first choice), or the judge's answer) -> (reward in [0, 1], verdict); None: the kind
    # compares two responses (`rlkit.scorers.judge.prefer`)
    verdict: Callable[[Rubric, object], tuple[float, str]] | None = None
    # (rubric, rng, prompt, gold answer, a near miss) -> (text, target): the `judge` task's example; None: none
    example: Callable | None = None


KINDS: dict[str, RubricKind] = {
    "yes-no": RubricKind(frozenset({"prompt", "response"}), ("score-ref", "task judge"), "[yes, no]", _yes_no,
                         _yes_no_example),
    "pairwise": RubricKind(frozenset({"prompt", "response_a", "response_b"}), ("build-prefs", "task judge"),
                           "[first, second]", example=_pairwise_example),
    "score": RubricKind(frozenset({"prompt", "response"}), ("score-ref",), verdict=Rubric.parse_score),
}
RUBRIC_KINDS = tuple(KINDS)  # as registered at import (`load_rubric` reads KINDS itself)
# the placeholders each kind's template must hold
PLACEHOLDERS = {name: set(k.placeholders) for name, k in KINDS.items()}
_KEYS = {"kind", "template", "choices", "pattern", "low", "high", "max_new_tokens"}


def taken_by(use: str) -> tuple[str, ...]:
    """The rubric kinds `use` (score-ref, build-prefs, task judge) takes, in registry order."""
    return tuple(name for name, k in KINDS.items() if use in k.takes)


def load_rubric(path: str | Path, kinds: Sequence[str] | None = None, flag: str = "--rubric") -> Rubric:
    """A rubric file, checked: one line naming what is wrong (a missing or unreadable file, invalid TOML, an unknown
    key or kind, a template without its placeholders or with others, choices that are not two distinct strings,
    a score rubric without a pattern with one group, low >= high), or a kind this use does not take (`kinds`; None:
    every kind, `taken_by` gives a use's)."""
    from rlkit.config_file import load_toml

    p = Path(path)
    where = f"{flag} {p}"
    if not p.is_file():
        raise RlkitError(f"{where}: no such rubric file (a TOML file with kind, template and choices; see "
                         "docs/tasks-rewards.md)")
    raw = p.read_bytes()
    try:
        d = load_toml(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise RlkitError(f"{where}: not a valid TOML rubric ({str(e).splitlines()[0]})") from None
    unknown = sorted(set(d) - _KEYS)
    if unknown:
        raise RlkitError(f"{where}: unknown key {unknown[0]!r}; a rubric has {', '.join(sorted(_KEYS))}")
    kind = d.get("kind")
    if kind not in KINDS:
        raise RlkitError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if kinds is not None and kind not in kinds:
        raise RlkitError(f"{where} is a {kind} rubric; this takes {' or '.join(kinds)}")
    template = d.get("template")
    if not isinstance(template, str) or not template:
        raise RlkitError(f"{where}: 'template' must be a non-empty string")
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise RlkitError(f"{where}: the template does not parse ({e}); write literal braces as {{{{ and }}}}") from None
    want = set(KINDS[kind].placeholders)
    if names != want:
        raise RlkitError(f"{where}: a {kind} template holds {', '.join('{' + n + '}' for n in sorted(want))}"
                         + (f", not {', '.join('{' + n + '}' for n in sorted(names - want))}" if names - want else "")
                         + (f"; missing {', '.join('{' + n + '}' for n in sorted(want - names))}" if want - names
                            else ""))
    kw: dict = {}
    if KINDS[kind].choices is not None:
        choices = d.get("choices")
        if (not isinstance(choices, list) or len(choices) != 2 or not all(isinstance(c, str) and c for c in choices)
                or choices[0] == choices[1]):
            raise RlkitError(f"{where}: 'choices' must be two distinct non-empty strings {KINDS[kind].choices}, e.g. "
                             "[\"Y\", \"N\"]")
        kw["choices"] = tuple(choices)
    else:
        pattern = d.get("pattern")
        example = "e.g. \"Score: (\\\\d+)\""
        if not isinstance(pattern, str) or not pattern:
            raise RlkitError(f"{where}: a score rubric needs 'pattern', a regular expression whose first group is "
                             f"the score, {example}")
        shown = f"`{pattern}`" if pattern.isprintable() else repr(pattern)  # the expression itself, unescaped
        try:
            groups = re.compile(pattern).groups
        except re.error as e:
            raise RlkitError(f"{where}: 'pattern' {shown} is not a regular expression ({e}); {example}") from None
        if groups < 1:
            raise RlkitError(f"{where}: 'pattern' {shown} has no group; its first group (in parentheses) is the "
                             f"score, {example}")
        low, high = d.get("low", 0), d.get("high", 10)
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high)) or low >= high:
            raise RlkitError(f"{where}: 'low' and 'high' must be numbers with low < high (got {low!r}, {high!r})")
        n = d.get("max_new_tokens", 16)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise RlkitError(f"{where}: 'max_new_tokens' must be an integer >= 1")
        kw.update(pattern=pattern, low=float(low), high=float(high), max_new_tokens=n)
    return Rubric(kind, template, path=str(p), sha256="sha256:" + hashlib.sha256(raw).hexdigest(), **kw)
