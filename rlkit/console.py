"""Terminal output: everything human-readable goes to stderr, so stdout stays free for Arrow streams."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

# markup=False: what rlkit prints holds paths, run names, table rows and error text, where rich would read
# `runs/[a]` or `rlkit[track]` as a style tag and drop it (or fail on `[/x]`); styles are given as Text instead
err = Console(stderr=True, highlight=False, markup=False)
_warnings = err  # warn()'s console: err itself, unless -q made err quiet

# --log-level / -q (every command): rlkit's own lines at this level and above. `error` keeps only errors,
# which rlkit.cli prints whatever the level.
LEVELS = ("debug", "info", "warning", "error")
_level = 20  # logging.INFO
# The libraries whose logs go through the same handler, at warning unless debug is asked for; the
# environment variables are read when each library first loads, after the command line is parsed.
_LIBRARY_LEVEL_ENV = {"TRANSFORMERS_VERBOSITY": str.lower, "DATASETS_VERBOSITY": str.lower,
                      "VLLM_LOGGING_LEVEL": str.upper, "MLFLOW_LOGGING_LEVEL": str.upper}


def set_level(name: str) -> None:
    """Send Python `logging` (libraries: torch, peft, vLLM, ...) through one `rich.logging.RichHandler` on
    stderr, at `name` for rlkit and at warning (or `name`, when it is debug or error) for libraries."""
    import logging
    import os

    from rich.logging import RichHandler

    global _level, err
    if name not in LEVELS:
        raise ValueError(f"--log-level {name!r}: expected one of {', '.join(LEVELS)}")
    _level = getattr(logging, name.upper())
    if _level > logging.INFO:  # no progress, tables or summaries; warn() keeps its own console
        err = Console(stderr=True, quiet=True, markup=False)
    lib = name if name in ("debug", "error") else "warning"
    for var, case in _LIBRARY_LEVEL_ENV.items():
        os.environ[var] = case(lib)
    if "transformers" in sys.modules:  # loaded already (rlkit used from Python): it read its variable then
        sys.modules["transformers"].logging.set_verbosity(getattr(logging, lib.upper()))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"  # vLLM's loggers propagate to the root logger's handler
    root = logging.getLogger()
    if not any(isinstance(h, RichHandler) for h in root.handlers):  # once per process
        root.addHandler(RichHandler(console=_warnings, show_time=False, show_path=False, markup=False))
    root.setLevel(getattr(logging, lib.upper()))


def shows_info() -> bool:
    """Whether info lines print (not under -q or --log-level warning/error)."""
    return _level <= 20


def info(msg: str) -> None:
    if _level <= 20:
        err.print(msg, soft_wrap=True)  # one log line stays one line, whatever the width




def silence() -> None:
    """No terminal output from this process (data-parallel ranks other than 0; errors still print)."""
    global err, _warnings
    err = _warnings = Console(stderr=True, quiet=True, markup=False)


def print_wide(renderable, min_width: int = 132) -> None:
    """Print a wide table whole: a log file or CI pane is not limited to the 80 columns rich assumes."""
    if err.is_terminal:
        err.print(renderable)
    else:
        Console(stderr=True, highlight=False, markup=False, width=max(err.width, min_width)).print(renderable)


def warn(msg: str) -> None:
    if _level <= 30:
        from rich.text import Text

        _warnings.print(Text.assemble(("warning:", "bold yellow"), " ", msg), soft_wrap=True)


class _Ticker:
    """Progress for a known number of units, or (total None: a stream) a count and its rate; fields
    (loss, tok/s) are updated as work goes."""

    def __init__(self, progress, task_id, desc: str, total: int | None, every: float, unit: str = "") -> None:
        self._p, self._id, self._desc, self.total, self._unit = progress, task_id, desc, total, unit
        self._done, self._fields, self._every = 0, "", every
        self._t0 = self._last = time.monotonic()

    def advance(self, n: int = 1, **fields: float | str) -> None:
        self._done += n
        if fields:
            self._fields = "  ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items()
            )
        now = time.monotonic()
        if self.total is None:  # a stream: how many so far, at what rate
            self._fields = f"{self._done:,} {self._unit} ({self._done / max(now - self._t0, 1e-9):,.0f} {self._unit}/s)"
        if self._p is not None:
            self._p.update(self._id, advance=n, fields=self._fields)
            return
        if self.total is None:
            if now - self._last >= self._every and _level <= 20:
                self._last = now
                err.print(f"{self._desc}: {self._fields} [{now - self._t0:.1f}s]", soft_wrap=True)
            return
        if (now - self._last >= self._every or self._done >= self.total) and _level <= 20:
            self._last = now
            spent = now - self._t0
            left = spent / self._done * (self.total - self._done) if 0 < self._done < self.total else 0.0
            eta = f" eta {_clock(left)}" if self._done < self.total else ""
            err.print(f"{self._desc}: {self._done}/{self.total} [{spent:.1f}s{eta}] {self._fields}", soft_wrap=True)


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


@contextmanager
def progress(desc: str, total: int | None, every: float = 10.0, unit: str = "") -> Iterator[_Ticker]:
    """A rich progress bar on a terminal (elapsed, time remaining); otherwise a log line every `every`
    seconds with the time spent and `eta`, the time left at the rate so far (CI, pipes). `total` None (a
    stream of unknown length): the count of `unit`s and their rate instead. Neither under -q."""
    if err.is_terminal and sys.stderr.isatty() and _level <= 20:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[fields]}"),
            console=err,
            transient=False,
        ) as p:
            yield _Ticker(p, p.add_task(desc, total=total, fields=""), desc, total, every, unit)
    else:
        yield _Ticker(None, None, desc, total, every, unit)
