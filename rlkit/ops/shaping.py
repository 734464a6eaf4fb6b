"""Reward shaping by length, pure functions (no stage, no table): DAPO's soft overlong punishment.

DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", section 3.4): a response
cut at the length limit is penalised, but softly, so a response just short of it is not punished as hard as one
that ran out: with L_max the longest a response may be and a buffer of L_buf tokens below it,

    R_length(y) = 0                                      |y| <= L_max - L_buf
                = ((L_max - L_buf) - |y|) / L_buf         L_max - L_buf < |y| <= L_max
                = -1                                     |y| > L_max

times the penalty factor P (DAPO: 1), added to the task's reward.
"""

from __future__ import annotations

from collections.abc import Sequence


def overlong_penalty(lengths: Sequence[int], max_len: int, buffer: int, penalty: float) -> list[float]:
    """DAPO's soft overlong punishment of each length: 0 up to `max_len - buffer` tokens, then falling linearly to
    `-penalty` at `max_len` (and below it beyond). lengths (N,) -> (N,).

    Example: max_len 16, buffer 4, penalty 1: lengths 12, 13, 14, 16, 17 -> 0, -0.25, -0.5, -1, -1."""
    if buffer <= 0 or max_len <= 0:
        raise ValueError("overlong_penalty needs max_len > 0 and buffer > 0")
    free = max_len - buffer
    return [0.0 if n <= free else -penalty if n > max_len else -penalty * (n - free) / buffer for n in lengths]
