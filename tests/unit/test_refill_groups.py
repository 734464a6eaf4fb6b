"""DAPO's dynamic sampling as `rollout` runs it (`stages.rollout._Refill`), on made-up chunks: informative groups
only, K of them, stopping at the prompt limit with the batch filled up, and every prompt sampled counted once in
`prompts_drawn`."""

from __future__ import annotations

from stages.rollout import _Refill


def _chunk(first_group: int, rewards: list[list[float]]) -> dict:
    """A chunk's columns: group g's rows carry rewards[g - first_group] (reward/verifier)."""
    cols: dict = {"group_id": [], "sample_idx": [], "reward/verifier": []}
    for k, rs in enumerate(rewards):
        for j, r in enumerate(rs):
            cols["group_id"].append(first_group + k)
            cols["sample_idx"].append(j)
            cols["reward/verifier"].append(r)
    return cols


def test_writes_only_informative_groups_until_k():
    r = _Refill(want=3, limit=12, first=4)
    out = r.take(_chunk(0, [[1, 1], [0, 1], [0, 0], [1, 0]]))  # groups 1 and 3 informative
    assert out["group_id"] == [1, 1, 3, 3] and out["prompts_drawn"] == [2, 2, 2, 2] and not r.done
    out = r.take(_chunk(4, [[0, 0], [1, 0], [1, 1], [0, 0]]))  # group 5 is the third; 6 and 7 were sampled too
    assert out["group_id"] == [5, 5] and r.done
    assert out["prompts_drawn"] == [4, 4]  # 4 and 5, then 6 and 7 after it, in the same chunk
    assert r.fill() is None and r.drawn == 8 and r.kept == 3


def test_stops_at_the_limit_and_fills_the_batch_with_uninformative_groups():
    r = _Refill(want=3, limit=4, first=2)
    assert r.take(_chunk(0, [[0, 0], [1, 1]])) is None
    out = r.take(_chunk(2, [[0, 1], [1, 1], [0, 1]]))  # the 5th prompt is past the limit: never counted
    assert out["group_id"] == [2, 2] and r.done and r.drawn == 4
    rest = r.fill()
    assert rest["group_id"] == [0, 0, 1, 1]  # the first uninformative groups fill the batch to K
    # every prompt sampled counted once: 2 + 1 (group 3, after the last informative one) + 0
    assert rest["prompts_drawn"] == [1, 1, 0, 0] and out["prompts_drawn"] == [3, 3]


def test_rows_of_a_group_stay_together_whatever_their_order():
    r = _Refill(want=1, limit=4, first=4)
    cols = {"group_id": [0, 1, 0, 1], "sample_idx": [0, 0, 1, 1], "reward/verifier": [1.0, 0.0, 0.0, 0.0],
            "reward/env": [0.0, 0.0, 0.0, 0.0]}
    out = r.take(cols)
    assert out["group_id"] == [0, 0] and out["sample_idx"] == [0, 1] and out["prompts_drawn"] == [2, 2]
