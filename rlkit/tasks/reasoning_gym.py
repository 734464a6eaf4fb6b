"""The `reasoning-gym` task: reasoning-gym's procedural generators (about 100 of them, each with its own scorer) as
an rlkit task, through the optional extra `rlkit[reasoning-gym]`.

Spec: `reasoning-gym:dataset=NAME[,KEY=VALUE...][,heldout=F][,partial=1][,answer_tags=1]`, e.g.
`reasoning-gym:dataset=basic_arithmetic,min_terms=2,max_terms=2,max_digits=1,operators=+|-`. Any other key is a
field of the generator's config dataclass (`reasoning_gym.create_dataset(NAME, **config)`), converted to the
field's type; a list or tuple field takes its items separated by `|`. `seed` and `size` are rlkit's to set.

Rows. The prompt is `Question: {question}\\nAnswer:` (the completion starts with a space), with `answer_tags=1`
the library's instruction to answer inside `<answer></answer>` tags before it. The scorer needs the generator's
whole entry (question, answer, metadata), so the row's `answer` is that entry as JSON (tuples kept as tuples:
`decode_entry`); the SFT target is the entry's gold answer (` 42`, or ` <answer>42</answer>` with tags). A few
generators have no single gold answer (`answer` is None: the scorer checks the solution itself): they sample and
score (rollout, eval, build-prefs' prompts) but cannot be SFT targets, which `sft` says in one line.

Scoring is strict by default: reward 1.0 only when the library's scorer gives a full score, else 0.0. The
library's own scores include partial credit (for some generators, a response that merely contains the gold
answer scores above 0), which a policy learns to exploit; `partial=1` passes the library's score through. The
answer read is the whole response, stripped, or with `answer_tags=1` the content of its last `<answer>` tags
(none: 0.0, verdict `no_answer_tags`). A scorer that raises on a response is a reward of 0.0, verdict
`scorer_error`, never a crash; what a scorer prints goes to stderr, never into a stage's output on stdout. Verdicts: passed, partial, wrong_answer, no_answer_tags, scorer_error.

Splits. Train and held-out examples come from disjoint seeds of the generator and are kept apart by a stable
hash of the question text (`heldout=F`, default 0.1, as the arithmetic task): a question in the held-out
partition is never a training example, whatever the seeds, and held-out questions are unique. Examples are
drawn in chunks of `CHUNK` from library seeds derived from (split, rlkit seed, chunk), so the train stream is
endless and the same seed gives the same rows. The manifest records the spec (generator and config) and the
library's version (`fingerprint`: a new version reruns the stages that depend on it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rlkit.errors import RlkitError
from rlkit.plugins import as_bool, library_version, missing_extra
from rlkit.tasks.base import PASSED, Example, Scores, TaskBase

NAME = "reasoning-gym"
INSTALL = "pip install 'rlkit[reasoning-gym]' (it builds pycosat from source: a C compiler is needed)"
PROMPT = "Question: {question}\nAnswer:"
TAGS_INSTRUCTION = "Give only the final answer, inside <answer></answer> tags.\n"
CHUNK = 500  # examples per library dataset (the library's default size; some generators refuse much larger)
MAX_NEW_TOKENS = 32
OWN_OPTIONS = ("dataset", "heldout", "partial", "answer_tags")
REASONS = (PASSED, "partial", "wrong_answer", "no_answer_tags", "scorer_error")


@functools.cache
def library():
    """The `reasoning_gym` module, imported on first use (about 3 s: sympy and its generators' dependencies);
    missing, one line naming the install command."""
    import warnings

    try:
        with warnings.catch_warnings():  # a dependency's SyntaxWarnings when its bytecode is first compiled
            warnings.simplefilter("ignore", SyntaxWarning)
            import reasoning_gym
            import reasoning_gym.factory  # noqa: F401
    except ImportError as e:
        raise missing_extra(f"task {NAME}", "reasoning-gym", INSTALL, e) from None
    return reasoning_gym


def _names() -> list[str]:
    return sorted(library().factory.DATASETS)


@functools.cache
def _scorer(name: str):
    """The library's scorer of generator `name` (`get_score_answer_fn`), made once: the library builds a dataset of
    the generator's default config for it each time it is asked, which for some generators reads their data
    files (arc_agi: a second or more a call)."""
    return library().get_score_answer_fn(name)


# ---------------------------------------------------------------------------------------------
# The entry as JSON: tuples survive (some generators' scorers compare them)

def encode_entry(entry: dict) -> str:
    def enc(v):
        if isinstance(v, tuple):
            return {"__tuple__": [enc(x) for x in v]}
        if isinstance(v, list):
            return [enc(x) for x in v]
        if isinstance(v, dict):
            return {str(k): enc(x) for k, x in v.items()}
        if v is None or isinstance(v, str | int | float | bool):
            return v
        return str(v)  # a date, a set, a library object: its text (no scorer compares these)

    return json.dumps(enc(entry), separators=(",", ":"), sort_keys=True)


def decode_entry(text: str) -> dict:
    def hook(d: dict):
        return tuple(d["__tuple__"]) if len(d) == 1 and "__tuple__" in d else d

    return json.loads(text, object_hook=hook)


# ---------------------------------------------------------------------------------------------
# Options: the generator's config fields, typed

def _convert(value: str, tp: Any, key: str, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value.lower() == "none" and type(None) in args:
            return None
        return _convert(value, next(a for a in args if a is not type(None)), key, where)
    if origin is typing.Literal:
        if value not in [str(a) for a in args]:
            raise RlkitError(f"{where}: {key}={value!r}: expected one of {', '.join(map(str, args))}")
        return next(a for a in args if str(a) == value)
    if tp in (list, tuple) or origin in (list, tuple, typing.Sequence) or str(origin) == "collections.abc.Sequence":
        inner = args[0] if args and args[0] is not Ellipsis else None
        items = [_convert(v, inner, key, where) for v in value.split("|")] if value else []
        return tuple(items) if (tp is tuple or origin is tuple) else items
    if tp is None:  # an untyped tuple's item: a number when it reads as one
        for conv in (int, float):
            try:
                return conv(value)
            except ValueError:
                pass
        return value
    if tp is bool:
        try:
            return as_bool(value)
        except ValueError as e:
            raise RlkitError(f"{where}: {key}={value!r}: {e}") from None
    if tp in (int, float, str):
        try:
            return tp(value)
        except ValueError:
            raise RlkitError(f"{where}: {key}={value!r}: expected a{'n' if tp is int else ''} "
                             f"{tp.__name__}") from None
    raise RlkitError(f"{where}: option {key} is a {getattr(tp, '__name__', tp)}, which --task cannot set "
                     "(only numbers, booleans, text and |-separated lists of them)")


def _config(name: str, opts: dict[str, str]) -> dict[str, Any]:
    """The generator's config keyword arguments from the spec's options, typed by its config dataclass."""
    where = f"--task {NAME}:dataset={name}"
    _, config_cls = library().factory.DATASETS[name]
    fields = {f.name: f for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else {}
    hints = typing.get_type_hints(config_cls) if fields else {}
    out: dict[str, Any] = {}
    for k, v in opts.items():
        if k in ("seed", "size"):
            by = ("the stage's --seed" if k == "seed" else
                  f"how many examples a stage draws: its --num-prompts, sft's --num-examples; the generator makes "
                  f"them in chunks of {CHUNK}")
            raise RlkitError(f"{where}: {k} is set by rlkit ({by}); leave it out")
        if k not in fields:
            known = ", ".join(f for f in fields if f not in ("seed", "size"))
            raise RlkitError(f"unknown option {k!r} for {NAME} dataset {name}; its config takes {known or 'nothing'}"
                             f", and rlkit's own {', '.join(OWN_OPTIONS[1:])}")
        out[k] = _convert(v, hints.get(k, str), k, where)
    return out


def _seed(*parts: object) -> int:
    """A library seed (0 <= seed < 2**31) derived from `parts`: nearby rlkit seeds give unrelated streams (the
    library seeds item i of a dataset with seed + i, so seeds 0 and 1 would share all but one item)."""
    return int.from_bytes(hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=4).digest(), "big") >> 1


def _flag(opts: dict[str, str], key: str, where: str) -> bool:
    try:
        return as_bool(opts.pop(key, "0"))
    except ValueError as e:
        raise RlkitError(f"{where}: {key}: {e}") from None


@dataclass(frozen=True)
class ReasoningGym(TaskBase):
    """`--task reasoning-gym:dataset=NAME,...` (see the module docstring)."""

    name = NAME
    max_new_tokens = MAX_NEW_TOKENS

    dataset: str
    config: tuple[tuple[str, str], ...] = ()  # the generator's options as given (their text), in spec order
    heldout_fraction: float = 0.1
    partial: bool = False
    answer_tags: bool = False

    @classmethod
    def from_options(cls, opts: dict[str, str]) -> ReasoningGym:
        opts = dict(opts)
        where = f"--task {NAME}"
        name = opts.pop("dataset", None)
        rg = library()
        if not name:
            raise RlkitError(f"{where}: which generator? expected dataset=NAME, one of {', '.join(_names())}")
        if name not in rg.factory.DATASETS:
            import difflib

            close = difflib.get_close_matches(name, _names(), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else f"; known: {', '.join(_names())}"
            raise RlkitError(f"{where}: unknown dataset {name!r}{hint}")
        try:
            frac = float(opts.pop("heldout", "0.1"))
        except ValueError:
            raise RlkitError(f"{where}: heldout: expected a fraction, 0 < F < 1") from None
        if not 0 < frac < 1:
            raise RlkitError(f"{where}: heldout={frac:g}: expected 0 < heldout < 1")
        partial, tags = _flag(opts, "partial", where), _flag(opts, "answer_tags", where)
        t = cls(name, tuple(opts.items()), frac, partial, tags)
        t._dataset(0, 0)  # the config checked now, before any stage work: one line if the generator refuses it
        return t

    @property
    def spec(self) -> str:
        parts = [f"dataset={self.dataset}", *(f"{k}={v}" for k, v in self.config), f"heldout={self.heldout_fraction}"]
        parts += ["partial=1"] * self.partial + ["answer_tags=1"] * self.answer_tags
        return f"{NAME}:" + ",".join(parts)

    @property
    def _problems(self) -> str:  # what decides the questions (not partial or answer_tags)
        return ",".join([self.dataset, *(f"{k}={v}" for k, v in self.config), f"heldout={self.heldout_fraction}"])

    @property
    def fingerprint(self) -> str:
        """The library's version (manifests' inputs: a new version's generators may differ)."""
        return f"reasoning-gym=={library_version('reasoning-gym')}"

    def _dataset(self, seed: int, size: int = CHUNK):
        kw = _config(self.dataset, dict(self.config))
        try:
            return library().create_dataset(self.dataset, size=max(size, 1), seed=seed, **kw)
        except RlkitError:
            raise
        except Exception as e:
            from rlkit.plugins.user_code import one_line

            given = ",".join(f"{k}={v}" for k, v in self.config)
            raise RlkitError(f"--task {NAME}:dataset={self.dataset}{',' + given if given else ''}: the generator "
                             f"refused its config: {one_line(e)}") from None

    def _entries(self, split: str, seed: int) -> Iterator[dict]:
        for chunk in itertools.count():
            yield from self._dataset(_seed(self._problems, split, seed, chunk))

    def draws(self, rng, split: str, seed: int) -> Iterator[tuple[str, dict]]:  # noqa: ARG002 (seeded by _seed)
        """The generator's entries, keyed by their question (which splits them; see the module docstring)."""
        for entry in self._entries(split, seed):
            yield entry["question"], entry

    def verifier_sample(self, n: int) -> list[Example]:
        """The verifier check's sample (`rlkit.tasks.trust`): the distinct questions of one small dataset of the
        generator at a fixed library seed, its first `n` distinct questions (of 4n entries at most), not a whole
        chunk of `CHUNK`: some generators take a tenth of a second an entry."""
        seen: dict[str, Example] = {}
        for i, entry in enumerate(self._dataset(_seed(self._problems, "verifier-check"), 4 * n)):
            prompt, answer = self.make(entry)
            seen.setdefault(prompt, Example(f"check-{i}", prompt, answer, "train"))
            if len(seen) == n:
                break
        return list(seen.values())

    def make(self, entry: dict) -> tuple[str, str]:
        return self.prompt(entry["question"]), encode_entry(entry)

    def exhausted(self, split: str, i: int) -> str:
        return (f"task {self.spec}: ran out of distinct {split} questions after {i}; ask for fewer or widen the "
                "generator's config")

    def prompt(self, question: str) -> str:
        return (TAGS_INSTRUCTION if self.answer_tags else "") + PROMPT.format(question=question)

    def _entry(self, answer: str) -> dict:
        """The row's entry; an answer that is not one (a prompts file of plain answers) is one line."""
        try:
            entry = decode_entry(answer)
        except (TypeError, ValueError):
            entry = None
        if not isinstance(entry, dict) or "question" not in entry:
            raise RlkitError(f"task {NAME}: the row's answer {str(answer)[:60]!r} is not a reasoning-gym entry (the JSON "
                             "of its question, answer and metadata that the task's own prompts carry); score such "
                             "rows with the task they came from")
        return entry

    def completion(self, ex: Example) -> str:
        gold = self._entry(ex.answer).get("answer")
        if gold is None:
            raise RlkitError(f"task {self.spec}: generator {self.dataset} has no single gold answer (its scorer "
                             "checks each solution), so it has no SFT targets; train on it with rollout/update only")
        return f" <answer>{gold}</answer>" if self.answer_tags else f" {gold}"

    def _score(self, response: str, answer: str) -> tuple[float, str]:
        entry = self._entry(answer)
        if self.answer_tags:
            from reasoning_gym.utils import extract_answer

            got = extract_answer(response)
            if got is None:
                return 0.0, "no_answer_tags"
        else:
            got = response.strip()
        try:
            with contextlib.redirect_stdout(sys.stderr):  # a scorer's prints (tower_of_hanoi's) never reach stdout
                s = float(_scorer(entry.get("metadata", {}).get("source_dataset", self.dataset))(got, entry))
        except Exception:
            return 0.0, "scorer_error"
        if not s == s or s <= 0:  # NaN or nothing
            return 0.0, "wrong_answer"
        if s >= 1.0:
            return 1.0, PASSED
        return (s if self.partial else 0.0), "partial"

    def reward(self, response: str, answer: str) -> float:
        return self._score(response, answer)[0]

    def score_batch(self, responses: list[str], answers: list[str], sandbox=None) -> Scores:  # noqa: ARG002
        out = [self._score(r, a) for r, a in zip(responses, answers, strict=True)]
        return Scores([v for v, _ in out], [why for _, why in out])
