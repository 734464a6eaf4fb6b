"""Table streams: Arrow IPC streams carrying their manifest in the schema metadata and ending with an end-marker
batch (a reader tells a finished stream from one whose producer died); files, pipes and the claimed stdout."""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.ipc

from rlkit.errors import DownstreamClosed, RlkitError, TruncatedStream
from rlkit.io.atomic import _swap_into_place, _tmp_sibling, signals_deferred
from rlkit.io.fingerprints import fingerprint, stream_fingerprint
from rlkit.io.manifests import Manifest
from rlkit.io.schemas import END_KEY, kind, validate_schema


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


_PYARROW_READY = False


def _load_pyarrow_converters() -> None:
    """Load what pyarrow loads on its first `pa.array` (pandas, where installed) before a table's first write,
    with Ctrl-C and SIGTERM held until it is done: pyarrow's lazy `import pandas` swallows whatever the import
    raises, so a Ctrl-C landing inside it was lost and the stage wrote on to the end, exit 0. Held here, the
    signal is raised again right after, before any output exists."""
    global _PYARROW_READY
    if _PYARROW_READY:
        return
    import signal

    if threading.current_thread() is not threading.main_thread():  # signal handlers are the main thread's
        pa.array([], type=pa.int32())
        _PYARROW_READY = True
        return
    held: list[int] = []
    sigs = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in sigs}
    try:
        pa.array([], type=pa.int32())
        _PYARROW_READY = True
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if held:
        signal.raise_signal(held[0])


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
        _load_pyarrow_converters()
        try:  # a signal held while the file is created is delivered as the hold ends: still inside this try
            if out is None:
                self._sink: BinaryIO = stdout_sink()
            else:
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp = _tmp_sibling(out, "tmp")
                with signals_deferred():  # the file and self._tmp come into being together
                    self._sink = open(tmp, "wb")  # noqa: SIM115 (closed in close/abort)
                    self._tmp = tmp
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
        elif getattr(self, "_sink", None) is not None:
            try:
                self._sink.flush()
            except OSError:
                pass


@contextmanager
def write_table(kind_name: str, out: Path | None, manifest: Mapping[str, Any],
                extra: Sequence[pa.Field] = ()) -> Iterator[TableWriter]:
    w = None
    try:  # the writer made inside the try: an interrupt the moment it exists still removes its file
        w = TableWriter(kind_name, out, manifest, extra)
        yield w
        w.close()
    except BaseException:
        if w is not None:
            w.abort()
        raise


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
        self.record = Manifest.parse(self.manifest)  # the same, parsed once
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
