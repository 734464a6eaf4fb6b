"""Every on-disk format rlkit reads or writes: table schemas, manifests, fingerprints, atomic writes.

Tables are Arrow IPC *stream* files. Each carries a manifest (JSON) in its schema metadata under the
key ``rlkit`` and ends with an empty record batch whose custom metadata holds ``rlkit.end`` (the row
count). Plain pyarrow and ``datasets.Dataset.from_file`` read these files as usual; rlkit readers use
the end marker to tell a finished stream from one whose producer died (pyarrow alone cannot: a
stream cut at a message boundary reads as a shorter, valid stream).

Model directories are Hugging Face ``save_pretrained`` layouts plus ``rlkit.json`` (see
``rlkit.io.checkpoints``); this module fingerprints them and swaps them into place atomically.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import queue
import re
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.ipc

from rlkit import __version__
from rlkit.errors import DownstreamClosed, RlkitError, TruncatedStream

SCHEMA_KEY = b"rlkit"
END_KEY = "rlkit.end"
MODEL_MANIFEST = "rlkit.json"
# Files at least this big are fingerprinted by (size, mtime) instead of content: cheap for
# multi-GB checkpoints, still changes whenever a file is rewritten.
CONTENT_HASH_LIMIT = 64 << 20

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
    verifier and reward-model scores travel as named components side by side.
    """

    name: str
    version: int
    fields: tuple[pa.Field, ...]
    producer: str
    optional: tuple[pa.Field, ...] = ()
    prefixes: tuple[tuple[str, pa.DataType], ...] = ()

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
_REWARDS = (("reward/", pa.float64()),)

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
        TableKind("rollouts", 1, _ROLLOUT_FIELDS, "rlkit rollout", optional=_ROLLOUT_OPTIONAL, prefixes=_REWARDS),
        TableKind(
            "scored", 1, (*_ROLLOUT_FIELDS, _f("ref_logprobs", _LOGPROBS)), "rlkit score-ref",
            optional=_ROLLOUT_OPTIONAL, prefixes=_REWARDS,
        ),
    )
}


def kind(name: str) -> TableKind:
    try:
        return KINDS[name]
    except KeyError:
        raise RlkitError(f"unknown table kind {name!r}; known kinds: {', '.join(KINDS)}") from None


# ---------------------------------------------------------------------------------------------
# Manifests and fingerprints


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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# The verified-weights cache: what is known of a file while its (device, inode, size, mtime, ctime) stay
# the same: its sha256 and whether its tensors are all finite. Any write to the file changes mtime and
# ctime (and a user cannot set ctime back), so a hit is the same bytes. One small JSON file per entry
# under $RLKIT_CACHE_DIR (default $XDG_CACHE_HOME/rlkit or ~/.cache/rlkit), shared by every process;
# an unwritable cache only means hashing again.
_FACTS: dict[str, dict] = {}
CACHE_ENTRIES = 4096


