"""Atomic writes: an output is written to a temporary sibling, fsynced and renamed into place (a directory by one
atomic exchange), so a failed, interrupted or killed stage leaves nothing half-written; running out of space
is one line (exit 74)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rlkit.errors import RlkitError


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


class OutputUnwritable(RlkitError):
    """The --out location cannot be written (read-only, no permission, no space)."""

    exit_code = 74  # EX_IOERR


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
