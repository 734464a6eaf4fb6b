"""The verifier check: before a stage rewards or trains with a task's verifier, it tries the verifier on a small,
fixed sample of the task's own examples (`check_verifier`), so a verifier that pays anything, or rejects its own
gold answers, is found before the first sample is drawn.

The sample: the first `SAMPLE` distinct train examples (prompt and gold answer) at seed 0 (the held-out split's when
the task has no train examples; `CODE_SAMPLE` for a task whose verifier runs programs in the sandbox; a task's own
`verifier_sample(n)` when it has one: reasoning-gym's is one small dataset at a fixed library seed), the same for
every stage and seed. On each example the verifier scores, at once (one `verify` batch):

- the gold answer: the task's SFT target (`completion(example)`), which must score full marks (1.0);
- junk, which must not: the empty answer, a nonsense word (`NONSENSE`), and another example's gold answer: the
  next sampled example whose target and gold answer both differ from this one's as text, after normalisation
  (whitespace collapsed, case folded; an example whose every other target is the same text gets none).

"Full marks" is a reward of 1.0 or more: a verifier's partial credit (the code task's `reward=fraction`, a
reasoning-gym `partial=1`) is not a payment. Examples without a gold answer (a reasoning-gym generator whose scorer
checks each solution, a code problem without a reference solution) are skipped for the gold answer and the other
example's gold, and still get the empty answer and the nonsense word; a task with no example at all is skipped
with the reason. A task whose SFT targets are demonstrations, not gold answers (`guess`'s noisy player, who may
lose), says so with `targets_are_gold = False`: its targets are not held to full marks, nor tried on another
example (a demonstration may win another game).

The outcome (`Outcome`): junk paid is refused in one line naming the task, the junk and the example
(`UntrustedVerifier`, exit 65) unless the stage's `--trust-verifier`; gold answers rejected are a warning line
with their count and one example (and `sft` refuses to train on them, `--rejected-targets`). The stages record the
outcome in their manifests (`verifier_check`).
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlkit.errors import EmptySplit, RlkitError, UntrustedVerifier

SAMPLE = 8  # examples a verifier is checked on
CODE_SAMPLE = 2  # ... when it runs programs in the sandbox (each answer is a sandboxed program)
DRAWS = 4  # draws per sampled example at most, to find SAMPLE distinct prompts
SEED = 0
NONSENSE = "xyzzy"
FULL = 1.0  # full marks


def _norm(text: str) -> str:
    return " ".join(str(text).split()).casefold()


@dataclass(frozen=True)
class Paid:
    """A junk answer the verifier gave full marks: what junk, its text, the example's prompt, the reward."""

    junk: str
    text: str
    prompt: str
    reward: float


@dataclass(frozen=True)
class Outcome:
    """What `check_verifier` found on a task's sample."""

    task: str
    examples: int = 0
    golds: int = 0  # gold answers scored
    rejected: int = 0  # ... of them below full marks
    rejected_example: tuple[str, str, float] | None = None  # (prompt, gold, reward)
    paid: tuple[Paid, ...] = ()
    skipped: str | None = None  # why the check did not run
    notes: tuple[str, ...] = ()  # what was left out of it, and why
    seconds: float = 0.0
    trusted: bool = field(default=False)  # --trust-verifier accepted the junk it paid

    def entry(self) -> dict:
        """The manifest's `verifier_check`."""
        if self.skipped:
            return {"skipped": self.skipped}
        out = {"examples": self.examples, "gold_scored": self.golds, "gold_rejected": self.rejected,
               "junk_paid": [{"junk": p.junk, "answer": p.text, "prompt": p.prompt[:200]} for p in self.paid]}
        if self.paid:
            out["trusted_anyway"] = self.trusted
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    def summary(self) -> str:
        """The outcome in a few words (eval's table)."""
        if self.skipped:
            return f"skipped: {self.skipped}"
        gold = (f"{self.golds - self.rejected} of {self.golds} gold answers pass" if self.golds else
                "no gold answers to try")
        junk = (f"junk paid {len(self.paid)} times (--trust-verifier)" if self.paid else "no junk paid")
        return f"{self.examples} examples: {gold}, {junk}"

    def refusal(self, stage: str) -> str:
        """The one line of a verifier that pays junk."""
        p = self.paid[0]
        more = f" (and {len(self.paid) - 1} more junk answers)" if len(self.paid) > 1 else ""
        return (f"{stage}: task {self.task}'s verifier pays junk: {p.junk} {p.text!r} scored {p.reward:g} on the "
                f"example {_short(p.prompt)!r}{more}; a reward it pays to anything teaches nothing. Fix the verifier, "
                "or pass --trust-verifier to use it anyway")

    def rejection(self, stage: str) -> str:
        """The warning line of gold answers the verifier rejects."""
        prompt, gold, reward = self.rejected_example
        return (f"{stage}: task {self.task}'s verifier rejects {self.rejected} of its {self.golds} sampled gold "
                f"answers, e.g. {_short(gold)!r} scored {reward:g} on {_short(prompt)!r}")


