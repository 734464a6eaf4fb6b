"""The scorer protocol: every source score-ref adds to a table (the reference's and a teacher's per-token
log-probs, reward models, LLM judges, reward functions) is a `Scorer`, and the rules they share are written once
here: a column the input already has (`clash`), the manifest's entries and input fingerprints (`manifest_entries`,
`inputs`), a model that is the sampling policy itself (`refuse_the_policy`), the columns written (`fields`) and
closing (`close_all`).

A scorer is built and checked (directories, hashes, rubrics, tokenizers) before any weights load; `load()` puts its
model on the device when the first batch has come; `score(rows)` returns its columns for a batch (`Rows`: the
record batch, its first row's number in the output, and each row's text under a reading of a multi-turn row).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from rlkit.errors import RlkitError


class Rows:
    """A record batch as the scorers read it: its columns, the row number its first row has in the output (`row0`,
    for messages), each row's text under a reading (`texts`, `rlkit.tasks.multi_turn`) and the rows of a
    trajectory an environment error ended (`skip`: those are not scored, every component 0)."""

    def __init__(self, batch, row0: int = 0) -> None:
        self.batch, self.row0 = batch, row0

    @cached_property
    def prompts(self) -> list[str]:
        return self.batch.column("prompt").to_pylist()

    @cached_property
    def turns(self) -> dict[str, list]:
        from rlkit.tasks import multi_turn

        return multi_turn.columns(self.batch)

    @cached_property
    def skip(self) -> list[bool]:
        from rlkit.tasks import multi_turn

        return multi_turn.ended_by_error(self.turns)

    def texts(self, reading: str | None) -> list[str]:
        from rlkit.tasks import multi_turn

        return multi_turn.texts(reading or "conversation", self.turns)

    def kept(self, score, fill=0.0) -> list:
        """`score(rows)` on the rows not skipped (their indices), `fill` at the others (`multi_turn.score_kept`)."""
        from rlkit.tasks import multi_turn

        return multi_turn.score_kept(self.skip, score, fill)


class Scorer:
    """One source of columns. Subclasses set the attributes and override what they do."""

    name: str | None = None  # the reward component it adds (reward/NAME), None for per-token log-probs
    column: str = ""  # the column that is its own: an input holding it already is refused (`clash`)
    what: str = ""  # what its error lines call it: 'reference runs/ref', 'teacher runs/t', 'judge j runs/j'
    said: str = ""  # what the stage's closing line calls it: 'runs/ref', 'judge j (runs/j)', 'rm:x (runs/rm)'
    kind: str = ""  # the clash line's word for it: reward model, --judge, --reward-fn
    model_dir: Path | None = None  # the model it loads (for the memory plan), None: none
    lm: bool = False  # a causal LM (the reference, a teacher, a judge): planned and named before the others
    reads: str | None = None  # the reading of a row's text it scores (`--reads`), None: the completion's tokens
    fingerprint: str | None = None  # its weights' fingerprint, where it may not be the policy itself
    refusal: str | None = None  # why it may not be the sampling policy (a judge, a teacher); None: it may

    def fields(self) -> list:
        """The columns it writes, as pyarrow fields (its `column` first)."""
        import pyarrow as pa

        return [pa.field(self.column, pa.float64())]

    def inputs(self) -> dict[str, str]:
        """Its input fingerprints for the manifest: editing its files reruns the stage."""
        return {}

    def manifest_entry(self) -> dict:
        """Its entry in the output's manifest: {key: value}, a dict value merged with the other scorers' of the
        same key (reward_models, reward_fns, judges)."""
        return {}

    def check_upstream(self, upstream) -> None:
        """One line when the rows' producer (the input's manifest record) is not something it can score."""

    def clash(self, reader) -> str | None:
        """The line refusing an input that already has its column, else None."""
        if self.column in reader.schema.names:
            return f"the input already has reward component {self.name!r}; name this {self.kind} differently"
        return None

    def load(self) -> None:
        """Put its model on the device (once); nothing for a scorer without one."""

    def score(self, rows: Rows) -> dict:
        """Its columns for `rows`: {column name: pyarrow array}."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop what it started (an engine, sandboxed workers)."""


def fields(scorers: Sequence[Scorer]) -> list:
    """The columns the scorers write, in their order, every judge's verdict after the rewards."""
    out = [f for s in scorers for f in s.fields()]
    return sorted(out, key=lambda f: f.name.startswith("verdict/"))


def inputs(scorers: Sequence[Scorer]) -> dict[str, str]:
    return {k: v for s in scorers for k, v in s.inputs().items()}


def manifest_entries(scorers: Sequence[Scorer]) -> dict:
    """The manifest's entries of `scorers` (`reward_models` and `reward_fns` always, empty when none)."""
    out: dict = {"reward_models": {}, "reward_fns": {}}
    for s in scorers:
        for key, value in s.manifest_entry().items():
            if isinstance(value, dict) and key in ("reward_models", "reward_fns", "judges"):
                out.setdefault(key, {}).update(value)
            else:
                out[key] = value
    return out


def clash(scorers: Sequence[Scorer], reader) -> None:
    """One line for the first scorer whose column the input (`reader`) already has."""
    for s in scorers:
        line = s.clash(reader)
        if line is not None:
            raise RlkitError(line)


def refuse_the_policy(scorers: Sequence[Scorer], policies: set, whose: str = "the policy that sampled these rollouts"
                      ) -> None:
    """A judge or a teacher that is a policy that sampled the rows (`policies`, fingerprints): one line
    (`fingerprints.refuse_policy_itself`). A policy as its own judge rewards its own mistakes; as its own teacher it
    has nothing to learn (teacher_kl 0). Judges are asked first."""
    from rlkit.io.fingerprints import refuse_policy_itself

    for s in sorted((s for s in scorers if s.refusal), key=lambda s: not s.name):
        refuse_policy_itself(s.what, s.fingerprint, policies, whose, s.refusal)


def refuse_the_sampler(scorers: Sequence[Scorer], upstream) -> None:
    """`refuse_the_policy` for the policy the input's manifest (`upstream`) names as its sampler: the fingerprint
    it recorded, and the directory's own where it is here."""
    from rlkit.io import fingerprints

    if any(s.refusal for s in scorers):
        sampler = upstream.sampling.get("policy")
        refuse_the_policy(scorers, {upstream.inputs.get("policy"),
                                    *([fingerprints.fingerprint(Path(sampler))]
                                      if isinstance(sampler, str) and Path(sampler).is_dir() else [])})


def close_all(scorers: Sequence[Scorer]) -> None:
    """Close every scorer, also after an error."""
    for s in scorers:
        s.close()
