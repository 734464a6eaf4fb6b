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


def same_files(paths: Sequence[str], labels: Sequence[str]) -> None:
    """Refuse one table file given twice: the same path, or another name for it (a symbolic or hard link),
    seen by its device and inode. '-' (stdin) is left to `same_manifests` and `Duplicates`."""
    import os

    seen: dict[tuple[int, int], str] = {}
    for p, label in zip(paths, labels, strict=True):
        if str(p) == "-":
            continue
        try:
            st = os.stat(p)
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:
            how = "given twice" if os.path.abspath(p) == os.path.abspath(seen[key]) else "the same file under two names"
            raise RlkitError(f"{seen[key]} and {label} are one table ({how}); cat refuses duplicates: give each table "
                             "once")
        seen[key] = label


def same_manifests(manifests: Sequence[Mapping[str, Any] | None], labels: Sequence[str]) -> None:
    """Refuse two tables with the same rlkit manifest: one table twice (a copy), since every stage's manifest
    names its inputs, settings and the second it was made in. Shards are told apart by their `shard`."""
    import json

    seen: dict[str, str] = {}
    for m, label in zip(manifests, labels, strict=True):
        if not m:
            continue
        key = json.dumps(m, sort_keys=True, default=str)
        if key in seen:
            raise RlkitError(f"{label} is a copy of {seen[key]} (the same manifest: one table made once); cat refuses "
                             "duplicates: give each table once")
        seen[key] = label


# the columns that tell a row apart, by table kind (rollouts and scored rows also by their group)
ROW_KEYS = {"rollouts": ("prompt_id", "group_id", "sample_idx", "completion"),
            "scored": ("prompt_id", "group_id", "sample_idx", "completion"),
            "prefs": ("prompt_id", "prompt", "chosen", "rejected"),
            "prompts": ("prompt_id", "prompt"),
            "sft": ("prompt", "completion")}


class Duplicates:
    """Rows of the tables `cat` joins, checked batch by batch as they stream (tables that are not one run's
    shards): a row that an earlier input already holds is refused (the same table twice, or rows of it again
    in another), and for rollouts and scored tables so is a group_id an earlier input gave another prompt
    (update would take the two for one group). Samples of one prompt from two runs may share a group_id:
    they make one larger group of that prompt. Rows repeated within one input are its own business."""

    def __init__(self, kind: str) -> None:
        self.keys = ROW_KEYS.get(kind, ())
        self.grouped = kind in ("rollouts", "scored")
        self.rows: dict[int, int] = {}  # hash of a row's key -> the input that holds it
        self.groups: dict[int, tuple[int, str]] = {}  # group_id -> (input, prompt_id)

    def check(self, batch, i: int, labels: Sequence[str], row0: int) -> None:
        """Batch `batch` of input `i`, whose first row is that input's row `row0`."""
        names = batch.schema.names
        keys = [k for k in self.keys if k in names]
        if not keys:
            return
        cols = [batch.column(k).to_pylist() for k in keys]
        pid = cols[keys.index("prompt_id")] if "prompt_id" in keys else None
        for r, key in enumerate(zip(*cols, strict=True)):
            h = hash(key)
            first = self.rows.setdefault(h, i)
            if first != i:
                raise RlkitError(f"{labels[i]} row {row0 + r} ({_describe(dict(zip(keys, key, strict=True)))}) is "
                                 f"already in {labels[first]}; cat refuses duplicates: give each table once")
            if self.grouped and "group_id" in keys and pid is not None:
                g = key[keys.index("group_id")]
                j, p = self.groups.setdefault(g, (i, pid[r]))
                if j != i and p != pid[r]:
                    raise RlkitError(f"{labels[i]} row {row0 + r} has group_id {g} for prompt_id {pid[r]!r}, which "
                                     f"{labels[j]} uses for prompt_id {p!r}: update would take the two prompts' "
                                     "samples for one group; join tables whose groups are distinct (the shards of "
                                     "one run, or rollouts of one prompts table)")


def _describe(row: Mapping[str, Any]) -> str:
    parts = [f"prompt_id {row['prompt_id']!r}"] if "prompt_id" in row else []
    if "sample_idx" in row:
        parts.append(f"sample {row['sample_idx']}")
    if not parts:
        text = str(row.get("prompt", ""))
        parts.append(f"prompt {text[:40]!r}" + ("..." if len(text) > 40 else ""))
    return ", ".join(parts)