def _short(text: str, n: int = 80) -> str:
    text = re.sub(r"\s+", " ", str(text))  # one line, each run of whitespace one space
    return text if len(text) <= n else text[:n - 3] + "..."


def _sample(task, n: int) -> list:
    """The first `n` distinct examples (prompt and answer) of the task's train split at seed 0 (the held-out split's when the
    train split has none), drawing at most DRAWS * n."""
    from rlkit.tasks.base import SPLITS

    own = getattr(task, "verifier_sample", None)  # a task that makes a small sample cheaper than its stream's
    if callable(own):
        return list(own(n))
    for split in SPLITS:
        try:
            drawn = list(itertools.islice(task.iter_examples(split, SEED), DRAWS * n))
        except EmptySplit:  # skipped; any other error (a data file that cannot be read) is the stage's own, said
            continue  # once, not a skipped check
        seen: dict[tuple[str, str], object] = {}
        for ex in drawn:
            seen.setdefault((ex.prompt, ex.answer), ex)
        if seen:
            return list(seen.values())[:n]
    return []


def _gold(task, ex) -> tuple[str | None, str | None]:
    """(the example's gold answer, as a response, or None; why none)."""
    try:
        return str(task.completion(ex)), None
    except RlkitError as e:
        return None, str(e)


def check_verifier(task, sandbox=None) -> Outcome:
    """The verifier check of `task` (see the module docstring); `sandbox`: where a code task's programs run."""
    from rlkit.tasks.base import verify

    t0 = time.perf_counter()
    name = getattr(task, "spec", None) or getattr(task, "name", str(task))
    runs_code = getattr(task, "runs_code", False) is True
    examples = _sample(task, CODE_SAMPLE if runs_code else SAMPLE)
    if not examples:
        return Outcome(name, skipped="the task gave no example to check its verifier on")
    golds, notes = [], []
    for ex in examples:
        g, why = _gold(task, ex)
        golds.append(g)
        if g is None and f"no gold answer: {why}" not in notes:
            notes.append(f"no gold answer: {why}")
    gold_counts = getattr(task, "targets_are_gold", True) is not False
    rows: list[tuple[str, str, object]] = []  # (what, response, example)
    for i, (ex, g) in enumerate(zip(examples, golds, strict=True)):
        if g is not None:
            rows.append(("gold", g, ex))
        rows += [("the empty answer", "", ex), ("the nonsense word", NONSENSE, ex)]
        other = _other_gold(examples, golds, i) if gold_counts else None  # a demonstration may win another's game
        if other is not None:
            rows.append(("another example's gold answer", other, ex))
    scores = verify(task, [r for _, r, _ in rows], [ex.answer for _, _, ex in rows], sandbox).values
    scored = rejected = 0
    first = None
    paid = []
    for (what, response, ex), s in zip(rows, scores, strict=True):
        if what == "gold":
            if not gold_counts:
                continue
            scored += 1
            if not s >= FULL:
                rejected += 1
                first = first or (ex.prompt, response, s)
        elif s >= FULL:
            paid.append(Paid(what, response, ex.prompt, s))
    if not gold_counts:
        notes.append("its SFT targets are demonstrations, not gold answers: not held to full marks")
    return Outcome(name, len(examples), scored, rejected, first, tuple(paid), notes=tuple(notes),
                   seconds=time.perf_counter() - t0)


def _other_gold(examples: Sequence, golds: Sequence[str | None], i: int) -> str | None:
    """The gold answer of the next sampled example (cyclically) whose target and gold answer differ from example
    i's as text after normalisation; None when there is none (or example i has no gold)."""
    if golds[i] is None:
        return None
    n = len(examples)
    for k in range(1, n):
        j = (i + k) % n
        g = golds[j]
        if g is not None and _norm(g) != _norm(golds[i]) and _norm(examples[j].answer) != _norm(examples[i].answer):
            return g
    return None


