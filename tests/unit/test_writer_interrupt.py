"""An interrupt held while a table's temporary file is created is delivered the moment the hold ends, inside
`TableWriter`'s constructor: the file is removed and nothing is left beside --out (a signal that came just as a
stage started writing used to leave `.OUT.tmp-*` behind)."""

from __future__ import annotations

import builtins
import os
import signal

import pytest

from rlkit.io import streams


def test_an_interrupt_as_the_file_is_created_leaves_nothing(tmp_path, monkeypatch):
    def opening(path, mode="r", *a, **kw):  # the real file, with SIGINT raised while signals are held
        f = builtins.open(path, mode, *a, **kw)
        signal.raise_signal(signal.SIGINT)
        return f

    monkeypatch.setattr(streams, "open", opening, raising=False)
    # Ctrl-C's default handler, whatever this process inherited (a test runner's worker may ignore SIGINT)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        out = tmp_path / "t.arrow"
        with pytest.raises(KeyboardInterrupt), streams.write_table("prompts", out, {"kind": "prompts"}) as w:
            w.write({"prompt_id": ["a"], "prompt": ["x"]})
    finally:
        signal.signal(signal.SIGINT, old)
    assert os.listdir(tmp_path) == []
