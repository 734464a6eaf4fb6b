"""Terminal output: everything human-readable goes to stderr, so stdout stays free for Arrow streams."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

err = Console(stderr=True, highlight=False)


def info(msg: str) -> None:
    err.print(msg, soft_wrap=True)  # one log line stays one line, whatever the width


def silence() -> None:
    """No terminal output from this process (data-parallel ranks other than 0; errors still print)."""
    global err
    err = Console(stderr=True, quiet=True)


def print_wide(renderable, min_width: int = 132) -> None:
    """Print a wide table whole: a log file or CI pane is not limited to the 80 columns rich assumes."""
    if err.is_terminal:
        err.print(renderable)
    else:
        Console(stderr=True, highlight=False, width=max(err.width, min_width)).print(renderable)


def warn(msg: str) -> None:
    err.print(f"[bold yellow]warning:[/] {msg}", soft_wrap=True)


class _Ticker:
    """Progress for a known number of units; fields (loss, tok/s) are updated as work goes."""

    def __init__(self, progress, task_id, desc: str, total: int, every: float) -> None:
        self._p, self._id, self._desc, self.total = progress, task_id, desc, total
        self._done, self._fields, self._every = 0, "", every
        self._t0 = self._last = time.monotonic()

    def advance(self, n: int = 1, **fields: float | str) -> None:
        self._done += n
        if fields:
            self._fields = "  ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items()
            )
        if self._p is not None:
            self._p.update(self._id, advance=n, fields=self._fields)
            return
        now = time.monotonic()
        if now - self._last >= self._every or self._done >= self.total:
            self._last = now
            err.print(f"{self._desc}: {self._done}/{self.total} [{now - self._t0:.1f}s] {self._fields}", soft_wrap=True)


@contextmanager
def progress(desc: str, total: int, every: float = 10.0) -> Iterator[_Ticker]:
    """A rich progress bar on a terminal; a log line every `every` seconds otherwise (CI, pipes)."""
    if err.is_terminal and sys.stderr.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[fields]}"),
            console=err,
            transient=False,
        ) as p:
            yield _Ticker(p, p.add_task(desc, total=total, fields=""), desc, total, every)
    else:
        yield _Ticker(None, None, desc, total, every)
