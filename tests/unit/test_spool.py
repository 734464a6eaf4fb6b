"""The spool protocol (rlkit.io.spool): names, order, claims, a killed update's recovery, and the writer that cuts a
worker's stream into complete batch files. Real files and Arrow tables; no model."""

from __future__ import annotations

import pytest

from rlkit.errors import RlkitError
from rlkit.follow.source import SpoolSource
from rlkit.io import spool, streams

N = 2  # samples a prompt


def _rows(groups: list[int], step: int) -> dict:
    k = len(groups) * N
    return {"prompt_id": [f"p{g}" for g in groups for _ in range(N)], "group_id": [g for g in groups for _ in range(N)],
            "sample_idx": [j for _ in groups for j in range(N)], "prompt": ["q"] * k, "completion": ["a"] * k,
            "prompt_ids": [[1, 2]] * k, "completion_ids": [[3]] * k, "old_logprobs": [[-0.5]] * k,
            "finish_reason": ["stop"] * k, "policy_fingerprint": ["fp"] * k, "policy_step": [step] * k,
            "answer": ["1"] * k}


def _touch(root, b, i, m, s):
    p = root / spool.batch_name(b, i, m, s)
    p.write_bytes(b"")
    return p


def test_names_order_and_foreign_entries(tmp_path):
    assert spool.batch_name(3, 1, 2, 2) == "b000003-w01of02-s000002.arrow"
    f = spool.parse(tmp_path / "b000003-w01of02-s000002.arrow")
    assert (f.batch, f.worker, f.workers, f.step) == (3, 1, 2, 2)
    for b, i in ((1, 1), (0, 1), (1, 0), (0, 0)):
        _touch(tmp_path, b, i, 2, b)
    (tmp_path / ".b000002-w00of02-s000001.arrow.tmp-1-abc").write_bytes(b"")  # being written: never read
    (tmp_path / "w00of02.end").write_text("ended\n")
    assert [(f.batch, f.worker) for f in spool.scan(tmp_path)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert spool.ended_workers(tmp_path) == {(0, 2)}
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(RlkitError, match="'model.safetensors' is not a spool file"):
        spool.scan(tmp_path)


def test_a_file_is_claimed_once_and_exists_wherever_it_is(tmp_path):
    _touch(tmp_path, 0, 1, 2, 0)
    f = spool.scan(tmp_path)[0]
    assert spool.exists(tmp_path, 0, 1, 2) and not spool.exists(tmp_path, 0, 0, 2)
    c = spool.claim(f)
    assert c.path == tmp_path / spool.CLAIMED / f.path.name and spool.claim(f) is None  # the second rename fails
    assert spool.scan(tmp_path) == [] and spool.exists(tmp_path, 0, 1, 2)
    spool.dispose(tmp_path, c, keep=True)
    assert spool.exists(tmp_path, 0, 1, 2) and spool.claimed(tmp_path) == []


def test_a_killed_updates_claims_are_disposed_of_or_put_back(tmp_path):
    """Resumed at step 12 of a run based at step 10: batches 0 and 1 were trained, batch 2 was not."""
    (tmp_path / spool.CLAIMED).mkdir()
    for b in (1, 2):
        for i in (0, 1):
            (tmp_path / spool.CLAIMED / spool.batch_name(b, i, 2, 10 + b)).write_bytes(b"")
    spool.mark_update_end(tmp_path, 11)
    src = SpoolSource(tmp_path, base_step=10, timeout=1, keep=True)
    assert src.recover(12) == (2, 0, 2)
    assert [f.path.name for f in spool.scan(tmp_path)] == [spool.batch_name(2, i, 2, 12) for i in (0, 1)]
    assert sorted(p.name for p in (tmp_path / spool.DONE).iterdir()) == [spool.batch_name(1, i, 2, 11) for i in (0, 1)]
    assert spool.update_ended(tmp_path) is None  # a running update again


def test_claims_wait_for_the_snapshot_that_covers_them(tmp_path):
    """Resumed from the snapshot of step 12 of a run based at step 10: batches 0 and 1 are covered (disposed of);
    step 13, published after the snapshot, trained on batch 2's files (they stay claimed, to train it again, and are
    what step 13 takes again); batch 3 was claimed but not trained (put back). A snapshot of step 13 then covers
    batch 2."""
    (tmp_path / spool.CLAIMED).mkdir()
    for b in (1, 2, 3):
        for i in (0, 1):
            (tmp_path / spool.CLAIMED / spool.batch_name(b, i, 2, 10 + b)).write_bytes(b"")
    again = [spool.batch_name(2, i, 2, 12) for i in (0, 1)]
    src = SpoolSource(tmp_path, base_step=10, timeout=1, keep=True)
    assert src.recover(12, {13: again}) == (2, 2, 2)
    assert [f.path.name for f in spool.claimed(tmp_path)] == again
    assert [f.path.name for f in spool.scan(tmp_path)] == [spool.batch_name(3, i, 2, 13) for i in (0, 1)]
    src.covered(12)  # covers batches 0 and 1 only
    assert [f.path.name for f in spool.claimed(tmp_path)] == again
    src.covered(13)
    assert spool.claimed(tmp_path) == [] and sorted(p.name for p in (tmp_path / spool.DONE).iterdir()) == sorted(
        [spool.batch_name(1, i, 2, 11) for i in (0, 1)] + again)


def test_the_writer_publishes_each_batch_whole_and_skips_one_written_before(tmp_path):
    """Worker 1 of 2, 2 groups of N rows a batch, batch b's groups numbered from 4b: rows come in pieces that
    straddle batches; each batch appears only once complete; a stream cut mid-batch leaves no visible file."""
    g = spool.Geometry(rows=2 * N, prompts=4, index=1, count=2)
    man = {"kind": "rollouts"}
    with spool.writing(tmp_path, "rollouts", man, [], g) as w:
        w.write(_rows([2], step=0))  # half of batch 0
        assert spool.scan(tmp_path) == [] and list(tmp_path.glob(".b000000-w01of02-s000000.arrow.tmp-*"))
        both = _rows([3], step=0)
        nxt = _rows([6], step=1)
        w.write({k: both[k] + nxt[k] for k in both})  # batch 0's last group, then half of batch 1
        assert [f.path.name for f in spool.scan(tmp_path)] == ["b000000-w01of02-s000000.arrow"]
        assert w.rows == 3 * N
    # the stream ended inside batch 1: its hidden file is gone
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".b")] == []
    t, _ = streams.read_table(tmp_path / "b000000-w01of02-s000000.arrow", ["rollouts"])
    assert t.column("group_id").to_pylist() == [2, 2, 3, 3]
    # a restarted worker's pipe samples batch 0 again: not written twice; batch 1 is
    with spool.writing(tmp_path, "rollouts", man, [], g) as w:
        w.write(_rows([2, 3], step=0))
        w.write(_rows([6, 7], step=1))
    assert w.skipped == [0] and [f.path.name for f in spool.scan(tmp_path)] == [
        "b000000-w01of02-s000000.arrow", "b000001-w01of02-s000001.arrow"]
    # a row of another batch before this one is complete: the stream is not what its manifest says
    with pytest.raises(RlkitError, match="batch 2 of w01of02 ended after 2 of its 4 samples"):
        with spool.writing(tmp_path, "rollouts", man, [], g) as w:
            w.write(_rows([8, 12], step=2))
    assert not list(tmp_path.glob(".b000002*"))


