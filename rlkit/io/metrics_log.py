"""The JSON-lines metrics file (`--metrics FILE`): where stage metrics go besides the screen and the manifest.

One metrics file collects every stage's rows in order (`update` rows: reward components, KL, entropy,
clip fraction, length, drift; `eval` rows: held-out accuracy; `sft`/`train-rm` rows at step 0), keyed by
the policy `step`, so a recipe's whole run is one file that `rlkit report` plots. The same rows go to the
experiment trackers (`rlkit.io.tracking`).

The file is an output like `--out` (`claims.claim_out` checks it before any work with `check_target`):
rows are appended only to a new file or to one of metrics rows, never to a table, a checkpoint's file or
any other file. A row is one `write` of one line; a write that fails (no space, file-size limit) leaves
the file as it was, and `appending` takes a row back out when the output it describes is not written.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# how much of an existing file `check_target` reads to tell a metrics file (the rows at its start)
HEAD_BYTES = 1 << 16


def check_target(label: str, path: Path) -> None:
    """Refuse a --metrics path that exists and is not a metrics file: a directory, an rlkit table, or a file
    whose lines are not JSON objects with 'stage' and 'step' (the rows rlkit writes). New, empty, a metrics
    file, or not a regular file (/dev/stderr, a FIFO): fine."""
    from rlkit.errors import RlkitError
    from rlkit.io.manifests import read_manifest

    if not path.exists():
        return
    if path.is_dir():
        raise RlkitError(f"{label} {path} is a directory, expected a metrics file (JSON lines) to append to: "
                         f"choose a file path, e.g. {path / 'metrics.jsonl'}")
    if not path.is_file():
        return
    m = read_manifest(path)
    if m is not None:
        raise RlkitError(f"{label} {path} is an rlkit '{m.get('kind')}' table, not a metrics file; refusing to append "
                         "to it: choose another path (a new file, or a metrics file)")
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
    if len(head) == HEAD_BYTES and b"\n" in head:
        head = head[: head.rindex(b"\n")]  # whole lines only
    for i, line in enumerate(head.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            row = None
        if not (isinstance(row, dict) and "stage" in row and "step" in row):
            raise RlkitError(f"{label} {path} exists and is not a metrics file (line {i} is not a JSON row with "
                             "'stage' and 'step'); refusing to append to it: choose another path (a new file, or "
                             "a metrics file rlkit wrote)")


def write(row: dict[str, Any], jsonl: Path | None = None) -> None:
    """Append `row` (with 'stage' and 'step') to the JSON-lines file as one line. A failed write (no space,
    the file-size limit) leaves the file as it was and is one line, exit 74."""
    _append(row, jsonl)


@contextmanager
def appending(row: dict[str, Any], jsonl: Path | None) -> Iterator[None]:
    """Append `row` now and take it back out if the block raises: wrap the write of the output the row
    describes, so that the metrics file never holds a row of a checkpoint that was not written (and a full
    disk found by the row stops the stage before it publishes anything)."""
    undo = _append(row, jsonl)
    try:
        yield
    except BaseException:
        undo()
        raise


def _append(row: dict[str, Any], jsonl: Path | None) -> Callable[[], None]:
    """Append one line; returns what takes it back out (only while nothing else was appended after it)."""
    if jsonl is None:
        return lambda: None
    from rlkit.io.atomic import OutputUnwritable, _out_of_space, _remove_empty

    line = (json.dumps(row) + "\n").encode()
    made = [p for p in (jsonl.parent, *jsonl.parent.parents) if not p.exists()]
    existed = jsonl.exists()
    fd = -1
    try:
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(jsonl, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        start = os.fstat(fd).st_size if regular else 0
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
            if regular:
                os.fsync(fd)
        except OSError:
            if regular:
                _take_back(jsonl, fd, start, existed)
            raise
    except OSError as e:
        _remove_empty(made)
        why = _out_of_space(e) or e.strerror or str(e)
        raise OutputUnwritable(f"cannot write --metrics {jsonl}: {why}; the file is as it was (free space, raise the "
                               "file-size limit, or choose another location)") from None
    finally:
        if fd >= 0:
            os.close(fd)
    end = start + len(line)

    def undo() -> None:
        if not regular:
            return
        try:
            with open(jsonl, "r+b") as f:
                if os.fstat(f.fileno()).st_size == end:  # nothing appended after our row
                    _take_back(jsonl, f.fileno(), start, existed)
        except OSError:
            pass
        _remove_empty(made)

    return undo


def _take_back(path: Path, fd: int, start: int, existed: bool) -> None:
    """The file as it was before our append: gone if we made it, else cut back to `start` bytes."""
    try:
        if existed:
            os.ftruncate(fd, start)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass
