"""Table kinds: the versioned Arrow schema of every table rlkit writes (its kind, version and producing command),
and the check a reader runs on a table's schema.

Multi-turn columns (`MULTI_TURN_FIELDS`: `loss_mask`, `turns`, `turn_rewards`, `terminated`, `truncated`,
`end_reason`, `tool_calls`, `messages`) are not among a kind's always-written optional columns: a writer adds
them as `extra` fields when it has them (rollout sampling with an environment; score-ref carrying them
through), so a single-turn table holds exactly the columns it always held, byte for byte. Rollouts and scored
tables `accept` them: a reader checks their types when they are present, and a table without them is
single-turn (a missing `loss_mask`, or a null row of it, means every completion token was sampled).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.ipc

from rlkit.errors import RlkitError

SCHEMA_KEY = b"rlkit"


END_KEY = "rlkit.end"


_STR = pa.string()


_IDS = pa.list_(pa.int32())


_LOGPROBS = pa.list_(pa.float32())


_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def _f(name: str, typ: pa.DataType, nullable: bool = False) -> pa.Field:
    return pa.field(name, typ, nullable=nullable)


@dataclass(frozen=True)
class TableKind:
    """One table kind: its versioned schema and the command that produces it.

    Written tables carry every field (optional ones as nullable columns); readers require only
    `fields`, so plain tables made by other tools need just the columns a stage uses.
    ``prefixes`` are families of dynamic columns, e.g. ``reward/<component>`` (float64), so that
    verifier and reward-model scores travel as named components side by side, and ``verdict/<component>``
    (string), a verifier's reason for each reward.
    """

    name: str
    version: int
    fields: tuple[pa.Field, ...]
    producer: str
    optional: tuple[pa.Field, ...] = ()
    prefixes: tuple[tuple[str, pa.DataType], ...] = ()
    # columns a writer adds only when it has them (as `extra`); a reader checks their types when present
    accepted: tuple[pa.Field, ...] = ()

    def schema(self, extra: Sequence[pa.Field] = (), manifest: Mapping[str, Any] | None = None) -> pa.Schema:
        meta = {SCHEMA_KEY: json.dumps(manifest, sort_keys=True).encode()} if manifest else None
        return pa.schema([*self.fields, *self.optional, *extra], metadata=meta)


_ROLLOUT_FIELDS = (
    _f("prompt_id", _STR),
    _f("group_id", pa.int64()),
    _f("sample_idx", pa.int32()),
    _f("prompt", _STR),
    _f("completion", _STR),
    _f("prompt_ids", _IDS),
    _f("completion_ids", _IDS),
    _f("old_logprobs", _LOGPROBS),
    _f("finish_reason", _STR),
    _f("policy_fingerprint", _STR),
    _f("policy_step", pa.int64()),
)


_ROLLOUT_OPTIONAL = (_f("answer", _STR, True),)


# A multi-turn trajectory's columns (rollout with an environment), written only when present (see the module
# docstring). `loss_mask`: one entry per completion token, 1 where the policy sampled it (trained on), 0 where
# the environment appended it (tool results, feedback: in the context, never in the loss; old_logprobs 0.0
# there); `turns`: model turns; `turn_rewards`: each step's reward (their sum is `reward/env`); `end_reason`:
# why it ended ("terminated", "max_turns", "max_total_tokens", "length", "error: ..."); `messages`: the
# conversation, for reading.
MULTI_TURN_FIELDS = (
    _f("loss_mask", pa.list_(pa.int8()), True),
    _f("turns", pa.int32(), True),
    _f("turn_rewards", pa.list_(pa.float64()), True),
    _f("terminated", pa.bool_(), True),
    _f("truncated", pa.bool_(), True),
    _f("end_reason", _STR, True),
    _f("tool_calls", pa.int32(), True),
    # each observation appended to the row, in order: its tokens before the --max-env-tokens cut (`inspect` marks a cut)
    _f("observation_tokens", pa.list_(pa.int32()), True),
    _f("messages", _MESSAGES, True),
)


MULTI_TURN_NAMES = frozenset(f.name for f in MULTI_TURN_FIELDS)


# Per-token signals beside the completion tokens, written only when present, one entry a completion token:
# `teacher_logprobs`, a teacher's log-prob of each token (`score-ref --teacher`, on-policy distillation);
# `token_rewards`, a reward on each token (a process reward, a per-turn reward at its turn's last token), which
# `update` counts as the reward component `token_rewards` (its sum) and PPO places at its tokens; unless the
# field's metadata names a reward component it belongs to (`PART_OF_KEY`, see `token_rewards_part_of`).
TOKEN_FIELDS = (
    _f("teacher_logprobs", _LOGPROBS, True),
    _f("token_rewards", _LOGPROBS, True),
)


TOKEN_NAMES = frozenset(f.name for f in TOKEN_FIELDS)


# The metadata key of a `token_rewards` field whose values are one reward component spread over its tokens, not a
# component of their own: `rollout --env` writes each step's reward at its turn's last sampled token, and their
# sum is (part of) `reward/env`. The field travels with its metadata through score-ref, cat and the spool.
PART_OF_KEY = b"rlkit.part_of"


def token_rewards_field(part_of: str | None = None) -> pa.Field:
    """The `token_rewards` field; `part_of`: the reward component its values are a share of (`reward/<part_of>`
    holds their row sums and more), so `update` counts them inside that component and never twice."""
    f = _f("token_rewards", _LOGPROBS, True)
    return f.with_metadata({PART_OF_KEY: part_of.encode()}) if part_of else f


def token_rewards_part_of(schema: pa.Schema) -> str | None:
    """The reward component a table's `token_rewards` are a share of (None: they are a component of their own,
    `token_rewards`, or the table has none)."""
    idx = schema.get_field_index("token_rewards")
    meta = schema.field(idx).metadata if idx >= 0 else None
    value = (meta or {}).get(PART_OF_KEY)
    return value.decode() if value else None


# `rollout --min-informative-groups` (DAPO's dynamic sampling): on every row of a group written, the prompts drawn
# for it: itself and the uninformative ones dropped since the group written before it (when the cap fills the batch
# up with uninformative groups, the first of them also those sampled after the last informative one), so their sum
# over a batch's groups is the prompts it sampled up to its last group (those its last chunk sampled after the
# batch was full are dropped, in no group: rollout's closing line counts them).
REFILL_FIELDS = (_f("prompts_drawn", pa.int32(), True),)


# the columns score-ref carries through as they are, beside reward/* and verdict/*
CARRIED_NAMES = MULTI_TURN_NAMES | TOKEN_NAMES | frozenset(f.name for f in REFILL_FIELDS)


# reward/<component>: each reward component's value; verdict/<component>: why a verifier gave it (the code
# task's `passed`, `wrong_answer`, `timeout`, ...), carried beside it to score-ref's table and update's metrics
_REWARDS = (("reward/", pa.float64()), ("verdict/", pa.string()))


KINDS: dict[str, TableKind] = {
    k.name: k
    for k in (
        TableKind(
            "prompts", 1, (_f("prompt_id", _STR), _f("prompt", _STR)), "rlkit prompts",
            optional=(_f("answer", _STR, True), _f("split", _STR, True), _f("messages", _MESSAGES, True)),
        ),
        TableKind(
            "sft", 1, (_f("prompt", _STR), _f("completion", _STR)), "rlkit prompts --sft",
            optional=(_f("prompt_id", _STR, True), _f("split", _STR, True), _f("messages", _MESSAGES, True)),
        ),
        TableKind(
            "prefs", 1,
            (_f("prompt_id", _STR), _f("prompt", _STR), _f("chosen", _STR), _f("rejected", _STR), _f("split", _STR)),
            "rlkit build-prefs",
            optional=(_f("answer", _STR, True), _f("negative", _STR, True),
                      # summed reference log-probs of each response, added by `rlkit score-ref --ref` (DPO)
                      _f("ref_chosen_logp", pa.float64(), True), _f("ref_rejected_logp", pa.float64(), True)),
        ),
        TableKind("rollouts", 1, _ROLLOUT_FIELDS, "rlkit rollout", optional=_ROLLOUT_OPTIONAL, prefixes=_REWARDS,
                  accepted=(*MULTI_TURN_FIELDS, *TOKEN_FIELDS, *REFILL_FIELDS)),
        TableKind(
            "scored", 1, (*_ROLLOUT_FIELDS, _f("ref_logprobs", _LOGPROBS)), "rlkit score-ref",
            optional=_ROLLOUT_OPTIONAL, prefixes=_REWARDS, accepted=(*MULTI_TURN_FIELDS, *TOKEN_FIELDS, *REFILL_FIELDS),
        ),
    )
}


def kind(name: str) -> TableKind:
    try:
        return KINDS[name]
    except KeyError:
        raise RlkitError(f"unknown table kind {name!r}; known kinds: {', '.join(KINDS)}") from None


def _compatible(actual: pa.DataType, expected: pa.DataType) -> bool:
    if actual == expected:
        return True
    strings = (pa.types.is_string, pa.types.is_large_string)
    if any(f(expected) for f in strings):
        return any(f(actual) for f in strings)
    if pa.types.is_integer(expected):
        return pa.types.is_integer(actual)
    if pa.types.is_floating(expected):
        return pa.types.is_floating(actual) or pa.types.is_integer(actual)
    if pa.types.is_list(expected) and (pa.types.is_list(actual) or pa.types.is_large_list(actual)):
        return _compatible(actual.value_type, expected.value_type)
    if pa.types.is_struct(expected) and pa.types.is_struct(actual):
        return all(actual.get_field_index(f.name) >= 0 and _compatible(actual.field(f.name).type, f.type)
                   for f in expected)
    return False


def validate_schema(schema: pa.Schema, kinds: Sequence[str], label: str) -> dict | None:
    """Check a table's manifest kind and columns against the kinds a stage accepts.

    Returns the manifest (None for a plain Arrow table without one, which is checked by columns).
    """
    raw = (schema.metadata or {}).get(SCHEMA_KEY)
    try:
        manifest = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError) as e:
        raise RlkitError(f"{label}: its rlkit manifest (schema metadata) is not valid JSON ({e}); the table is "
                         "damaged") from None
    if manifest is not None and not isinstance(manifest, dict):
        raise RlkitError(f"{label}: its rlkit manifest (schema metadata) is not a JSON object; the table is damaged")
    want = [kind(k) for k in kinds]
    names = " or ".join(f"'{k.name}'" for k in want)
    makers = " or ".join(f"`{k.producer}`" for k in want)
    if manifest is not None:
        got = manifest.get("kind")
        if got not in kinds:
            raise RlkitError(f"{label} is a '{got}' table, expected a {names} table (made by {makers})")
        k = KINDS[got]
        if manifest.get("schema_version", 1) > k.version:
            raise RlkitError(
                f"{label} has '{got}' schema version {manifest['schema_version']}, newer than this rlkit "
                f"reads ({k.version}); upgrade rlkit"
            )
        check = [k]
    else:
        check = want
    errors = []
    for k in check:
        problems = []
        for f in k.fields:
            idx = schema.get_field_index(f.name)
            if idx < 0:
                problems.append(f"missing column '{f.name}' ({f.type})")
            elif not _compatible(schema.field(idx).type, f.type):
                problems.append(f"column '{f.name}' has type {schema.field(idx).type}, expected {f.type}")
        for f in k.accepted:  # present or not; when present, of its type (all-null columns are fine)
            idx = schema.get_field_index(f.name)
            got = schema.field(idx).type if idx >= 0 else None
            if got is not None and not (pa.types.is_null(got) or _compatible(got, f.type)):
                problems.append(f"column '{f.name}' has type {got}, expected {f.type}")
        if not problems:
            return manifest
        errors.append(problems)
    first = min(errors, key=len)
    raise RlkitError(f"{label}: {first[0]}; a {names} table is made by {makers}")
