"""The call timer: a time limit on a call into the user's code (a reward function), in the stage's own process.

The limit is a real-time timer (`setitimer(ITIMER_REAL)`) whose SIGALRM raises `TimedOut` in the main thread: it
interrupts a busy Python loop and a sleep alike. Only the main thread takes signals, so elsewhere there is no
limit. The handler is set once for many calls (`alarm_handler`), each call armed on its own (`timed`)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class TimedOut(BaseException):
    """Raised inside a reward function whose call overran its time limit (a BaseException, so the
    function's own `except Exception` does not swallow it)."""


def _on_alarm(signum, frame) -> None:  # noqa: ARG001 (the signal handler's signature)
    raise TimedOut


@contextmanager
def alarm_handler(seconds: float) -> Iterator[float]:
    """For the body, SIGALRM raises `TimedOut`; the previous handler is restored after. -> the limit each
    call then arms with a real-time timer (`timed`), whose alarm interrupts a busy Python loop and
    a sleep alike: `seconds`, or 0 (no limit) outside the main thread, the only one that takes signals.
    The handler is set once for many calls: setting it costs more than the timer."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield 0
        return
    old = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        yield seconds
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, old)


def timed(fn: Callable, limit: float, **kwargs):
    """`fn(**kwargs)`, stopped by `TimedOut` after `limit` seconds (0: no limit), inside an `alarm_handler`."""
    if limit:
        signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        return fn(**kwargs)
    finally:
        if limit:
            signal.setitimer(signal.ITIMER_REAL, 0)
