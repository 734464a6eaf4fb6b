"""Manifests: what made an artifact (the producing command and its resolved config), from what (its inputs'
fingerprints) and where (paths as given and resolved); the rerun rule built on them."""

from __future__ import annotations

import contextvars
import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc

from rlkit import __version__
from rlkit.io.schemas import KINDS, SCHEMA_KEY

MODEL_MANIFEST = "rlkit.json"


def jsonable(value: Any) -> Any:
    """Config values as plain JSON (Paths -> str, tuples -> lists, dataclasses -> dicts)."""
    if hasattr(value, "__dataclass_fields__"):
        return {k: jsonable(getattr(value, k)) for k in value.__dataclass_fields__}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


# The options of the `rlkit` command running in this process, as given or defaulted (set by rlkit.cli around
# the stage; None when a stage runs from Python): recorded in every manifest it makes, so that
# `rlkit inspect OUT --config` can write them back as a --config file.
_OPTIONS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("rlkit_command_options", default=None)


@contextmanager
def command_options(options: Mapping[str, Any]) -> Iterator[None]:
    token = _OPTIONS.set(jsonable(options))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def make_manifest(kind: str, command: str, config: Any, inputs: Mapping[str, str],
                  carried_paths: Mapping[str, Any] | None = None, **extra: Any) -> dict:
    """The manifest every artifact carries: what made it, from what, with which settings (and, made from the
    command line, the command's options).

    Paths are recorded as given (relative ones mean something only in the directory the stage ran in) and,
    under `paths`, resolved beside them: `paths.config` mirrors the config's paths (its Path values, and the
    strings that name an existing file or directory, such as --in), `paths.NAME` a Path-valued extra NAME.
    `carried_paths`: the resolved paths of entries carried over from an upstream manifest (`carried_paths()`).
    Readers take a path with `recorded_path`, which prefers the resolved one."""
    k = KINDS.get(kind)
    options = _OPTIONS.get()
    resolved = {**(carried_paths or {}), "config": _resolved_paths(config) or {},
                **{name: _resolved_paths(v) for name, v in extra.items() if isinstance(v, Path)}}
    return {
        "kind": kind,
        "schema_version": k.version if k else 1,
        "command": command,
        "config": jsonable(config),
        **({"options": options} if options is not None else {}),
        "inputs": dict(inputs),
        "rlkit_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **{name: jsonable(v) for name, v in extra.items()},
        "paths": {name: v for name, v in resolved.items() if v is not None},
    }


def _resolved_paths(value: Any) -> Any:
    """The paths in a config value, resolved (absolute, links followed), nested like the value; None where it
    holds none. A string counts when it names an existing file or directory ('-', stdin, never)."""
    if hasattr(value, "__dataclass_fields__"):
        value = {k: getattr(value, k) for k in value.__dataclass_fields__}
    if isinstance(value, Mapping):
        out = {str(k): r for k, v in value.items() if (r := _resolved_paths(v)) is not None}
        return out or None
    if isinstance(value, list | tuple):
        items = [_resolved_paths(v) for v in value]
        return items if any(r is not None for r in items) else None
    if isinstance(value, Path) or (isinstance(value, str) and value.strip() not in ("", "-")
                                   and os.path.exists(value)):
        p = Path(value)
        try:
            return str(p.resolve())
        except (OSError, RuntimeError):  # a symbolic link loop
            return str(p.absolute())
    return None


def recorded_path(manifest: Mapping[str, Any] | None, *keys: str | int) -> str | None:
    """The path a manifest records at `keys`, e.g. ("config", "policy") or ("reference",): the resolved one
    recorded beside it (`make_manifest`) when it exists, else the given one when it exists (a manifest
    older than resolved paths, read where its stage ran; a tree moved as a whole), else whichever is
    recorded (for a message); None when none is."""
    given: Any = manifest or {}
    resolved: Any = (manifest or {}).get("paths")
    for k in keys:
        given, resolved = _at(given, k), _at(resolved, k)
    found = [c for c in (resolved, given) if isinstance(c, str) and c.strip()]
    return next((c for c in found if Path(c).exists()), found[0] if found else None)


def _at(node: Any, k: str | int) -> Any:
    if isinstance(k, int):
        return node[k] if isinstance(node, list) and -len(node) <= k < len(node) else None
    return node.get(k) if isinstance(node, Mapping) else None


def carried_paths(upstream: Mapping[str, Any] | None) -> dict[str, Any]:
    """The resolved paths of what a stage carries over from an upstream manifest into its own (`rollout`: the
    sampling settings, the upstream's own config when it is the rollout; `reference`), for `make_manifest`."""
    paths = (upstream or {}).get("paths") or {}
    out = {"rollout": paths.get("rollout") if (upstream or {}).get("rollout") else paths.get("config"),
           "reference": paths.get("reference")}
    return {k: v for k, v in out.items() if v}


