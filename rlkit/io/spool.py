"""A spool directory: M rollout workers feeding one `update --follow` through a (shared) filesystem.

Each worker (`rollout --follow DIR --shard I/M --spool SPOOL`, or a worker's pipe ending in
`score-ref --spool SPOOL`) writes every batch of its stream as one complete Arrow file; one
`update --follow --in SPOOL` trains on them. Layout of SPOOL::

    b000003-w01of02-s000002.arrow   batch 3 of worker 1 of 2, sampled by policy step 2: complete
    .b000004-w01of02-s000003.arrow.tmp-PID-XXXXXX   being written: hidden, never read
    .w01of02.lock                   flock'ed by the one worker writing shard 1/2
    .lock                           flock'ed by the one update consuming the spool
    claimed/                        files the update took (by rename) and has not yet trained into a step
    done/                           trained files, kept with `update --keep-batches` (else deleted)
    w01of02.end                     worker 1/2 ended its stream (--max-steps)
    update.end                      the update ended cleanly; holds the last step it published

A name says what the update needs before it opens the file: the batch b (whose prompts are those of
`rollout --seed SEED+b+1 --num-prompts P`, this worker's shard of them), the worker's shard I/M and
the policy step that sampled it. A file is written under a hidden name and renamed into place once
its end marker is written and fsynced, so a worker killed mid-batch leaves nothing the update reads.
The update claims a file by renaming it into claimed/ before it reads it: of two processes
claiming one file, one rename fails, so no batch is trained twice.

Pure filesystem code: no torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlkit.errors import RlkitError

NAME_RE = re.compile(r"^b(\d{6,})-w(\d{2,})of(\d{2,})-s(\d{6,})\.arrow$")
CLAIMED = "claimed"
DONE = "done"
LOCK = ".lock"
UPDATE_END = "update.end"
POLL_SECONDS = 0.05


def worker_name(index: int, count: int) -> str:
    return f"w{index:02d}of{count:02d}"


def batch_name(batch: int, index: int, count: int, step: int) -> str:
    """The file name of batch `batch` of worker `index`/`count`, sampled by policy step `step`."""
    return f"b{batch:06d}-{worker_name(index, count)}-s{step:06d}.arrow"


@dataclass(frozen=True, order=True)
class BatchFile:
    """One complete batch file; ordered as the update consumes them: by batch, then by worker."""

    batch: int
    worker: int
    workers: int
    step: int
    path: Path

    @property
    def who(self) -> str:
        return f"worker {self.worker}/{self.workers}"


def parse(path: Path) -> BatchFile | None:
    m = NAME_RE.match(path.name)
    if m is None:
        return None
    b, i, count, s = (int(g) for g in m.groups())
    return BatchFile(b, i, count, s, path)


def _foreign(root: Path, name: str) -> RlkitError:
    return RlkitError(f"spool {root}: '{name}' is not a spool file; a spool holds only bNNNNNN-wIIofMM-sNNNNNN.arrow "
                      "batches written by `rollout --spool` or `score-ref --spool` (choose an empty or new directory)")


def check_root(root: Path, what: str) -> None:
    """Refuse a spool path that exists but is not a spool directory (a file, a model or follow directory)."""
    if not root.exists():
        return
    if not root.is_dir():
        raise RlkitError(f"{what} {root} is a file, expected a spool directory of batch files")
    scan(root)


def scan(root: Path) -> list[BatchFile]:
    """The complete batch files in `root`, in consumption order. Raises on anything foreign."""
    out = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for e in entries:
        if e.name.startswith(".") or e.name in (CLAIMED, DONE, UPDATE_END) or e.name.endswith(".end"):
            continue
        f = parse(Path(e.path))
        if f is None or not e.is_file(follow_symlinks=False):
            raise _foreign(root, e.name)
        out.append(f)
    return sorted(out)


def claimed(root: Path) -> list[BatchFile]:
    """The files an update took and has not disposed of (a killed update's, at its restart)."""
    d = root / CLAIMED
    if not d.is_dir():
        return []
    return sorted(f for f in (parse(p) for p in d.iterdir()) if f is not None)


def exists(root: Path, batch: int, index: int, count: int) -> bool:
    """Whether worker `index`/`count` already wrote batch `batch` (waiting, claimed or kept)."""
    pre = f"b{batch:06d}-{worker_name(index, count)}-"
    for d in (root, root / CLAIMED, root / DONE):
        try:
            if any(n.startswith(pre) for n in os.listdir(d)):
                return True
        except FileNotFoundError:
            continue
    return False


def claim(f: BatchFile) -> BatchFile | None:
    """Move `f` into claimed/ (one rename): the claimed file, or None when another process took it first."""
    d = f.path.parent / CLAIMED
    d.mkdir(exist_ok=True)
    dest = d / f.path.name
    try:
        os.rename(f.path, dest)
    except FileNotFoundError:
        return None
    return BatchFile(f.batch, f.worker, f.workers, f.step, dest)


def unclaim(root: Path, f: BatchFile) -> None:
    """Put a claimed file back (an update killed before it trained it)."""
    os.rename(f.path, root / f.path.name)


def dispose(root: Path, f: BatchFile, keep: bool) -> None:
    """A trained (or dropped) claimed file: into done/ with `keep`, else deleted."""
    if keep:
        (root / DONE).mkdir(exist_ok=True)
        os.replace(f.path, root / DONE / f.path.name)
    else:
        f.path.unlink(missing_ok=True)


def ended_workers(root: Path) -> set[tuple[int, int]]:
    """(index, count) of every worker that ended its stream."""
    out = set()
    for n in os.listdir(root) if root.is_dir() else ():
        m = re.match(r"^w(\d{2,})of(\d{2,})\.end$", n)
        if m:
            out.add((int(m.group(1)), int(m.group(2))))
    return out


def _write_marker(path: Path, text: str) -> None:
    from rlkit.io.atomic import fsync_dir

    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def mark_worker_end(root: Path, index: int, count: int) -> None:
    _write_marker(root / f"{worker_name(index, count)}.end", "ended\n")


def mark_update_end(root: Path, step: int) -> None:
    _write_marker(root / UPDATE_END, f"{step}\n")


def update_ended(root: Path, before: tuple | None = None) -> int | None:
    """The last step of an update that ended cleanly on this spool, or None while one runs (or none has). `before`:
    the marker's `marker_id` when the caller started; that marker (an earlier run's) does not count."""
    p = root / UPDATE_END
    try:
        if before is not None and marker_id(root) == before:
            return None
        return int(p.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def marker_id(root: Path) -> tuple | None:
    """The identity of `update.end` as it is now (a new marker is a new file: written, then renamed into place)."""
    try:
        st = (root / UPDATE_END).stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


@contextmanager
def held(root: Path, lock_name: str, busy: str) -> Iterator[None]:
    """Hold `root/lock_name` (flock) for the block; another holder is refused with `busy` (exit 75, its pid named)."""
    from rlkit.io.atomic import OutputUnwritable
    from rlkit.io.claims import OutputBusy, flock_file

    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = flock_file(root / lock_name, lambda holder: OutputBusy(f"{busy} (pid {holder})"))
    except OSError as e:
        raise OutputUnwritable(f"cannot write the spool {root}: {e.strerror or e} ({e.filename or root}); choose a "
                               "writable location") from None
    try:
        yield
    finally:
        os.close(fd)


def clean_worker(root: Path, index: int, count: int) -> list[str]:
    """Remove the hidden unfinished files a killed worker `index`/`count` left (call with its lock held)."""
    gone = []
    pre = ".b"
    tag = f"-{worker_name(index, count)}-"
    for e in list(os.scandir(root)):
        if e.name.startswith(pre) and tag in e.name and ".arrow." in e.name:
            os.unlink(e.path)
            gone.append(e.name)
    return gone


@dataclass(frozen=True)
class Geometry:
    """How a worker's stream is cut into batch files (recorded by `rollout --follow` in its manifest's `follow`
    entry): `rows` samples a batch (its groups times --n: trajectories under --env, each of one row or of several,
    the earlier ones ending `continued`), batch b's group ids in [b * `prompts`, (b + 1) * `prompts`), the worker's
    shard `index`/`count` of every batch's prompts."""

    rows: int
    prompts: int
    index: int
    count: int

    @classmethod
    def of(cls, follow_entry: dict | None, label: str) -> Geometry:
        f = follow_entry or {}
        if "rows_a_batch" not in f:
            raise RlkitError(f"--spool writes the batches of a `rollout --follow` stream; {label} is not one (its "
                             "manifest records no follow batches)")
        sh = f.get("shard") or {"index": 0, "count": 1}
        return cls(int(f["rows_a_batch"]), int(f["prompts_a_batch"]), int(sh["index"]), int(sh["count"]))


class SpoolWriter:
    """The writer of a follow stream into a spool: the rows of batch b go to their own file, complete (renamed into
    place with its end marker) as soon as the batch's last sample is written (its last row: a trajectory of several
    rows ends at the one whose `end_reason` is not "continued"). Same `write` as `streams.TableWriter`. A batch whose
    file this worker already wrote (a restarted worker's pipe samples its batch again) is skipped."""

    def __init__(self, root: Path, kind_name: str, manifest: dict, extra, geometry: Geometry) -> None:
        self.root, self.kind_name, self.manifest, self.extra, self.g = root, kind_name, manifest, extra, geometry
        self.rows = 0  # rows written so far (as `TableWriter.rows`)
        self.cur = None  # (TableWriter or None while skipping, batch, samples so far)
        self.skipped: list[int] = []
        from rlkit.io import streams

        self.kind = streams.kind(kind_name)
        self.schema = self.kind.schema(extra, manifest)  # the columns every batch file has (as `TableWriter`'s)

    def _open(self, batch, step: int) -> None:
        from rlkit import console
        from rlkit.io import streams

        b = int(batch.column("group_id")[0].as_py()) // self.g.prompts
        if exists(self.root, b, self.g.index, self.g.count):
            self.skipped.append(b)
            console.info(f"spool: {worker_name(self.g.index, self.g.count)} already wrote batch {b}; its rows sampled "
                         "again are not written twice")
            self.cur = (None, b, 0)
            return
        out = self.root / batch_name(b, self.g.index, self.g.count, step)
        self.cur = (streams.TableWriter(self.kind_name, out, self.manifest, self.extra), b, 0)

    def write(self, columns) -> None:
        import numpy as np
        import pyarrow as pa

        if not isinstance(columns, pa.RecordBatch):
            from rlkit.io import streams

            columns = streams.TableWriter._batch(self, columns)  # reads the schema and kind, as TableWriter's
        while columns.num_rows:
            if self.cur is None:
                self._open(columns, int(columns.column("policy_step")[0].as_py()))
            w, b, n = self.cur
            done = np.cumsum(_ends(columns))  # samples finished by each row
            take = int(np.searchsorted(done, self.g.rows - n) + 1) if done[-1] >= self.g.rows - n else columns.num_rows
            part, columns = columns.slice(0, take), columns.slice(take)
            groups = part.column("group_id").to_numpy() // self.g.prompts
            if (groups != b).any():
                bad = int((groups != b).argmax())
                raise RlkitError(f"spool: batch {b} of {worker_name(self.g.index, self.g.count)} ended after "
                                 f"{n + int(done[bad - 1] if bad else 0)} of its {self.g.rows} samples (a row of batch "
                                 f"{int(groups[bad])} came): the stream is not the one its manifest describes")
            if w is not None:
                w.write(part)
            self.rows += take
            n += int(done[take - 1])
            self.cur = (w, b, n)
            if n == self.g.rows:
                if w is not None:
                    w.close()
                self.cur = None

    def close(self) -> None:
        """The stream ended: a batch it left unfinished is not published (its hidden file is removed)."""
        self.abort()

    def abort(self) -> None:
        if self.cur is not None and self.cur[0] is not None:
            self.cur[0].abort()
        self.cur = None


def _ends(batch):
    """Whether each row of a record batch ends its sample: every row, but a trajectory's rows before its last
    (`end_reason` "continued")."""
    import numpy as np

    if "end_reason" not in batch.schema.names:
        return np.ones(batch.num_rows, dtype=np.int64)
    return np.array([e != "continued" for e in batch.column("end_reason").to_pylist()], dtype=np.int64)


@contextmanager
def worker(root: Path, index: int, count: int) -> Iterator[None]:
    """Be worker `index`/`count` of the spool `root` for the block: hold its lock (a second worker on the same shard
    is refused, exit 75), remove what a killed one left unfinished, and keep its heartbeat moving from the start, so
    a worker still loading its engine is alive to the update (`heartbeat`)."""
    from rlkit import console

    check_root(root, "--spool")
    me = worker_name(index, count)
    with held(root, f".{me}.lock", f"--spool {root}: shard {index}/{count} is being written by another worker; one "
                                   "worker per shard"):
        others = {f.workers for f in scan(root)} - {count}
        if others:
            raise RlkitError(f"--spool {root} holds batches of {sorted(others)[0]} workers; this one is shard "
                             f"{index}/{count} (every worker of a run takes --shard I/M with one M)")
        gone = clean_worker(root, index, count)
        if gone:
            console.info(f"spool: removed {len(gone)} unfinished batch file(s) a killed {me} left")
        (root / f"{me}.end").unlink(missing_ok=True)
        beat = _Heartbeat(root / f".{me}.lock")
        try:
            yield
        finally:
            beat.stop()


@contextmanager
def writer(root: Path, kind_name: str, manifest: dict, extra, geometry: Geometry) -> Iterator[SpoolWriter]:
    """Write a follow stream into the spool `root` as worker `geometry.index`/`geometry.count` (inside `worker`)."""
    w = SpoolWriter(root, kind_name, manifest, extra, geometry)
    try:
        yield w
        w.close()
    except BaseException:
        w.abort()
        raise


@contextmanager
def writing(root: Path, kind_name: str, manifest: dict, extra, geometry: Geometry) -> Iterator[SpoolWriter]:
    """`writer` inside `worker`: one worker's whole stream."""
    with worker(root, geometry.index, geometry.count), writer(root, kind_name, manifest, extra, geometry) as w:
        yield w


HEARTBEAT_SECONDS = 1.0


class _Heartbeat:
    """While a worker runs, its lock file's modification time moves every HEARTBEAT_SECONDS (a daemon thread), so the
    update tells a worker that is alive but slow (a long batch, a wait for its step) from one that is gone, on any
    machine that sees the spool (`heartbeat`)."""

    def __init__(self, path: Path) -> None:
        import threading

        self.path, self.done = path, threading.Event()
        threading.Thread(target=self._run, name="rlkit-spool-heartbeat", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                os.utime(self.path)
            except OSError:
                pass
            if self.done.wait(HEARTBEAT_SECONDS):
                return

    def stop(self) -> None:
        self.done.set()


def heartbeats(root: Path) -> dict[str, int]:
    """Every worker's heartbeat (`heartbeat`) by its lock file's name: which workers have started, and when they
    last beat."""
    out = {}
    for e in os.scandir(root):
        if re.match(r"^\.w\d{2,}of\d{2,}\.lock$", e.name):
            try:
                out[e.name] = e.stat().st_mtime_ns
            except FileNotFoundError:
                continue
    return out


def heartbeat(root: Path, index: int, count: int) -> int | None:
    """Worker `index`/`count`'s last heartbeat as its lock file's mtime (ns), or None when it never started."""
    try:
        return (root / f".{worker_name(index, count)}.lock").stat().st_mtime_ns
    except FileNotFoundError:
        return None