def test_a_batch_of_trajectories_of_several_rows_ends_at_its_last_samples_last_row(tmp_path):
    """Under --env a trajectory may be several rows (`credit=turn`, a chat template's cut), its earlier ones ending
    "continued": a batch is its groups times --n samples, not rows, and its file ends at its last sample's last row."""
    from rlkit.io.schemas import MULTI_TURN_FIELDS

    extra = [f for f in MULTI_TURN_FIELDS if f.name == "end_reason"]
    g = spool.Geometry(rows=2 * N, prompts=4, index=1, count=2)

    def rows(groups, step, ends):
        r = _rows(groups, step)
        k = [i for i in range(len(r["group_id"])) for _ in range(len(ends.get(i, ["terminated"])))]
        out = {c: [v[i] for i in k] for c, v in r.items()}
        out["end_reason"] = [e for i in range(len(r["group_id"])) for e in ends.get(i, ["terminated"])]
        return out

    with spool.writing(tmp_path, "rollouts", {"kind": "rollouts"}, extra, g) as w:
        # batch 0: group 2's first sample in three rows, its second in one; group 3's in one each; then batch 1
        first = rows([2, 3], 0, {0: ["continued", "continued", "terminated"]})
        nxt = rows([6, 7], 1, {1: ["continued", "max_turns"]})
        w.write({c: first[c] + nxt[c][:2] for c in first})  # batch 1 cut inside its second sample's rows
        assert [f.path.name for f in spool.scan(tmp_path)] == ["b000000-w01of02-s000000.arrow"]
        w.write({c: nxt[c][2:] for c in nxt})
    t, _ = streams.read_table(tmp_path / "b000000-w01of02-s000000.arrow", ["rollouts"])
    assert t.column("group_id").to_pylist() == [2, 2, 2, 2, 3, 3]
    assert t.column("end_reason").to_pylist() == ["continued", "continued"] + ["terminated"] * 4
    t, _ = streams.read_table(tmp_path / "b000001-w01of02-s000001.arrow", ["rollouts"])
    assert t.column("group_id").to_pylist() == [6, 6, 6, 7, 7]
    assert t.column("end_reason").to_pylist() == ["terminated", "continued", "max_turns", "terminated", "terminated"]