def cache_dir() -> Path:
    if os.environ.get("RLKIT_CACHE_DIR"):
        return Path(os.environ["RLKIT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlkit"


def _facts_key(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}"


def file_facts(path: Path, compute: Mapping[str, Callable[[Path], Any]]) -> dict:
    """The cached facts named in `compute` about `path`, computing (and caching) the missing ones."""
    key = _facts_key(path)
    facts = _FACTS.get(key)
    store = cache_dir() / "files" / f"{key}.json"
    if facts is None:
        try:
            facts = json.loads(store.read_text())
        except (OSError, ValueError):
            facts = {}
    missing = [name for name in compute if name not in facts]
    for name in missing:
        facts[name] = compute[name](path)
    _FACTS[key] = facts
    if missing:
        _store_facts(store, facts)
    return facts


def _store_facts(store: Path, facts: dict) -> None:
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_name(f".{store.name}.{os.getpid()}")
        tmp.write_text(json.dumps(facts))
        os.replace(tmp, store)
        entries = list(os.scandir(store.parent))
        if len(entries) > CACHE_ENTRIES:  # drop the oldest half
            entries.sort(key=lambda e: e.stat().st_mtime)
            for e in entries[: len(entries) // 2]:
                os.unlink(e.path)
    except OSError:
        pass


def sha256_cached(path: Path) -> str:
    """`sha256_file`, read once per file version (see `file_facts`)."""
    return file_facts(path, {"sha256": sha256_file})["sha256"]


def fingerprint(path: str | Path) -> str:
    """A cheap identity for an input file or directory, recorded in manifests for rerun checks.

    Small files are hashed by content; big ones (weights) by size and mtime, so a multi-GB
    checkpoint costs a stat, not a read. Rewriting any file changes the fingerprint.
    """
    p = Path(path)
    if not p.exists():
        raise RlkitError(f"{p}: no such file or directory")
    h = hashlib.sha256()
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    for q in files:
        st = q.stat()
        h.update(str(q.relative_to(p) if p.is_dir() else q.name).encode() + b"\0")
        if st.st_size < CONTENT_HASH_LIMIT:
            h.update(sha256_file(q).encode())
        else:
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return "sha256:" + h.hexdigest()


def stream_fingerprint(manifest: Mapping[str, Any] | None) -> str:
    """Identity of a table read from a pipe: its producer's manifest (which names its inputs)."""
    blob = json.dumps(manifest, sort_keys=True).encode()
    return "stream:" + hashlib.sha256(blob).hexdigest()


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
NOT_COMPARED = ("force", "out", "verify", "reward_timeout", "save_steps", "resume", "tracking", "logging_steps")


def _comparable(config: Any) -> Any:
    cfg = jsonable(config)
    if isinstance(cfg, dict):
        cfg = {k: v for k, v in cfg.items() if k not in NOT_COMPARED}
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


# ---------------------------------------------------------------------------------------------
# Atomic output


def check_out(out: Path | None, expect: str) -> None:
    """Refuse an --out that exists but is not an rlkit artifact of the expected form (table/model)."""
    if out is None or not out.exists():
        return
    if not out.is_dir() and not out.is_file():  # opening a named pipe to read its manifest would block
        raise RlkitError(f"--out {out} is {_special(out)}, not a file: a stage writes its output to a temporary "
                         "file and renames it into place; to stream a table into a pipe, leave out --out (stdout)")
    if expect == "file":
        if out.is_dir():
            raise RlkitError(f"--out {out} is a directory, expected a file path; refusing to overwrite it")
        return
    if expect == "model":
        if not out.is_dir():
            raise RlkitError(f"--out {out} exists and is a file, expected a model directory; refusing to overwrite it")
        if read_manifest(out) is None:
            if any(out.iterdir()):
                raise RlkitError(
                    f"--out {out} exists and is not an rlkit checkpoint (no {MODEL_MANIFEST}); "
                    "refusing to overwrite it: choose another path or delete it"
                )
    else:
        if out.is_dir():
            raise RlkitError(f"--out {out} is a directory, expected a table file path; refusing to overwrite it")
        if read_manifest(out) is None:
            raise RlkitError(
                f"--out {out} exists and is not an rlkit table; refusing to overwrite it: "
                "choose another path or delete it"
            )


def _special(p: Path) -> str:
    """What a path that is neither a file nor a directory is: 'a named pipe', 'a device', 'a socket'."""
    import stat

    mode = p.stat().st_mode
    return ("a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def _tmp_sibling(out: Path, tag: str) -> Path:
    return out.parent / f".{out.name}.{tag}-{os.getpid()}-{secrets.token_hex(3)}"


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM for a few syscalls, so a rename pair is never cut in half."""
    import signal

    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the
    kernel, C library or file system cannot, so the caller falls back to two renames."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    import errno

    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(d: Path) -> None:
    """fsync every file under `d`, then the directories: what a rename then publishes is on disk."""
    for dirpath, _, files in os.walk(d):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Publish `tmp` at `out`. A file: one rename. A directory over an existing one: one atomic exchange
    where the kernel offers it, so some complete `out` exists at every instant; elsewhere two renames,
    and `claim_out` puts the old directory back if a kill fell between them."""
    with signals_deferred():
        if out.is_dir() and not out.is_symlink():
            if _exchange(tmp, out):
                shutil.rmtree(tmp, ignore_errors=True)  # now the old contents
            else:
                old = _tmp_sibling(out, "old")
                os.rename(out, old)
                try:
                    os.rename(tmp, out)
                except BaseException:
                    os.rename(old, out)  # the old contents back where they were
                    raise
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    fsync_dir(out.parent)


def _remove(p: Path) -> None:
    """Remove a temporary file or directory this process made (gone already: nothing to do)."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


@contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; it replaces `out` only if the block finishes.

    Any exception, Ctrl-C or SIGTERM (turned into KeyboardInterrupt by the CLI) removes it and
    leaves whatever was at `out` untouched. Every file is fsynced before the swap.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(out, "tmp")
    try:
        tmp.mkdir()
        yield tmp
        fsync_tree(tmp)
        _swap_into_place(tmp, out)
    except BaseException:
        _remove(tmp)  # after a swap: already gone (renamed, or the old contents removed)
        raise


@contextmanager
def atomic_file(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling path to write; it replaces `out` only if the block finishes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(out, "tmp")
    try:
        yield tmp
        _swap_into_place(tmp, out)
    except BaseException:
        _remove(tmp)
        raise


# ---------------------------------------------------------------------------------------------
# Claiming an --out: no stage writes over its own inputs, one writer per --out, leftovers cleaned


class OutputBusy(RlkitError):
    """Another process holds the --out this stage was asked to write."""

    exit_code = 75  # EX_TEMPFAIL: try again once the other run has finished


class OutputUnwritable(RlkitError):
    """The --out location cannot be written (read-only, no permission, no space)."""

    exit_code = 74  # EX_IOERR


_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<tag>tmp|old)-(?P<pid>\d+)-[0-9a-f]{6}$")
_HELD: dict[Path, int] = {}  # --out (absolute) -> this process's count of claims on it


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _resolved(p: Path) -> Path:
    try:
        return p.resolve()
    except (OSError, RuntimeError):  # a symbolic link loop (RuntimeError before Python 3.13)
        return p.absolute()


def _same_or_inside(a: Path, b: Path) -> bool:
    """True when `a` is `b` (same inode, whatever the spelling or links) or lies inside directory `b`."""
    try:
        if a.exists() and b.exists() and os.path.samefile(a, b):
            return True
    except OSError:
        pass
    ra, rb = _resolved(a), _resolved(b)
    return ra == rb or rb in ra.parents


def lora_base_of(d: Path) -> Path | None:
    """The base directory a LoRA checkpoint's manifest names (it is an input of whatever reads `d`)."""
    m = read_manifest(d) if d.is_dir() else None
    base = (m or {}).get("lora", {}).get("base") if m else None
    return Path(base) if base else None


def _input_paths(inputs: Mapping[str, Any]) -> list[tuple[str, Path]]:
    """(flag, path) for every input that is a local path, plus the base of each LoRA checkpoint."""
    found: list[tuple[str, Path]] = []
    for flag, value in inputs.items():
        values = value if isinstance(value, list | tuple) else [value]
        for v in values:
            if v is None or str(v) in ("", "-"):
                continue
            text = str(v).split("=", 1)[-1] if flag == "--reward-fn" else str(v)
            if flag in ("--task", "--reward-fn") and ":" in text:
                text = text.rsplit(":", 1)[0]
            p = Path(text)
            if not p.exists():
                continue
            found.append((flag, p))
            base = lora_base_of(p)
            if base is not None:
                found.append((f"{flag}'s LoRA base", base))
    return found


def check_not_input(out: Path, inputs: Mapping[str, Any], label: str = "--out") -> None:
    """Refuse an output (`label`: its flag) that is one of the stage's inputs, contains one, or lies inside one."""
    for flag, p in _input_paths(inputs):
        if _same_or_inside(p, out):
            what = "is" if _same_or_inside(out, p) else "contains"
            raise RlkitError(f"{label} {out} {what} one of this stage's inputs ({flag} {p}); a stage never writes "
                             f"over its own input: choose another {label}")
        if p.is_dir() and _same_or_inside(out, p):
            raise RlkitError(f"{label} {out} lies inside an input directory ({flag} {p}); a stage never writes into "
                             f"its own input: choose another {label}")


# What an output path is, for `check_outputs` (and `claim_out`'s `expect` and `side`):
#   model, table, file  --out, replaced in one atomic step (`check_out`: only over an rlkit artifact of that form)
#   follow              `update --follow`'s directory of step checkpoints (rlkit.io.follow checks what is in it)
#   metrics             a JSON-lines file rows are appended to (rlkit.io.metrics_log: new, or a metrics file)
#   events              a TensorBoard log directory (rlkit.io.tracking: new, empty or only event files)
#   store               a tracker's own store, shared by runs (wandb's folder, MLflow's database, trackio's folder)
REPLACED = ("model", "table", "file")
# a directory holding one of these is a model checkpoint: no stage writes into one it is not writing
_MODEL_FILES = (MODEL_MANIFEST, "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "adapter_model.safetensors", "adapter_config.json")


def _is_model_dir(d: Path) -> bool:
    return any((d / name).is_file() for name in _MODEL_FILES)


def _check_place(label: str, p: Path) -> None:
    """Refuse a path no output can be written at: empty, a symbolic link that leads nowhere (dangling, a loop),
    under a parent that is a file."""
    if not str(p).strip():
        raise RlkitError(f"{label}: the path is empty; expected a path to write")
    try:
        for q in (p, *p.parents):
            if q.is_symlink() and not q.exists():
                where = "" if q == p else f": its parent {q}"
                raise RlkitError(f"{label} {p}{where} is a symbolic link that leads nowhere (dangling, or a loop); "
                                 "expected a path to write: fix the link or choose another path")
            if q != p and q.exists():
                if not q.is_dir():
                    raise OutputUnwritable(f"cannot write {label} {p}: its parent {q} is a file, not a directory; "
                                           "choose a path in a folder")
                return
    except PermissionError as e:
        raise _unwritable(p, e, label) from None


def _check_not_in_checkpoint(label: str, p: Path) -> None:
    """Refuse an output inside a model checkpoint (a file there would change the checkpoint's contents and
    fingerprint; the checkpoint a stage writes replaces its directory whole, dropping anything put in it)."""
    for d in _resolved(p).parents:
        if _is_model_dir(d):
            raise RlkitError(f"{label} {p} lies inside the checkpoint {d}; a stage never writes into a checkpoint: "
                             f"choose another {label}")


def _check_writable(label: str, p: Path) -> None:
    """A side output's location can be written (checked now: a read-only place fails before the work)."""
    q = p if p.exists() else next((d for d in p.parents if d.exists()), Path("."))
    if not os.access(q, os.W_OK):
        e = OSError(30 if _read_only(q) else 13, "read-only file system" if _read_only(q) else "permission denied")
        raise _unwritable(p, e, label, where=q)


def _read_only(q: Path) -> bool:
    try:
        return bool(os.statvfs(q).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _check_form(label: str, p: Path, form: str) -> None:
    if form in REPLACED:
        if p.is_symlink():
            raise RlkitError(f"{label} {p} is a symbolic link (to {_resolved(p)}); a stage replaces its output "
                             "whole and never writes through a link or over it: pass the path itself or another")
        check_out(p, form)
    elif form == "metrics":
        from rlkit.io import metrics_log

        metrics_log.check_target(label, p)
        _check_writable(label, p)
    elif form == "events":
        from rlkit.io import tracking

        tracking.check_log_dir(label, p)
        _check_writable(label, p)
    elif form == "store":
        if (p.is_dir() or p.is_file()) and read_manifest(p) is not None:
            raise RlkitError(f"{label} {p} is an rlkit {'checkpoint' if p.is_dir() else 'table'}, not a tracker's "
                             "store; choose another location")
    elif form != "follow":
        raise ValueError(f"internal: unknown output form {form!r}")


def check_outputs(outputs: Mapping[str, tuple[Path | None, str]], inputs: Mapping[str, Any] | None = None) -> None:
    """Before any work, every path a stage is to write: `outputs` maps each one's flag to (path, form) (see
    REPLACED above; a None path: not asked for). Each is refused in one line when it

    - is empty, a symbolic link that leads nowhere, or under a parent that is a file;
    - is one of the stage's `inputs`, lies inside one or contains one (`check_not_input`);
    - is the same path as another of the outputs, or lies inside one;
    - lies inside a model checkpoint;
    - exists and is not of its form: --out an rlkit artifact of the kind it writes and not a symbolic link,
      a metrics file a file of metrics rows, a TensorBoard directory one of event files, a tracker's store
      not an rlkit artifact;

    and a metrics file or TensorBoard directory whose location cannot be written is refused with exit 74.
    """
    named = [(flag, Path(p), form) for flag, (p, form) in outputs.items() if p is not None and str(p) != "-"]
    for flag, p, _ in named:
        _check_place(flag, p)
    for flag, p, _ in named:
        check_not_input(p, inputs or {}, flag)
    for i, (first, p, _) in enumerate(named):
        for flag, q, _ in named[i + 1:]:  # named after `first` (--out comes first): the one to change
            inside, contains = _same_or_inside(q, p), _same_or_inside(p, q)
            if inside or contains:
                what = "is the same path as" if inside and contains else "lies inside" if inside else "contains"
                raise RlkitError(f"{flag} {q} {what} {first} {p}; every output of a stage needs a place of its own: "
                                 f"choose another {flag}")
    for flag, p, form in named:
        _check_not_in_checkpoint(flag, p)
        _check_form(flag, p, form)


def clean_leftovers(out: Path) -> list[str]:
    """Remove the hidden `.NAME.tmp-PID-*` / `.NAME.old-PID-*` siblings that killed writers of `out` left
    (only those whose process is gone). If a kill fell between the two renames of a directory swap, so
    that `out` is missing and its old contents wait under `.NAME.old-*`, put them back first."""
    gone = []
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return gone
    leftovers = []
    for e in entries:
        m = _LEFTOVER.match(e.name)
        if m and m["name"] == out.name and not _pid_alive(int(m["pid"])):
            leftovers.append((m["tag"], Path(e.path)))
    if not out.exists() and not out.is_symlink():
        olds = sorted((p for tag, p in leftovers if tag == "old"), key=lambda p: p.stat().st_mtime)
        if olds:
            os.rename(olds[-1], out)
            leftovers = [(t, p) for t, p in leftovers if p != olds[-1]]
            from rlkit.console import warn

            warn(f"{out} was restored from {olds[-1].name}, left by a run killed while replacing it")
    for _, p in leftovers:
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            gone.append(p.name)
        except FileNotFoundError:
            pass
    return gone


def _unwritable(out: Path, e: OSError, label: str = "--out", where: Path | None = None) -> OutputUnwritable:
    return OutputUnwritable(f"cannot write {label} {out}: {e.strerror or e} ({where or e.filename or out.parent}); "
                            "choose a writable location with free space")


def _lock(out: Path) -> int:
    """flock `.NAME.lock` beside `out` (kernel-held: dropped when this process dies, so never stale);
    the file holds the holder's pid. Returns the open descriptor."""
    import fcntl

    lock = out.parent / f".{out.name}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputBusy(f"--out {out} is being written by another rlkit process (pid {holder}); wait for it "
                             "to finish or choose another --out") from None
        try:  # the previous holder may have unlinked the file between our open and our flock
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _unlock(out: Path, fd: int) -> None:
    try:
        os.unlink(out.parent / f".{out.name}.lock")  # while still holding it: see the inode check in _lock
    except FileNotFoundError:
        pass
    os.close(fd)


@contextmanager
def claim_out(out: Path | None, expect: str, inputs: Mapping[str, Any] | None = None,
              side: Mapping[str, tuple[Path | None, str]] | None = None) -> Iterator[None]:
    """Hold a stage's --out for its whole run. Before any work:

    - check --out and the stage's other outputs, `side` (flag -> (path, form): --metrics, --tensorboard, the
      trackers' stores), with `check_outputs`: none is one of the inputs (by inode or resolved path) or lies
      inside or contains one (`inputs` maps each input's flag to its path(s); a LoRA checkpoint's base counts
      too), none is another output or inside one or inside a checkpoint, and each one that exists is of its
      form (--out an rlkit artifact of the form `expect`, see `check_out`);
    - create the parent directory and the lock file, so a read-only or missing location fails now,
      not after training;
    - take the lock (a second writer of the same --out is refused, naming the holder's pid);
    - remove what killed writers of this --out left behind, restoring a half-swapped directory.

    `out=None` (stdout) claims no place, and a write to stdout that fails for lack of space is one line
    (exit 74). Directories this created are removed again if the run fails before writing them.
    Re-entrant within one process.
    """
    stdout = out is None or str(out) == "-"
    check_outputs({"--out": (None if stdout else out, expect), **(side or {})}, inputs)
    if stdout:
        with _stdout_failures():
            yield
        return
    key = out.absolute()
    if int(os.environ.get("RANK", "0")) != 0:  # data parallel: rank 0 alone writes --out
        yield
        return
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = _lock(out)
    except OSError as e:
        _remove_empty(made)
        raise _unwritable(out, e) from None
    except BaseException:
        _remove_empty(made)
        raise
    _HELD[key] = 1
    try:
        clean_leftovers(out)
        yield
    except Exception as e:
        full = None if isinstance(e, RlkitError) else _out_of_space(e)
        if full is not None:
            raise OutputUnwritable(f"writing --out {out} failed: {full}; nothing was written (free space, raise the "
                                   "file-size limit, or choose another location)") from e
        raise
    finally:
        del _HELD[key]
        _unlock(out, fd)
        if not out.exists():
            _remove_empty(made)


@contextmanager
def _stdout_failures() -> Iterator[None]:
    """A stage writing to stdout (a table, `eval --json`): stdout that runs out of space is one line, exit 74."""
    try:
        yield
        sys.stdout.flush()  # what the stage printed reaches stdout's file now, where a failure is still one line
    except Exception as e:
        full = None if isinstance(e, RlkitError) else _out_of_space(e)
        if full is None:
            raise
        drop_stdout_sink()
        devnull = os.open(os.devnull, os.O_WRONLY)  # what is still buffered must not fail again at exit
        os.dup2(devnull, 1)
        os.close(devnull)
        raise OutputUnwritable(f"cannot write to stdout: {full}; what reached it is incomplete (free space, raise "
                               "the file-size limit, or send stdout elsewhere)") from e


_NO_SPACE = {28: "no space left on device", 27: "file too large (the file-size limit, ulimit -f)",
             122: "disk quota exceeded", 30: "read-only file system"}


def _out_of_space(e: BaseException) -> str | None:
    """What ran out when a write failed for lack of room (ENOSPC, EFBIG, EDQUOT, EROFS), whichever library
    raised it (an OSError from Python or pyarrow, safetensors' `SafetensorError: ... os error 28`), or None."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _NO_SPACE:
            return _NO_SPACE[seen.errno]
        m = re.search(r"(?:os error|errno|Errno|code:) ?(\d+)", str(seen))
        if m and int(m.group(1)) in _NO_SPACE:
            return _NO_SPACE[int(m.group(1))]
        seen = seen.__cause__ or seen.__context__
    return None


def _remove_empty(dirs: Sequence[Path]) -> None:
    for d in dirs:  # deepest first
        try:
            d.rmdir()
        except OSError:
            return


# ---------------------------------------------------------------------------------------------
# Writing tables


def resolve_out(out: Path | None) -> Path | None:
    """`--out -` and an omitted --out both mean stdout, which must not be a terminal (and is claimed
    for the table from here on, see `stdout_sink`)."""
    if out is not None and str(out) != "-":
        return out
    if sys.stdout.isatty():
        raise RlkitError("refusing to write an Arrow table to the terminal: pass --out FILE or pipe into another stage")
    stdout_sink()
    return None


_STDOUT: BinaryIO | None = None


def stdout_sink() -> BinaryIO:
    """The process's real stdout, for an Arrow stream only.

    The first call moves it to a new descriptor and points fd 1 at stderr, so that whatever else
    writes to stdout, in this process or in processes it starts (vLLM's engine workers log there),
    lands on stderr instead of corrupting the table downstream.
    """
    global _STDOUT
    if _STDOUT is None:
        sys.stdout.flush()
        fd = os.dup(1)
        os.dup2(2, 1)
        _STDOUT = os.fdopen(fd, "wb")
    return _STDOUT


def downstream_closed() -> bool:
    """True once the stage reading our stdout pipe has exited (the pipe's read end is closed); False
    while it runs, and always when stdout is not claimed for a table or is not a pipe."""
    import select

    if _STDOUT is None:
        return False
    p = select.poll()
    p.register(_STDOUT.fileno(), 0)  # POLLERR / POLLHUP are reported whatever is asked for
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(0))


def flush_stdout_sink() -> None:
    """Flush the claimed stdout, if any (a stage leaving at once must not lose its last batch)."""
    if _STDOUT is not None:
        try:
            _STDOUT.flush()
        except (OSError, ValueError):
            pass


def drop_stdout_sink() -> None:
    """Point the claimed stdout at /dev/null: its reader is gone, and whatever is still buffered must
    not fail again (or print Python's 'Exception ignored' lines) at exit."""
    if _STDOUT is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, _STDOUT.fileno())
        os.close(devnull)


class TableWriter:
    """Writes record batches of one kind as they are produced, flushing each to the sink.

    To a file: a temporary sibling renamed over `out` by `close()`. To stdout: straight through,
    with the end marker written only by `close()`, so a reader can tell a complete stream.
    """

    def __init__(self, kind_name: str, out: Path | None, manifest: Mapping[str, Any],
                 extra: Sequence[pa.Field] = ()) -> None:
        self.kind = kind(kind_name)
        self.out = out
        self.schema = self.kind.schema(extra, manifest)
        self.rows = 0
        self._tmp: Path | None = None
        if out is None:
            self._sink: BinaryIO = stdout_sink()
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = _tmp_sibling(out, "tmp")
            with signals_deferred():  # the file and self._tmp come into being together
                self._sink = open(tmp, "wb")  # noqa: SIM115 (closed in close/abort)
                self._tmp = tmp
        try:
            self._writer = pa.ipc.new_stream(self._sink, self.schema)
        except BaseException:
            self.abort()
            raise

    def write(self, columns: Mapping[str, Sequence[Any]] | pa.RecordBatch) -> None:
        batch = columns if isinstance(columns, pa.RecordBatch) else self._batch(columns)
        if batch.num_rows == 0:
            return
        self._writer.write_batch(batch)
        self._sink.flush()
        self.rows += batch.num_rows

    def _batch(self, columns: Mapping[str, Sequence[Any]]) -> pa.RecordBatch:
        missing = [f.name for f in self.schema if f.name not in columns and not f.nullable]
        if missing:
            raise ValueError(f"internal: {self.kind.name} batch lacks columns {missing}")
        n = len(next(iter(columns.values())))
        arrays = [
            pa.array(columns[f.name], type=f.type) if f.name in columns else pa.nulls(n, f.type)
            for f in self.schema
        ]
        return pa.record_batch(arrays, schema=self.schema)

    def close(self) -> None:
        empty = pa.record_batch([pa.array([], type=f.type) for f in self.schema], schema=self.schema)
        self._writer.write_batch(empty, custom_metadata={END_KEY: str(self.rows)})
        self._writer.close()
        self._sink.flush()
        if self._tmp is not None:
            os.fsync(self._sink.fileno())
            self._sink.close()
            _swap_into_place(self._tmp, self.out)

    def abort(self) -> None:
        """Leave no file behind; on stdout, stop without the end marker so the reader fails."""
        if self._tmp is not None:
            try:
                self._sink.close()  # flushes: on a full disk this fails too, and closes the file all the same
            except OSError:
                pass
            finally:
                self._tmp.unlink(missing_ok=True)  # after close() renamed it, this is a no-op
        else:
            try:
                self._sink.flush()
            except OSError:
                pass


@contextmanager
def write_table(kind_name: str, out: Path | None, manifest: Mapping[str, Any],
                extra: Sequence[pa.Field] = ()) -> Iterator[TableWriter]:
    w = TableWriter(kind_name, out, manifest, extra)
    try:
        yield w
        w.close()
    except BaseException:
        w.abort()
        raise


# ---------------------------------------------------------------------------------------------
# Reading tables


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
        if not problems:
            return manifest
        errors.append(problems)
    first = min(errors, key=len)
    raise RlkitError(f"{label}: {first[0]}; a {names} table is made by {makers}")


class TableReader:
    """Iterates the record batches of a table file or of stdin, checking schema and completeness."""

    def __init__(self, src: str | Path | None, kinds: Sequence[str]) -> None:
        self.from_stdin = src is None or str(src) == "-"
        if self.from_stdin:
            if sys.stdin.isatty():
                raise RlkitError("no input table: pass --in FILE, or pipe one in from an upstream rlkit stage")
            self.label = "stdin"
            self._piped = True
            self._source: Any = sys.stdin.buffer
        else:
            p = Path(src)
            if not p.exists():
                raise RlkitError(f"{p}: no such file")
            if p.is_dir():
                raise RlkitError(f"{p} is a directory, expected an Arrow table file")
            self.label = str(p)
            # a FIFO or /dev/fd/N (bash `--in <(...)`) cannot seek: read it like stdin
            self._piped = not p.is_file()
            self._source = open(p, "rb") if self._piped else pa.OSFile(str(p), "rb")  # noqa: SIM115
        try:
            self._reader = pa.ipc.open_stream(self._source)
        except (pa.ArrowInvalid, OSError) as e:  # random bytes: OSError ("Expected to read ... metadata bytes")
            if self.from_stdin:
                raise RlkitError(
                    "stdin holds no Arrow stream: the upstream stage wrote nothing (did it fail?)"
                ) from e
            hint = " (a Parquet file? rlkit tables are Arrow IPC streams; pass it as --prompts/--data)" if (
                self.label.endswith(".parquet")) else ""
            raise RlkitError(f"{self.label} is not an Arrow IPC stream table: {str(e).splitlines()[0]}{hint}") from e
        self.schema: pa.Schema = self._reader.schema
        self.manifest = validate_schema(self.schema, kinds, self.label)
        self.kind = self.manifest["kind"] if self.manifest else kinds[0]
        self.fingerprint = (
            stream_fingerprint(self.manifest) if self.from_stdin or self._piped else fingerprint(Path(src))
        )
        self.rows = 0
        self._queue: queue.SimpleQueue | None = None

    def prefetch(self) -> TableReader:
        """Drain the stream into memory on a background thread from now on; iterating takes from it.

        A stage calls this before importing torch and loading its model: a pipe whose reader is busy
        for seconds fills after 64 KiB and stalls every stage upstream of it.
        """
        if self._queue is None:
            self._queue = q = queue.SimpleQueue()

            def drain() -> None:
                try:
                    for batch in self._batches():
                        q.put(batch)
                    q.put(None)
                except BaseException as e:  # handed to the consumer, raised there
                    q.put(e)

            threading.Thread(target=drain, name="rlkit-prefetch", daemon=True).start()
        return self

    def batches(self, idle: Callable[[], bool], every: float = 0.2) -> Iterator[pa.RecordBatch]:
        """Like iterating, but while no batch comes for `every` seconds `idle()` is asked, and
        DownstreamClosed raised when it says True (a `--follow` stage whose reader has gone)."""
        if self._queue is None:
            self.prefetch()
        assert self._queue is not None
        while True:
            try:
                item = self._queue.get(timeout=every)
            except queue.Empty:
                if idle():
                    raise DownstreamClosed(self.label) from None
                continue
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        if self._queue is None:
            yield from self._batches()
            return
        while (item := self._queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def _batches(self) -> Iterator[pa.RecordBatch]:
        ended = False
        while True:
            try:
                batch, meta = self._reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError) as e:  # OSError: a message body cut short ("Expected to be able to read")
                raise TruncatedStream(
                    f"{self.label}: truncated Arrow stream after {self.rows} rows ({e}); "
                    "the upstream stage died before finishing"
                ) from e
            if meta is not None and END_KEY.encode() in meta:
                ended = True
                continue
            self.rows += batch.num_rows
            yield batch
        if self.manifest is not None and not ended:
            raise TruncatedStream(
                f"{self.label}: stream ended after {self.rows} rows without rlkit's end marker; "
                "the upstream stage died before finishing"
            )

    def read_all(self, require_rows: bool = True) -> pa.Table:
        table = pa.Table.from_batches(list(self), schema=self.schema)
        if require_rows and table.num_rows == 0:
            raise RlkitError(f"{self.label}: the table has no rows")
        return table


class PendingTable:
    """A table being opened and drained by a background thread (see `open_table`)."""

    def __init__(self, src: str | Path | None, kinds: Sequence[str]) -> None:
        if (src is None or str(src) == "-") and sys.stdin.isatty():
            TableReader(src, kinds)  # raises its one-line error now, not after the caller's imports
        self._done = threading.Event()
        self._reader: TableReader | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._open, args=(src, kinds), name="rlkit-open", daemon=True).start()

    def _open(self, src: str | Path | None, kinds: Sequence[str]) -> None:
        try:
            self._reader = TableReader(src, kinds).prefetch()
        except BaseException as e:  # raised in the caller by result()
            self._error = e
        finally:
            self._done.set()

    def result(self) -> TableReader:
        """Wait for the schema; raise what opening raised (bad input), or return the prefetching reader."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._reader is not None
        return self._reader


def open_table(src: str | Path | None, kinds: Sequence[str]) -> PendingTable:
    """Open a table (file or stdin) on a background thread that then reads ahead into memory.

    For stages that spend seconds importing torch and loading a model before they consume input:
    in a pipe, every stage then imports at once and the upstream keeps streaming instead of
    blocking on a full pipe buffer. Call `.result()` once the model is loaded.
    """
    return PendingTable(src, kinds)


def read_table(src: str | Path | None, kinds: Sequence[str], require_rows: bool = True) -> tuple[pa.Table, TableReader]:
    r = TableReader(src, kinds)
    return r.read_all(require_rows), r

