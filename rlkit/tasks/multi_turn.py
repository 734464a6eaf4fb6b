"""What the reward sources read of a multi-turn row, and the rewards of a trajectory (`rollout --env`).

A multi-turn row holds a trajectory: the model's turns and the environment's text between them (tool results,
feedback). Every scorer of the row (a task's verifier, a reward model, an LLM judge, a reward function) reads one
text of it, named by a reading (`READINGS`):

  final          the trajectory's final model turn, decoded as sampled (the last assistant message); every row of
                 a trajectory the chat template cut (`end_reason` continued) reads the trajectory's final turn
  model          the row's own model turns, their texts joined as sampled, without the environment's text
  conversation   the whole row as the model saw it: the completion's text, the environment's text included (a
                 reward model or judge reads it after the prompt; a reward function also has the row's `messages`)

On a single-turn row (a table without `messages`) the three are the same text, its completion. Defaults
(`default_reads`): a task's verifier reads `final` (a task class may declare its own with a `reads` attribute),
reward models, judges and reward functions read `conversation`; `--reads NAME=READING` (rollout, score-ref) sets
one component's (`parse_reads`). The stages record each component's reading in their manifests.

A trajectory that an environment error ended (`end_reason` "error: ...", `--env-errors end`) gets 0 from every
scorer, with the verdict `env_error` where the scorer gives verdicts: its rows are not scored (`ended_by_error`).
Its `reward/env` and `token_rewards` are 0 too (the sampling driver's).

Per-turn credit: `turn_token_rewards` writes each step's reward at its turn's last sampled token, the
`token_rewards` column a rollout with an environment writes as a share of `reward/env`
(`rlkit.io.schemas.token_rewards_field("env")`), so PPO's GAE credits each turn and no reward counts twice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from rlkit.errors import RlkitError

READINGS = {"final": "the final model turn", "model": "the model's turns", "conversation": "the whole conversation"}
ENV_ERROR = "env_error"  # the verdict of a row an environment error ended


def default_reads(task=None) -> str:
    """The verifier's reading: the task's declared `reads`, else `final`; reward models, judges and reward functions
    read `conversation`."""
    reads = getattr(task, "reads", None) if task is not None else "conversation"
    if reads is None:
        return "final"
    if reads not in READINGS:
        raise RlkitError(f"task {getattr(task, 'name', task)}: reads = {reads!r}; expected one of {', '.join(READINGS)}")
    return reads


def parse_reads(specs: Sequence[str], defaults: Mapping[str, str], stage: str) -> dict[str, str]:
    """`--reads NAME=READING` (repeatable) over `defaults` (component -> its default reading) -> the reading of
    every component the stage scores. One line for a bad spec, an unknown reading or a component not scored here."""
    out = dict(defaults)
    for spec in specs:
        name, eq, reading = (x.strip() for x in spec.partition("="))
        if not eq or not name:
            raise RlkitError(f"--reads {spec!r}: expected NAME=READING, e.g. verifier=final")
        if reading not in READINGS:
            raise RlkitError(f"--reads {spec!r}: {reading!r} is not a reading; expected one of {', '.join(READINGS)}")
        if name not in defaults:
            scored = ", ".join(defaults) or "none"
            raise RlkitError(f"--reads {spec!r}: {stage} scores no reward component {name!r} here (it scores: "
                             f"{scored})")
        out[name] = reading
    return out


def columns(batch) -> dict[str, list]:
    """The columns of an Arrow record batch (or table) the readings and `ended_by_error` use, as Python lists."""
    names = batch.schema.names
    want = ("completion", "messages", "turns", "end_reason", "group_id", "sample_idx")
    return {c: batch.column(c).to_pylist() for c in want if c in names}


def trajectory_ends(cols: Mapping[str, Sequence]) -> list[int]:
    """Each row's trajectory's last row among `cols`' rows: a trajectory the chat template cut is consecutive rows,
    all but the last `continued` (`rlkit.sampling.driver`); a row whose trajectory goes on past `cols` is its own."""
    n = len(cols["completion"])
    ends = list(range(n))
    reasons = cols.get("end_reason")
    if reasons is None:
        return ends
    keys = [tuple(cols[k][i] if k in cols else None for k in ("group_id", "sample_idx")) for i in range(n)]
    for i in reversed(range(n - 1)):
        if reasons[i] == "continued" and keys[i] == keys[i + 1]:
            ends[i] = ends[i + 1]
    return ends


def _assistant(msgs) -> list[str]:
    return [m["content"] for m in msgs or () if m.get("role") == "assistant"]


def texts(reading: str, cols: Mapping[str, Sequence]) -> list[str]:
    """The text each row of `cols` (column -> values: `completion`, and `messages`, `turns`, `end_reason`,
    `group_id`, `sample_idx` when the rows are multi-turn) gives a scorer that reads `reading`."""
    comps = list(cols["completion"])
    msgs = cols.get("messages")
    if reading == "conversation" or msgs is None:
        return comps
    if reading == "final":
        ends = trajectory_ends(cols)
        return [c if msgs[e] is None else (_assistant(msgs[e]) or [""])[-1] for c, e in zip(comps, ends, strict=True)]
    turns = cols.get("turns") or [None] * len(comps)
    out = []
    for c, m, k in zip(comps, msgs, turns, strict=True):
        if m is None:
            out.append(c)
            continue
        said = _assistant(m)  # the row's own turns are the last `turns` of the conversation so far
        out.append("".join(said if k is None else said[max(0, len(said) - k):] if k else []))
    return out


def ended_by_error(cols: Mapping[str, Sequence]) -> list[bool]:
    """Whether each row's trajectory was ended by an environment error (`--env-errors end`): such rows are not
    scored, every reward component 0."""
    reasons = cols.get("end_reason")
    if reasons is None:
        return [False] * len(cols["completion"])
    return [isinstance(reasons[e], str) and reasons[e].startswith("error:") for e in trajectory_ends(cols)]


def score_kept(skip: Sequence[bool], score: Callable[[list[int]], Sequence], fill) -> list:
    """`score(rows)` on the rows not skipped (their indices, in order), `fill` at the skipped ones; `score` is not
    called when every row is skipped."""
    keep = [i for i, s in enumerate(skip) if not s]
    values = list(score(keep)) if keep else []
    out = [fill] * len(skip)
    for i, v in zip(keep, values, strict=True):
        out[i] = v
    return out


def subset(cols: Mapping[str, Sequence], rows: Sequence[int]) -> dict[str, list]:
    """`cols` restricted to `rows`."""
    return {k: [v[i] for i in rows] for k, v in cols.items()}


def turn_token_rewards(n_tokens: int, ends: Sequence[int], rewards: Sequence[float]) -> list[float]:
    """One value a completion token: step k's reward at its turn's last sampled token (`ends[k]`), 0.0 elsewhere
    (a turn without a token places nothing: its reward stays in the row's last token's share)."""
    out = [0.0] * n_tokens
    for e, r in zip(ends, rewards, strict=False):
        if 0 <= e < n_tokens:
            out[e] += float(r)
    return out