@dataclass(frozen=True)
class Manifest:
    """A manifest parsed once into what its readers ask of it: the producer (`command`, its resolved `config`),
    the inputs (flag -> fingerprint), and what a rollout table carries downstream through score-ref and cat
    (the sampling settings, tokenizer, engine, reference, shard). `raw` is the JSON as written.

    `Manifest.parse(None)` (a plain table made by another tool) is an empty record whose fields say "not
    recorded" (None, {}), never a KeyError."""

    raw: Mapping[str, Any]
    kind: str | None = None
    command: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    inputs: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, m: Mapping[str, Any] | None) -> Manifest:
        m = m if isinstance(m, Mapping) else {}
        cfg, inputs = m.get("config"), m.get("inputs")
        return cls(raw=m, kind=m.get("kind"), command=m.get("command"),
                   config=cfg if isinstance(cfg, Mapping) else {}, inputs=inputs if isinstance(inputs, Mapping) else {})

    def get(self, key: str, default: Any = None) -> Any:
        """A key a stage added beside the common ones (`reference_digest`, `follow`, ...)."""
        return self.raw.get(key, default)

    @property
    def sampling_section(self) -> str:
        """Where the rollout's own settings are: `rollout` (carried by score-ref and cat) or, in a table rollout
        wrote, its `config`."""
        return "rollout" if isinstance(self.raw.get("rollout"), Mapping) and self.raw["rollout"] else "config"

    @property
    def sampling(self) -> Mapping[str, Any]:
        """The settings the rows were sampled with (temperature, n, follow, batch_prompts, policy, ...)."""
        s = self.raw.get(self.sampling_section)
        return s if isinstance(s, Mapping) else {}

    @property
    def temperature(self) -> float:
        t = self.raw.get("temperature")
        return float(t if t is not None else self.sampling.get("temperature", 1.0))

    @property
    def tokenizer(self) -> str | None:
        return self.raw.get("tokenizer")

    @property
    def engine(self) -> str | None:
        return self.raw.get("engine")

    @property
    def shard(self) -> Mapping[str, Any] | None:
        return self.raw.get("shard") or None

    def path(self, *keys: str | int) -> str | None:
        """A path the manifest records, resolved where it can be (`recorded_path`)."""
        return recorded_path(self.raw, *keys)


def read_manifest(path: str | Path) -> dict | None:
    """The rlkit manifest of a table file or model directory, or None if it is not an rlkit artifact."""
    p = Path(path)
    if p.is_dir():
        m = p / MODEL_MANIFEST
        if not m.is_file():
            return None
        try:
            return json.loads(m.read_text())
        except (OSError, ValueError):
            return None
    if not p.is_file():  # a named pipe or device: opening it could block, and it holds no artifact
        return None
    try:
        with pa.OSFile(str(p), "rb") as f:
            schema = pa.ipc.open_stream(f).schema
    except (OSError, pa.ArrowException):
        return None
    raw = (schema.metadata or {}).get(SCHEMA_KEY)
    try:
        return json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        return None


# Settings that do not change what a stage writes: a rerun that differs only in these is up to date.
# where a run's figures go (trackers, their training-curve interval) and how often it snapshots: not the result
NOT_COMPARED = ("force", "out", "verify", "plan", "reward_timeout", "sandbox_workers", "save_steps", "resume", "tracking", "logging_steps")


# ... and of the training options (`train`): how long a torchrun collective may wait
NOT_COMPARED_TRAIN = ("dist_timeout",)


def _comparable(config: Any) -> Any:
    cfg = jsonable(config)
    if isinstance(cfg, dict):
        cfg = {k: v for k, v in cfg.items() if k not in NOT_COMPARED}
        if isinstance(cfg.get("train"), dict):
            cfg["train"] = {k: v for k, v in cfg["train"].items() if k not in NOT_COMPARED_TRAIN}
    return cfg


def up_to_date(out: Path, command: str, config: Any, inputs: Mapping[str, str]) -> bool:
    """True when `out` was made by the same command, resolved config and input fingerprints."""
    m = read_manifest(out)
    return bool(
        m
        and m.get("command") == command
        and _comparable(m.get("config")) == _comparable(config)
        and m.get("inputs") == dict(inputs)
    )


def skip_if_current(out: Path | None, command: str, config: Any, inputs: Mapping[str, str]) -> bool:
    """The rerun rule every stage follows: an up-to-date --out means no work (unless --force)."""
    if out is None or getattr(config, "force", False) or not up_to_date(out, command, config, inputs):
        return False
    from rlkit.console import info

    info(f"{out} is up to date (same command, settings and inputs); nothing to do. Use --force to rerun.")
    return True
