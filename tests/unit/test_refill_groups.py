"""DAPO's dynamic sampling as `rollout` runs it (`rlkit.sampling.refill.Refill`), on made-up chunks: informative groups
only, K of them, stopping at the prompt limit with the batch filled up, every prompt sampled up to the last group
written counted once in `prompts_drawn` (those its chunk sampled after it apart), and the chunks cut so that after
the first round only the groups still missing are sampled."""

from __future__ import annotations

from rlkit.sampling import Prompts
from rlkit.sampling.refill import Refill


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
    r = Refill(want=3, limit=12, first=4)
    out = r.take(_chunk(0, [[1, 1], [0, 1], [0, 0], [1, 0]]))  # groups 1 and 3 informative
    assert out["group_id"] == [1, 1, 3, 3] and out["prompts_drawn"] == [2, 2, 2, 2] and not r.done
    out = r.take(_chunk(4, [[0, 0], [1, 0], [0, 1], [0, 0]]))  # group 5 is the third; 6 and 7 were sampled too
    assert out["group_id"] == [5, 5] and r.done
    assert out["prompts_drawn"] == [2, 2]  # 4 and 5: not 6 and 7, sampled after it in the same chunk
    assert r.tail == 2 and r.informative == 4  # group 6 was informative too, and dropped
    assert r.fill() is None and r.drawn == 8 and r.kept == 3


def test_stops_at_the_limit_and_fills_the_batch_with_uninformative_groups():
    r = Refill(want=3, limit=4, first=2)
    assert r.take(_chunk(0, [[0, 0], [1, 1]])) is None
    out = r.take(_chunk(2, [[0, 1], [1, 1], [0, 1]]))  # the 5th prompt is past the limit: never counted
    assert out["group_id"] == [2, 2] and r.done and r.drawn == 4
    rest = r.fill()
    assert rest["group_id"] == [0, 0, 1, 1]  # the first uninformative groups fill the batch to K
    # every prompt sampled counted once: 2 + 1 (group 3, after the last informative one) + 0
    assert rest["prompts_drawn"] == [1, 1, 0, 0] and out["prompts_drawn"] == [3, 3]


def test_rows_of_a_group_stay_together_whatever_their_order():
    r = Refill(want=1, limit=4, first=4)
    cols = {"group_id": [0, 1, 0, 1], "sample_idx": [0, 0, 1, 1], "reward/verifier": [1.0, 0.0, 0.0, 0.0],
            "reward/env": [0.0, 0.0, 0.0, 0.0]}
    out = r.take(cols)
    assert out["group_id"] == [0, 0] and out["sample_idx"] == [0, 1] and out["prompts_drawn"] == [1, 1]
    assert r.tail == 1  # group 1, sampled after it in its chunk


def _stream(total: int, size: int):
    """A prompt stream as rollout makes it: Prompts of `size` from prompt 0, prompt p named `p<p>`."""
    for c0 in range(0, total, size):
        ids = [f"p{p}" for p in range(c0, min(total, c0 + size))]
        yield Prompts(c0, ids, [str(p) for p in range(c0, c0 + len(ids))], ids, [[p] for p in range(c0, c0 + len(ids))])


def test_chunks_sample_the_first_round_as_a_plain_rollout_then_only_the_groups_missing():
    """Round 1 (6 prompts, chunks of 4) as a plain rollout of 6 cuts it; then each chunk as many prompts as groups
    are missing, across the stream's own chunks: no informative group is sampled to be dropped."""
    r = Refill(want=6, limit=18, first=6)
    informative = {0, 2, 5, 6, 7, 12, 13}  # the 6th is prompt 12; 13 is never sampled
    cut = []
    for ch in r.chunks(_stream(18, 4), 4):
        assert ch.ids == [f"p{p}" for p in range(ch.c0, ch.c0 + len(ch.ids))] and ch.prompt_ids[0] == [ch.c0]
        cut.append((ch.c0, len(ch.ids)))
        r.take(_chunk(ch.c0, [[0, 1] if p in informative else [1, 1] for p in range(ch.c0, ch.c0 + len(ch.ids))]))
    # round 1: 0-3, 4-5 (3 informative: 3 missing); 6-8 (2 of them: 1 missing); 9, 10, 11 (none); 12 (the 6th)
    assert cut == [(0, 4), (4, 2), (6, 3), (9, 1), (10, 1), (11, 1), (12, 1)]
    assert r.kept == 6 and r.drawn == 13 and r.tail == 0 and r.informative == 6


def test_chunks_stop_at_the_limit_and_at_the_streams_end():
    r = Refill(want=4, limit=6, first=3)
    cut = []
    for ch in r.chunks(_stream(100, 64), 64):
        cut.append((ch.c0, len(ch.ids)))
        r.take(_chunk(ch.c0, [[1, 1]] * len(ch.ids)))  # none informative
    assert cut == [(0, 3), (3, 3)] and r.drawn == 6 and r.done  # round 1, then 4 missing but 3 left to the limit
    assert r.fill()["prompts_drawn"] == [6, 6, 0, 0, 0, 0, 0, 0]
    r = Refill(want=4, limit=12, first=3)
    cut = []
    for ch in r.chunks(_stream(5, 2), 64):  # a prompts file of 5 rows, in chunks of 2: its end ends the batch
        cut.append((ch.c0, len(ch.ids)))
        r.take(_chunk(ch.c0, [[1, 1]] * len(ch.ids)))
    assert cut == [(0, 3), (3, 2)] and r.drawn == 5 and not r.done
