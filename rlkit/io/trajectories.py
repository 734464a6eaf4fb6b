"""Figures of a multi-turn rollouts or scored table (`rollout --env`), per trajectory: what `rlkit inspect` shows
of one and `rlkit update` records per round (`mean_turns`, `mean_tool_calls`), which `rlkit report` draws.
Reads Arrow columns only (no torch)."""

from __future__ import annotations

from typing import Any


def figures(table, sampled: list[int] | None = None) -> dict[str, Any] | None:
    """A multi-turn rollouts/scored table's figures over all its rows: mean turns and tool calls per
    trajectory, end-reason counts, the completion tokens sampled (`loss_mask` 1) and appended by the environment
    (0) per trajectory and the environment's share of them, the mean `reward/env`. None for a table with no
    multi-turn value (a single-turn table: no `loss_mask` or `turns` column, or only nulls in them).

    A trajectory cut into several rows (a chat template that renders earlier turns otherwise: every row but
    its last has `end_reason` "continued") counts once: its rows' turns and tokens are summed, its reward and
    tool calls read from its last row. A row without `turns` (single-turn) counts one turn. `sampled`: each row's
    sampled tokens when the caller has read them already (`rlkit.algorithms.shaping.sampled_tokens` of a checked
    loss_mask), else counted here."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    names = table.column_names
    if "completion_ids" not in names or not any(
            c in names and table.column(c).null_count < table.num_rows for c in ("loss_mask", "turns")):
        return None

    def values(col: str, fill) -> np.ndarray | None:
        if col not in names or table.column(col).null_count == table.num_rows:
            return None
        return np.asarray(table.column(col).fill_null(fill).to_numpy(zero_copy_only=False), dtype=np.float64)

    ends = (table.column("end_reason").to_pylist() if "end_reason" in names else [None] * table.num_rows)
    last = np.array([e != "continued" for e in ends], dtype=bool)  # a trajectory's last row
    trajs = int(last.sum())
    per = max(1, trajs)
    comp = np.asarray(pc.list_value_length(table.column("completion_ids")).fill_null(0)
                      .to_numpy(zero_copy_only=False), dtype=np.int64)
    given = sampled is not None
    # a missing loss_mask, or a null row of it: every completion token sampled
    sampled = np.asarray(sampled, dtype=np.int64) if given else comp.copy()
    if "loss_mask" in names and not given:
        lm = table.column("loss_mask")
        lm = lm.combine_chunks() if isinstance(lm, pa.ChunkedArray) else lm
        if len(lm) and lm.null_count < len(lm):
            ones = np.asarray(pc.equal(pc.list_flatten(lm), 1).fill_null(False).to_numpy(zero_copy_only=False))
            parents = np.asarray(pc.list_parent_indices(lm).to_numpy(zero_copy_only=False), dtype=np.int64)
            counted = np.bincount(parents, weights=ones, minlength=len(lm)).astype(np.int64)
            present = ~np.asarray(lm.is_null().to_numpy(zero_copy_only=False), dtype=bool)
            sampled = np.where(present, counted, comp)
    turns, calls, reward = values("turns", 1), values("tool_calls", 0), values("reward/env", 0.0)
    out: dict[str, Any] = {
        "trajectories": trajs,
        "mean_turns": None if turns is None else float(turns.sum()) / per,
        "mean_tool_calls": None if calls is None else float(calls[last].sum()) / per,
    }
    if "end_reason" in names:
        counts: dict[str, int] = {}
        for e in ends:
            if e != "continued":
                counts[str(e)] = counts.get(str(e), 0) + 1
        out["end_reasons"] = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        if trajs < table.num_rows:
            out["continued_rows"] = table.num_rows - trajs
    out["mean_response_tokens"] = float(sampled.sum()) / per
    out["mean_environment_tokens"] = float((comp - sampled).sum()) / per
    out["environment_token_fraction"] = float((comp - sampled).sum()) / max(1, int(comp.sum()))
    out["mean_reward_env"] = None if reward is None else float(reward[last].sum()) / per
    return out
