"""`rlkit inspect PATH`: what an artifact is, what made it and from what.

For a table: its manifest, schema, row count and first rows. For a model directory: parameter count,
dtypes, bytes, the recorded weights hash (recomputed with --verify) and its lineage: the chain of
checkpoints and data it was made from, each marked when it has changed since.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from rlkit import stage_options
from rlkit.stage_options import argument, option

_LINEAGE_KEYS = ("policy", "model", "base", "ref", "data", "prompts", "prefs")


@dataclass(frozen=True)
class InspectConfig:
    path: Path = argument(help="A table (.arrow) or a model directory.")
    rows: int = option(5, min=0, panel="What to show", help="How many first rows of a table to show.")
    verify: bool = option(False, "--verify", panel="What to show", help="Read the weights now and compare their sha256 with the manifest; exit 2 on a mismatch (also with --check and --json).")
    as_json: bool = option(False, "--json", panel="Output & tracking", help="Print JSON to stdout instead of tables.")
    check: bool = option(False, "--check", panel="What to show", help="Only tell whether PATH exists and its inputs are unchanged: exit 0 if so, 1 if not (for scripts).")
    config: bool = option(False, "--config", panel="What to show", help="Print the options the command that made PATH ran with, as a TOML file that `--config` reads (`rlkit inspect CKPT --config > run.toml`, then e.g. `rlkit update --config run.toml --out next/`); where that run wrote (out, metrics, tensorboard, run_name) is written commented out, so the next run names its own outputs.")


def is_current(path: Path) -> bool:
    """True when `path` is an rlkit artifact and none of its recorded file inputs changed since."""
    from rlkit.io import manifests

    manifest = manifests.read_manifest(path) if path.exists() else None
    if manifest is None:
        return False
    for e in _lineage(manifest):
        if e["depth"] == 0 and (e["kind"] == "not found" or e.get("changed_since")):
            return False
    return True


def _lineage(manifest: dict | None, depth: int = 0) -> list[dict[str, Any]]:
    from rlkit.io import fingerprints, manifests

    out: list[dict[str, Any]] = []
    if not manifest or depth > 32:
        return out
    config, inputs = manifest.get("config") or {}, manifest.get("inputs") or {}
    for key in _LINEAGE_KEYS:
        src = config.get(key)
        # read at the path resolved when it was recorded: inspect may run in another directory
        found = manifests.recorded_path(manifest, "config", key)
        if not isinstance(src, str) or not found or not Path(found).exists():
            if isinstance(src, str):
                out.append({"depth": depth, "role": key, "path": src, "kind": "embedded" if src == "tiny" else "not found"})
            continue
        parent = manifests.read_manifest(found)
        entry = {"depth": depth, "role": key, "path": src, "kind": (parent or {}).get("kind", "external")}
        if key in inputs:
            entry["changed_since"] = fingerprints.fingerprint(found) != inputs[key]
        out.append(entry)
        out.extend(_lineage(parent, depth + 1))
    return out


def run(cfg: InspectConfig) -> dict[str, Any]:
    import json
    import sys

    from rlkit import console
    from rlkit.errors import RlkitError
    from rlkit.io import checkpoints, fingerprints, manifests, streams

    p = cfg.path
    _only_files(p)
    if cfg.config:
        return _print_config(p)
    if cfg.check:
        current = is_current(p)
        console.info(f"{p}: {'current' if current else 'missing or stale'}")
        if not current:
            raise typer.Exit(1)
        if cfg.verify and p.is_dir():
            _verify_now(p, checkpoints.load_manifest(p))
        return {"current": True}
    if not p.exists():
        raise RlkitError(f"{p}: no such file or directory")
    if p.is_dir():
        # shown even when its weights or a LoRA checkpoint's base changed (--verify says so)
        checkpoints.check_model_dir(p, lora_base=False, verify=False)
        manifest = checkpoints.load_manifest(p)
        info: dict[str, Any] = {"path": str(p), "type": "model", **checkpoints.safetensors_summary(p)}
        cfg_path = p / "config.json"
        from rlkit.io import adapters

        if adapters.is_adapter_dir(p):  # the adapter; the architecture is its base's
            entry = (manifest or {}).get("lora") or {}
            try:
                base, _ = adapters.verify_base(p.absolute())
                info["lora_base"], cfg_path = f"{base} (sha256 as recorded)", base / "config.json"
            except RlkitError as e:
                info["lora_base"] = str(e)
            info["lora"] = {k: entry.get(k) for k in ("kind", "rank", "alpha", "dropout", "target_modules")}
        cfg_json = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        info["architecture"] = (cfg_json.get("architectures") or ["?"])[0]
        if manifest:
            info.update(kind=manifest.get("kind"), command=manifest.get("command"), step=manifest.get("step"),
                        created=manifest.get("created"), weights_digest=manifest.get("weights_digest"),
                        metrics=manifest.get("metrics"), config=manifest.get("config"))
            tr = manifest.get("tracking")
            if isinstance(tr, dict):  # the tracker run that trained it: update/eval of it continue that run
                info["tracking"] = f"run {tr.get('run_name')!r} in project {tr.get('project')!r} ({', '.join(tr.get('report_to') or [])})"
            info["lineage"] = _lineage(manifest)
        if cfg.verify:
            per_file = {f.name: fingerprints.sha256_file(f) for f in checkpoints.weight_files(p)}  # read now, no cache
            info["weights_verified"] = bool(manifest) and per_file == manifest.get("weights_sha256")
            info["weights_sha256_now"] = per_file
    else:
        manifest = manifests.read_manifest(p)
        if manifest is None:
            raise RlkitError(f"{p} is not an rlkit artifact (neither a model directory nor an rlkit Arrow table)")
        table, _ = streams.read_table(p, [manifest["kind"]], require_rows=False)
        info = {"path": str(p), "type": "table", "kind": manifest["kind"], "rows": table.num_rows,
                "manifest": manifest, "schema": {f.name: str(f.type) for f in table.schema},
                "first_rows": table.slice(0, cfg.rows).to_pylist(), "lineage": _lineage(manifest)}
        from rlkit.io import trajectories

        figures = trajectories.figures(table)
        if figures is not None:
            info["multi_turn"] = figures
    if cfg.as_json:
        sys.stdout.write(json.dumps(info, indent=2, default=str) + "\n")
        if cfg.verify and info.get("weights_verified") is False:
            _verify_now(p, manifest)
        return info
    from rich.table import Table

    from rlkit.sampling.conversations import Seen, conversations, figures_table

    t = Table(title=f"{info['path']} ({info['type']})", show_header=False)
    skip = {"first_rows", "schema", "manifest", "lineage", "config", "metrics", "multi_turn"}
    for k, v in info.items():
        if k not in skip:
            t.add_row(k, f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v))
    if "manifest" in info:
        m = info["manifest"]
        for k in ("command", "schema_version", "rlkit_version", "created"):
            t.add_row(k, str(m.get(k)))
        t.add_row("config", json.dumps(m.get("config")))
        t.add_row("inputs", json.dumps(m.get("inputs")))
    for k in ("config", "metrics"):
        if info.get(k):
            t.add_row(k, json.dumps(info[k]))
    console.err.print(t)
    if info.get("lineage"):
        lt = Table(title="lineage")
        for col in ("role", "path", "kind", "changed since"):
            lt.add_column(col)
        for e in info["lineage"]:
            changed = e.get("changed_since")
            lt.add_row("  " * e["depth"] + e["role"], e["path"], e["kind"],
                       "" if changed is None else ("yes" if changed else "no"))
        console.err.print(lt)
    if info.get("multi_turn"):
        console.err.print(figures_table(info["multi_turn"]))
    if "schema" in info and info.get("multi_turn"):
        # multi-turn: the columns, then each shown row as its conversation (every value is in --json)
        st = Table(title=f"schema ({info['rows']:,} rows)")
        st.add_column("column")
        st.add_column("type", overflow="fold")
        for name, typ in info["schema"].items():
            st.add_row(name, typ)
        console.err.print(st)
        console.err.print(f"first {min(cfg.rows, info['rows'])} of {info['rows']:,} rows:\n")
        seen = Seen.of(info["manifest"]) if info["first_rows"] else None
        if seen is not None and seen.note:
            console.err.print(seen.note + "\n")
        for block in conversations(info["first_rows"], seen):
            console.err.print(block)
    elif "schema" in info:
        st = Table(title=f"schema and first {min(cfg.rows, info['rows'])} of {info['rows']:,} rows")
        for name in info["schema"]:
            st.add_column(f"{name}\n{info['schema'][name]}", overflow="fold", max_width=40)
        for row in info["first_rows"]:
            st.add_row(*(str(v)[:80] for v in row.values()))
        console.err.print(st)
    if cfg.verify and info.get("weights_verified") is False:
        _verify_now(p, manifest)
    return info


def _only_files(p: Path) -> None:
    """Refuse a PATH that is neither a regular file nor a directory (a named pipe, a device, a socket), and
    such an entry in a directory, before anything opens it: opening a named pipe waits for a writer that may
    never come, and inspect reads a table more than once, which a stream cannot give."""
    import stat

    from rlkit.errors import RlkitError

    kinds = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))

    def kind(f: Path) -> str | None:
        try:
            mode = f.stat().st_mode
        except OSError:  # missing, or unreadable: said where it is read
            return None
        return next((name for test, name in kinds if test(mode)), None)

    if (what := kind(p)) is not None:
        raise RlkitError(f"{p} is {what}; expected an Arrow table file or a model directory (to inspect a stream, "
                         "save it to a file first: `... > table.arrow`)")
    if p.is_dir():
        for f in sorted(p.iterdir()):
            if (what := kind(f)) is not None:
                raise RlkitError(f"{f} is {what}; expected the regular files of a model directory")


def _print_config(p: Path) -> dict[str, Any]:
    """`--config`: the options the artifact's command ran with, as a file `--config` reads (stdout)."""
    import sys

    from rlkit import config_file
    from rlkit.errors import RlkitError
    from rlkit.io import manifests

    if not p.exists():
        raise RlkitError(f"{p}: no such file or directory")
    manifest = manifests.read_manifest(p)
    if manifest is None:
        raise RlkitError(f"{p} is not an rlkit artifact (neither a model directory nor an rlkit Arrow table)")
    options = manifest.get("options")
    if options is None:
        raise RlkitError(f"{p} records no command-line options (made from Python, or by an older rlkit); "
                         f"its settings are under config in `rlkit inspect {p} --json`")
    sys.stdout.write(config_file.options_toml(manifest["command"], options, str(p)))
    return options


def _verify_now(p: Path, manifest: dict | None) -> None:
    """`--verify`: read every weights file now (no cache) and fail in one line unless each matches the
    sha256 its rlkit.json records."""
    from rlkit.errors import RlkitError
    from rlkit.io import checkpoints, fingerprints

    want = (manifest or {}).get("weights_sha256")
    if not want:
        raise RlkitError(f"{p}: nothing to verify against (no weights_sha256 in its rlkit.json: not written by rlkit)")
    have = {f.name: fingerprints.sha256_file(f) for f in checkpoints.weight_files(p)}
    bad = sorted({n for n, _ in set(have.items()) ^ set(want.items())})
    if bad:
        raise RlkitError(f"{p} fails its hash check: sha256 mismatch in {', '.join(bad)} (the weights changed after "
                         "they were written)")


command = stage_options.command(InspectConfig, "Show an artifact's manifest, schema, rows, size, hash and lineage.")
