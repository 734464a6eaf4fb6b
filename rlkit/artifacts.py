"""Every on-disk format rlkit reads or writes: table schemas, manifests, fingerprints, atomic writes.

Tables are Arrow IPC *stream* files. Each carries a manifest (JSON) in its schema metadata under the
key ``rlkit`` and ends with an empty record batch whose custom metadata holds ``rlkit.end`` (the row
count). Plain pyarrow and ``datasets.Dataset.from_file`` read these files as usual; rlkit readers use
the end marker to tell a finished stream from one whose producer died (pyarrow alone cannot: a
stream cut at a message boundary reads as a shorter, valid stream).

Model directories are Hugging Face ``save_pretrained`` layouts plus ``rlkit.json`` (see
``rlkit.checkpoints``); this module fingerprints them and swaps them into place atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
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


def make_manifest(kind: str, command: str, config: Any, inputs: Mapping[str, str], **extra: Any) -> dict:
    """The manifest every artifact carries: what made it, from what, with which settings."""
    k = KINDS.get(kind)
    return {
        "kind": kind,
        "schema_version": k.version if k else 1,
        "command": command,
        "config": jsonable(config),
        "inputs": dict(inputs),
        "rlkit_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
    try:
        with pa.OSFile(str(p), "rb") as f:
            schema = pa.ipc.open_stream(f).schema
    except (OSError, pa.ArrowException):
        return None
    raw = (schema.metadata or {}).get(SCHEMA_KEY)
    return json.loads(raw) if raw else None


def _comparable(config: Any) -> Any:
    cfg = jsonable(config)
    if isinstance(cfg, dict):
        cfg = {k: v for k, v in cfg.items() if k not in ("force", "out")}
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


def _tmp_sibling(out: Path, tag: str) -> Path:
    return out.parent / f".{out.name}.{tag}-{os.getpid()}-{secrets.token_hex(3)}"


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM for a few syscalls, so a rename pair is never cut in half."""
    import signal

    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _swap_into_place(tmp: Path, out: Path) -> None:
    with _signals_deferred():
        if out.is_dir():
            old = _tmp_sibling(out, "old")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)


@contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; it replaces `out` only if the block finishes.

    Any exception, Ctrl-C or SIGTERM (turned into KeyboardInterrupt by the CLI) removes it and
    leaves whatever was at `out` untouched.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(out, "tmp")
    try:
        tmp.mkdir()
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _swap_into_place(tmp, out)


@contextmanager
def atomic_file(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling path to write; it replaces `out` only if the block finishes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(out, "tmp")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _swap_into_place(tmp, out)


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
            with _signals_deferred():  # the file and self._tmp come into being together
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
            self._sink.close()
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
    manifest = json.loads(raw) if raw else None
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
        except pa.ArrowInvalid as e:
            if self.from_stdin:
                raise RlkitError(
                    "stdin holds no Arrow stream: the upstream stage wrote nothing (did it fail?)"
                ) from e
            raise RlkitError(f"{self.label} is not an Arrow IPC stream table ({e})") from e
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


def reward_columns(schema: pa.Schema) -> list[str]:
    """Names of the reward components in a rollouts/scored table (without the `reward/` prefix)."""
    return [n.split("/", 1)[1] for n in schema.names if n.startswith("reward/")]
