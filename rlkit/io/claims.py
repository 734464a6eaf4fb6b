"""Claims and locks: before any work a stage claims every path it writes (--out and the side outputs): never an
input or inside one, never an artifact of another form, one writer per path (a kernel-held lock), leftovers of
killed writers cleaned."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError
from rlkit.io.atomic import OutputUnwritable, _out_of_space, _remove_empty
from rlkit.io.manifests import MODEL_MANIFEST, read_manifest
from rlkit.io.streams import drop_stdout_sink


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


class OutputBusy(RlkitError):
    """Another process holds the --out this stage was asked to write."""

    exit_code = 75  # EX_TEMPFAIL: try again once the other run has finished


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


def flock_file(lock: Path, busy: Callable[[str], Exception]) -> int:
    """Open and flock `lock` (kernel-held: dropped when this process dies, so never stale) and write this
    process's pid into it; returns the open descriptor. Held by another process: raise `busy(its pid)`."""
    import fcntl

    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise busy(holder) from None
        try:  # the previous holder may have unlinked the file between our open and our flock
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _lock(out: Path) -> int:
    """flock `.NAME.lock` beside `out` (`flock_file`). Returns the open descriptor."""
    return flock_file(out.parent / f".{out.name}.lock", lambda holder: OutputBusy(
        f"--out {out} is being written by another rlkit process (pid {holder}); wait for it to finish or choose "
        "another --out"))


def _unlock(out: Path, fd: int) -> None:
    try:
        os.unlink(out.parent / f".{out.name}.lock")  # while still holding it: see the inode check in flock_file
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
