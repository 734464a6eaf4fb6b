"""Splitting one stage's work into N independent jobs (`--shard I/N`) and joining their tables (`rlkit cat`).

A shard is a contiguous slice, so the N outputs joined in shard order are the table one job gives:
- `rollout` cuts its prompt list into whole generation chunks; each chunk keeps its global position
  and its seed, so the same prompts get the same samples whichever job draws them.
- `score-ref` cuts an input table into whole groups (rows sharing a `group_id` stay together).
Every shard's manifest records `shard: {index, count, start, stop, total}`; `rlkit cat` checks that the
N pieces are one run's complete set, puts them in shard order and refuses gaps or duplicates.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlkit.errors import RlkitError

_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True)
class Shard:
    index: int
    count: int


def parse(spec: str) -> Shard:
    m = _SPEC.match(spec)
    if not m or int(m.group(2)) < 1 or int(m.group(1)) >= int(m.group(2)):
        raise RlkitError(f"--shard {spec!r}: expected I/N with 0 <= I < N, e.g. 0/4 for the first of four jobs")
    return Shard(int(m.group(1)), int(m.group(2)))


def _cut(shard: Shard, units: int) -> tuple[int, int]:
    """The [lo, hi) units of `shard` when `units` are dealt out contiguously and as evenly as possible."""
    return shard.index * units // shard.count, (shard.index + 1) * units // shard.count


def prompt_span(shard: Shard, n_prompts: int, chunk: int) -> range:
    """The prompts of `shard` when `n_prompts` are cut into generation chunks of `chunk`. -> range."""
    lo, hi = _cut(shard, -(-n_prompts // chunk))
    return range(min(n_prompts, lo * chunk), min(n_prompts, hi * chunk))


def group_span(shard: Shard, group_ids: Sequence[int]) -> range:
    """The rows of `shard` when a table is cut between groups (consecutive equal `group_id`s). -> range."""
    starts = [i for i in range(len(group_ids)) if i == 0 or group_ids[i] != group_ids[i - 1]]
    lo, hi = _cut(shard, len(starts))
    bounds = [*starts, len(group_ids)]
    return range(bounds[lo], bounds[hi])


def run_id(config: Mapping[str, Any], inputs: Mapping[str, str]) -> str:
    """What the N shards of one run share: the settings without the shard and output, and the inputs."""
    import hashlib
    import json

    same = {k: v for k, v in config.items() if k not in ("shard", "out")}
    return hashlib.sha256(json.dumps([same, dict(inputs)], sort_keys=True, default=str).encode()).hexdigest()[:16]


def manifest_entry(spec: str | None, span: range, total: int, config: Mapping[str, Any],
                   inputs: Mapping[str, str]) -> dict[str, Any]:
    """{'shard': {...}} for a shard's manifest (start/stop count prompts or rows; `run` ties the N together)."""
    if not spec:
        return {}
    s = parse(spec)
    return {"shard": {"index": s.index, "count": s.count, "start": span.start, "stop": span.stop, "total": total,
                      "run": run_id(config, inputs)}}


def cat_order(manifests: Sequence[Mapping[str, Any] | None], labels: Sequence[str]) -> list[int]:
    """The order to join tables in: shard order when they are shards (all N of one run), else as given."""
    entries = [(m or {}).get("shard") for m in manifests]
    if not any(entries):
        return list(range(len(manifests)))
    if not all(entries):
        plain = labels[entries.index(None)]
        raise RlkitError(f"{plain} is not a shard but other inputs are; join the shards of one run only")
    if len({e.get("run") for e in entries}) > 1:
        raise RlkitError("the inputs are shards of different runs (other settings, seed or inputs); "
                         "join the N shards of one run")
    counts = {e["count"] for e in entries}
    if len(counts) > 1:
        raise RlkitError(f"the inputs are shards of different splits (N = {sorted(counts)}); join one run's shards")
    n = counts.pop()
    seen: dict[int, str] = {}
    for e, label in zip(entries, labels, strict=True):
        if e["index"] in seen:
            raise RlkitError(f"{label} and {seen[e['index']]} are both shard {e['index']}/{n}")
        seen[e["index"]] = label
    missing = sorted(set(range(n)) - set(seen))
    if missing:
        raise RlkitError(f"shard{'s' if len(missing) > 1 else ''} {', '.join(f'{i}/{n}' for i in missing)} "
                         f"missing: got {len(seen)} of {n}")
    order = sorted(range(len(entries)), key=lambda i: entries[i]["index"])
    for a, b in zip(order, order[1:], strict=False):
        if entries[a]["stop"] != entries[b]["start"]:
            raise RlkitError(f"{labels[a]} ends at row/prompt {entries[a]['stop']} but {labels[b]} starts at "
                             f"{entries[b]['start']}; they are not shards of one run")
    return order