def trusted(task, stage: str, *, sandbox=None, trust: bool = False) -> Outcome:
    """The check a stage runs once, before any model loads: refuses (`UntrustedVerifier`) a verifier that pays junk
    unless `trust` (--trust-verifier: then one warning line), warns of gold answers it rejects, and says what it
    skipped. Returns the outcome, for the manifest."""
    from rlkit import console

    out = check_verifier(task, sandbox)
    if out.skipped:
        console.info(f"{stage}: verifier check of task {out.task} skipped: {out.skipped}")
        return out
    if out.paid:
        if not trust:
            raise UntrustedVerifier(out.refusal(stage))
        console.warn(out.refusal(stage).split("; a reward")[0] + "; used anyway (--trust-verifier)")
        out = Outcome(**{**out.__dict__, "trusted": True})
    if out.rejected:
        console.warn(out.rejection(stage))
    return out


@dataclass(frozen=True)
class Targets:
    """What sft's target check found: the rows to train on (their indices), and the figures the manifest keeps."""

    keep: list[int]
    entry: dict


def check_targets(task, examples: Sequence, completions: Sequence[str], mode: str, sample: Outcome | None,
                  sandbox=None, stage: str = "sft") -> Targets:
    """sft's targets against the task's own verifier: every distinct (target, gold answer) pair is scored (a task
    whose verifier runs programs: only when the verifier check's `sample` found a gold answer it rejects, since each
    is a sandboxed program), and the rows whose target scores below full marks are, by `mode` (--rejected-targets),
    refused (`UntrustedVerifier`), dropped (one line) or kept (a warning line)."""
    from rlkit import console
    from rlkit.tasks.base import verify

    rows = list(range(len(examples)))
    if getattr(task, "targets_are_gold", True) is False:
        return Targets(rows, {"checked": False, "why": "the task's targets are demonstrations, not gold answers"})
    if getattr(task, "runs_code", False) is True and not (sample is not None and sample.rejected):
        return Targets(rows, {"checked": False, "why": "a verifier that runs programs: the sample's gold answers "
                                                     "all passed"})
    pairs: dict[tuple[str, str], int] = {}
    for ex, c in zip(examples, completions, strict=True):
        pairs.setdefault((str(c), ex.answer), len(pairs))
    keys = list(pairs)
    values = verify(task, [c for c, _ in keys], [a for _, a in keys], sandbox).values
    bad = {k for k, v in zip(keys, values, strict=True) if not v >= FULL}
    dropped = [i for i, (ex, c) in enumerate(zip(examples, completions, strict=True)) if (str(c), ex.answer) in bad]
    entry = {"checked": True, "distinct": len(keys), "rejected": len(bad), "rows_rejected": len(dropped),
             "action": mode}
    if not bad:
        return Targets(rows, entry)
    i = dropped[0]
    shown = f"e.g. {_short(completions[i])!r} scored {values[pairs[(str(completions[i]), examples[i].answer)]]:g} " \
            f"on {_short(examples[i].prompt)!r}"
    line = (f"{stage}: task {getattr(task, 'spec', None) or task.name}'s verifier rejects {len(bad)} of its {len(keys)} distinct "
            f"SFT targets ({len(dropped)} of the {len(rows)} training rows), {shown}")
    if mode == "refuse":
        raise UntrustedVerifier(f"{line}; training on them teaches answers the verifier then marks wrong: pass "
                                "--rejected-targets drop to train without them, or keep to train on them anyway")
    if mode == "drop":
        console.warn(f"{line}: those rows are left out (--rejected-targets drop)")
        gone = set(dropped)
        return Targets([r for r in rows if r not in gone], entry)
    console.warn(f"{line}: trained on anyway (--rejected-targets keep)")
    return Targets(rows, entry)


def sft_targets(task, cfg, sandbox=None, own: bool = True) -> tuple[list | None, list | None, dict]:
    """sft's checks (`cfg`: its config): the verifier check of `task` (`trusted`; none without a task), and when sft
    trains on the task's own targets (`own`; not on --data) its first --num-examples train examples and their
    targets, checked against the verifier (`check_targets`, by --rejected-targets). -> (the examples and targets
    kept, None when not `own`; the manifest's entries: `verifier_check`)."""
    if task is None:
        return None, None, {}
    sample = trusted(task, "sft", sandbox=sandbox, trust=cfg.trust_verifier)
    if not own:
        return None, None, {"verifier_check": sample.entry()}
    examples = task.examples("train", cfg.num_examples, cfg.seed)
    completions = [task.completion(e) for e in examples]
    targets = check_targets(task, examples, completions, cfg.rejected_targets, sample, sandbox)
    return ([examples[i] for i in targets.keep], [completions[i] for i in targets.keep],
            {"verifier_check": {**sample.entry(), "targets": targets.entry}})
