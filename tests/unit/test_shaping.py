"""DAPO's soft overlong punishment (rlkit.ops.shaping): its values at the buffer's edges."""

from __future__ import annotations

import pytest

from rlkit.ops.shaping import overlong_penalty


def test_the_penalty_at_the_buffers_edges():
    # max 16 tokens, a buffer of 4: free up to 12, then -1/4 a token, -1 at the limit and past it
    assert overlong_penalty([0, 11, 12, 13, 14, 15, 16, 17], 16, 4, 1.0) == [0, 0, 0, -0.25, -0.5, -0.75, -1, -1]
    assert overlong_penalty([12, 14, 16], 16, 4, 0.5) == [0, -0.25, -0.5]  # the penalty factor scales it
    assert overlong_penalty([1, 2], 2, 2, 1.0) == [-0.5, -1.0]  # a buffer as long as the limit: from the first token
    with pytest.raises(ValueError):
        overlong_penalty([1], 16, 0, 1.0)
