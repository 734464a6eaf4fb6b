"""User-facing errors: one clear line, a non-zero exit code, no traceback unless --debug."""

from __future__ import annotations


class RlkitError(Exception):
    """An error caused by the user's input or environment; printed as one line."""

    exit_code = 2


class TruncatedStream(RlkitError):
    """An Arrow stream ended before its producer wrote the end marker (upstream died)."""

    exit_code = 3


class DownstreamClosed(Exception):  # noqa: N818 (a signal, not a failure)
    """The stage reading our output has ended: in a `--follow` pipe the normal way for a run to end."""
