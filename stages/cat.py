"""`rlkit cat`: join tables of one kind into one, e.g. the N shards of a `rollout --shard I/N` run.

Reads several tables (files, or '-' for stdin once) of the same kind and columns; writes one table
to --out or stdout. Shards (their manifests say `shard: I/N`) are checked to be one run's complete
set, with the same command and settings apart from the shard, and joined in shard order, which
gives the table a single job makes for the same seed; other tables are joined in the order given.
Duplicates are refused: one file given twice (under any name: a link counts), a copy (the same
manifest), a row an earlier input already holds, and, in rollouts and scored tables, one group_id
for two prompts (update would merge their groups). The first two are found before anything is
written; the rows as they stream (a file --out is then not written; on stdout the stream stops
without its end marker, which the reading stage reports).
The joined table carries the first input's manifest facts that downstream stages read (tokenizer,
engine, temperature, rollout settings, reference), with `command: cat` and every input's fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlkit import stage_options
from rlkit.options import OutTable
from rlkit.stage_options import argument, option

CARRIED = ("tokenizer", "engine", "temperature", "rollout", "reference", "reference_digest", "reward_models")


@dataclass(frozen=True)
class CatConfig:
    inputs: tuple[str, ...] = argument(help="Tables to join: the shards of one run (any order), or tables of one kind; '-' reads stdin.", show_default=False)
    out: Path | None = option(None, OutTable)


def _settings(m: dict) -> tuple:
    """What must agree across the shards of one run besides their `shard.run`: the last command and its
    settings (a shard streamed through score-ref has its own input, so not that), what downstream reads."""
    cfg = {k: v for k, v in (m.get("config") or {}).items() if k not in ("shard", "out", "inp")}
    return m.get("command"), cfg, {k: m.get(k) for k in ("tokenizer", "engine", "temperature")}


def run(cfg: CatConfig) -> Path | None:
    from rlkit.io import claims

    with claims.claim_out(cfg.out, "table", {"TABLE": list(cfg.inputs)}):
        return _run(cfg)


def _run(cfg: CatConfig) -> Path | None:
    import pyarrow as pa

    from rlkit.errors import RlkitError
    from rlkit.io import claims, manifests, schemas, shards, streams

    if len(cfg.inputs) < 1:
        raise RlkitError("no input tables; expected FILE [FILE ...] (the shards of one run, or tables of one kind)")
    if sum(str(i) == "-" for i in cfg.inputs) > 1:
        raise RlkitError("'-' (stdin) may be given once")
    out = streams.resolve_out(cfg.out)
    claims.check_out(out, "table")
    readers = [streams.TableReader(src, list(schemas.KINDS)) for src in cfg.inputs]
    kinds = {r.kind for r in readers}
    if len(kinds) > 1:
        raise RlkitError(f"the inputs are tables of different kinds ({', '.join(sorted(kinds))}); join one kind")
    names = [r.schema.names for r in readers]
    for r, n in zip(readers[1:], names[1:], strict=True):
        if sorted(n) != sorted(names[0]):
            diff = sorted(set(n) ^ set(names[0]))
            raise RlkitError(f"{r.label} has different columns from {readers[0].label} ({', '.join(diff)})")
    heads = [r.manifest or {} for r in readers]
    labels = [r.label for r in readers]
    order = shards.cat_order(heads, labels)
    dups = None
    if not any(m.get("shard") for m in heads):  # one run's shards are disjoint by construction (cat_order)
        shards.same_files(cfg.inputs, labels)
        shards.same_manifests(heads, labels)
        dups = shards.Duplicates(readers[0].kind)
    if any(m.get("shard") for m in heads):
        first = _settings(heads[order[0]])
        for i in order[1:]:
            if _settings(heads[i]) != first:
                raise RlkitError(f"{readers[i].label} was made with other settings or inputs than "
                                 f"{readers[order[0]].label}; join the shards of one run only")
    head = dict(heads[order[0]])
    paths = manifests.carried_paths(head)
    if head.get("command") == "rollout":  # downstream reads the sampling settings from here
        head.setdefault("rollout", head.get("config"))
        head.setdefault("temperature", (head.get("config") or {}).get("temperature"))
    kind = readers[0].kind
    base = {f.name for f in schemas.kind(kind).schema()}
    extra = [f for f in readers[order[0]].schema if f.name not in base]
    total = sum(((m.get("shard") or {}).get("stop", 0) - (m.get("shard") or {}).get("start", 0)) for m in heads)
    manifest = manifests.make_manifest(kind, "cat", cfg, {r.label: r.fingerprint for r in readers},
                                       **{k: head[k] for k in CARRIED if k in head}, carried_paths=paths,
                                       **({"joined_shards": len(readers), "shard_units": total}
                                          if head.get("shard") else {}))
    with streams.write_table(kind, out, manifest, extra) as w:
        for i in order:
            row0 = 0
            for batch in readers[i]:
                if dups is not None:
                    dups.check(batch, i, labels, row0)
                    row0 += batch.num_rows
                cols = [batch.column(f.name) if f.name in batch.schema.names else pa.nulls(batch.num_rows, f.type)
                        for f in w.schema]
                w.write(pa.record_batch([c.cast(f.type) for c, f in zip(cols, w.schema, strict=True)],
                                        schema=w.schema))
    from rlkit import console

    console.info(f"cat: {len(readers)} {kind} tables, {w.rows} rows -> {out or 'stdout'}")
    return out


command = stage_options.command(
    CatConfig, "Join tables of one kind, e.g. the shards of `rollout --shard I/N`, into the table one job gives.")
