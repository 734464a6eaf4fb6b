"""What a stage's trajectories did (`--env`), for rollout's progress and closing lines: turns per trajectory, how
they ended, tool calls, and the environment's share of the wall. Torch-free; fed the rows as written.

A trajectory is the rows of one (prompt, sample): a chat template that rewrote its history cuts it into rows whose
earlier ones end `continued`, so a trajectory is counted at its last row (its `end_reason`, its `tool_calls`), and
its turns are the sum over its rows.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


def end_kind(reason: str | None) -> str:
    """An `end_reason` as the closing line counts it: `error: step raised ...` -> `error`."""
    reason = reason or "unknown"
    return "error" if reason.startswith("error") else reason


@dataclass
class TrajectoryTally:
    """The running figures of a stage's trajectories. `add` each chunk's written columns (and the time the chunk's
    turn loop waited on its environment); `lines` gives the closing lines, `warnings` what a user should look at."""

    trajectories: int = 0
    turns: int = 0
    tool_calls: int = 0
    ends: Counter = field(default_factory=Counter)
    env_wait: float = 0.0  # seconds the turn loops waited on their environments with nothing to sample
    started: float | None = None  # when sampling began (`begin`)

    def begin(self) -> None:
        """Sampling starts (the first call counts): the wall the environment's share is of."""
        if self.started is None:
            self.started = time.monotonic()

    def add(self, cols: dict, env_wait: float = 0.0) -> None:
        """One chunk's rows (the rollouts columns `end_reason`, `turns`, `tool_calls`)."""
        self.env_wait += env_wait
        for reason, turns, calls in zip(cols["end_reason"], cols["turns"], cols["tool_calls"], strict=True):
            self.turns += int(turns or 0)
            if reason == "continued":
                continue
            self.trajectories += 1
            self.tool_calls += int(calls or 0)
            self.ends[end_kind(reason)] += 1

    @property
    def mean_turns(self) -> float:
        return self.turns / max(1, self.trajectories)

    def lines(self, stage: str) -> list[str]:
        """`rollout: 64 trajectories, 2.41 turns each; ended: terminated 60, max_turns 3, error 1; 37 tool calls;
        the environment 41% of the wall (12.3 s waited on it)`."""
        if not self.trajectories:
            return []
        wall = max(1e-9, time.monotonic() - (self.started or time.monotonic()))
        ends = ", ".join(f"{k} {v}" for k, v in sorted(self.ends.items(), key=lambda kv: (-kv[1], kv[0])))
        line = (f"{stage}: {self.trajectories} trajectories, {self.mean_turns:.3g} turns each; ended: {ends}; "
                f"{self.tool_calls} tool call{'' if self.tool_calls == 1 else 's'}; the environment "
                f"{min(1.0, self.env_wait / wall):.0%} of the wall ({self.env_wait:.1f} s waited on it, of {wall:.1f} s)")
        return [line]

    def warnings(self, stage: str, max_turns: int, own_limit: int | None = None) -> list[str]:
        """More than half of the trajectories cut at `--max-turns` (the figures then describe the limit, not the
        policy)."""
        cut = self.ends.get("max_turns", 0)
        if self.trajectories and cut * 2 > self.trajectories:
            hint = f" (the environment's own limit is {own_limit})" if own_limit else ""
            return [f"{stage}: {cut} of {self.trajectories} trajectories ({cut / self.trajectories:.0%}) reached "
                    f"--max-turns {max_turns} and were truncated{hint}: their reward is what the environment paid "
                    "so far; raise --max-turns if the episodes should end by themselves"]
        return []


def turn_limit_warning(stage: str, env, max_turns: int) -> str | None:
    """`--max-turns` below the environment's own turn limit (its optional `max_turns` attribute, e.g. `guess`'s
    `turns=`): every episode longer than --max-turns is truncated before the environment would end it."""
    own = env.attribute("max_turns")
    if isinstance(own, int) and not isinstance(own, bool) and own > max_turns:
        return (f"{stage}: --max-turns {max_turns} is below environment {env.name}'s own limit of {own} turns: an "
                f"episode that goes past {max_turns} turns is truncated before the environment ends it; give "
                f"--max-turns {own} or more")
    return None