def test_one_worker_a_shard_and_one_worker_count_a_spool(tmp_path):
    g = spool.Geometry(rows=N, prompts=1, index=0, count=2)
    with spool.writing(tmp_path, "rollouts", {}, [], g):
        with pytest.raises(RlkitError, match="shard 0/2 is being written by another worker"):
            with spool.writing(tmp_path, "rollouts", {}, [], g):
                pass
    with pytest.raises(RlkitError, match="holds batches of 2 workers; this one is shard 0/3"):
        _touch(tmp_path, 0, 1, 2, 0)
        with spool.writing(tmp_path, "rollouts", {}, [], spool.Geometry(rows=N, prompts=1, index=0, count=3)):
            pass


def test_an_earlier_runs_end_marker_does_not_stop_a_new_worker(tmp_path):
    spool.mark_update_end(tmp_path, 3)  # a finished run's
    before = spool.marker_id(tmp_path)
    assert spool.update_ended(tmp_path) == 3 and spool.update_ended(tmp_path, before) is None
    spool.mark_update_end(tmp_path, 5)  # the update this worker feeds ends: a new file
    assert spool.update_ended(tmp_path, before) == 5


def test_a_slow_worker_that_beats_is_waited_for_and_a_silent_one_is_not(tmp_path):
    """--worker-timeout 2.5 s: worker 1 holds its lock (so its heartbeat moves every HEARTBEAT_SECONDS) and writes
    batch 0 after 4 s: the update waits for it. Batch 1: worker 1's writer is closed (no heartbeat), so after the
    timeout step 2 trains on worker 0's file alone, and names worker 1."""
    import threading
    import time

    geo = [spool.Geometry(rows=N, prompts=2, index=i, count=2) for i in (0, 1)]
    with spool.writing(tmp_path, "rollouts", {"kind": "rollouts"}, [], geo[0]) as w0:
        w0.write(_rows([0], step=0))

        def slow():
            with spool.writing(tmp_path, "rollouts", {"kind": "rollouts"}, [], geo[1]) as w1:
                time.sleep(4.0)
                w1.write(_rows([1], step=0))

        th = threading.Thread(target=slow)
        th.start()
        src = SpoolSource(tmp_path, base_step=0, timeout=2.5, keep=False, poll=0.02)
        assert src.header().kind == "rollouts"
        src.start(0, 2, N, max_lag=0)
        t0 = time.monotonic()
        got = src.next(0)
        th.join()
        assert time.monotonic() - t0 > 3.0 and got.note == ""
        assert [f.worker for f in got.files] == [0, 1] and got.table.column("group_id").to_pylist() == [0, 0, 1, 1]
        src.covered(1)  # a snapshot of step 1: batch 0 is disposed of
        w0.write(_rows([2], step=1))
        got = src.next(1)  # worker 1 is gone: its lock's mtime stands still
        assert [f.worker for f in got.files] == [0]
        assert got.note.startswith("worker(s) 1/2 wrote no batch 1 and gave no sign of life for 2.5 s")
