"""Persistent stages (`--follow`): step directories, the stream batcher, and real three-process pipes
`rollout --follow DIR | score-ref | update --follow --out DIR` on the real tiny model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from rlkit.errors import RlkitError
from rlkit.follow import snapshots
from rlkit.io import follow, manifests, streams

from conftest import fast_rlkit_cmd, one_error_line, rlkit_cmd, run_cli, run_cli_inproc, stage

P, N = 8, 4  # prompts per step, samples per prompt: small, so a step takes about a second here
UPDATE = ["--minibatch-size", "16", "--epochs", "2", "--seed", "0"]


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


def _pipe(sft, ref, root: Path, *, lag: int, steps: int, seed: int = 100, extra_update: str = "",
          extra_rollout: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = " ".join(fast_rlkit_cmd())
    script = (
        "set -euo pipefail\n"
        f"{cmd} rollout --follow {root} --policy {sft} --n {N} --batch-prompts {P} --max-lag {lag} --seed {seed} {extra_rollout} "
        f"| {cmd} score-ref --ref {ref} "
        f"| {cmd} update --follow --policy {sft} --out {root} --max-steps {steps} --max-lag {lag} "
        f"{' '.join(UPDATE)} --metrics {root}.metrics.jsonl {extra_update}\n"
    )
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "RLKIT_DEBUG": "0"})


def _scored(sft, ref, out: Path, prompts: int, seed: int) -> Path:
    """A scored table of `prompts` x N rows: rollout, then score-ref, in this process (`stage`)."""
    roll = out.with_name(out.stem + "-rollouts.arrow")
    stage("rollout", "--policy", str(sft), "--num-prompts", str(prompts), "--n", str(N), "--seed", str(seed),
          "--out", str(roll))
    stage("score-ref", "--ref", str(ref), "--in", str(roll), "--out", str(out))
    return out


# --- step directories (no torch) --------------------------------------------------------------------


def _fake_step(tmp: Path) -> dict:
    (tmp / "config.json").write_text("{}")
    (tmp / "model.safetensors").write_bytes(b"weights")
    return {"kind": "model", "step": int(tmp.name.split("-")[1].split(".")[0])}


def test_publish_is_atomic_and_latest_follows(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    for s in (1, 2):
        p = follow.publish(root, s, _fake_step)
        assert (p / "rlkit.json").is_file() and json.loads((p / "rlkit.json").read_text())["step"] == s
    assert os.readlink(root / "latest") == "step-000002"
    assert follow.newest(root).step == 2
    with pytest.raises(RlkitError, match="never overwritten"):
        follow.publish(root, 2, _fake_step)

    def dies(tmp):
        _fake_step(tmp)
        raise KeyboardInterrupt  # killed mid-write (SIGINT/SIGTERM arrive as this)

    with pytest.raises(KeyboardInterrupt):
        follow.publish(root, 3, dies)
    assert sorted(os.listdir(root)) == ["latest", "step-000001", "step-000002"]  # no trace of step 3
    assert follow.newest(root).step == 2


def test_readers_skip_unfinished_steps_and_refuse_foreign_entries(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    follow.publish(root, 1, _fake_step)
    (root / "step-000002").mkdir()  # being copied in by some other tool: no rlkit.json yet
    (root / "step-000002" / "model.safetensors").write_bytes(b"half")
    (root / ".step-000003.tmp-1-abc").mkdir()  # a writer's hidden temporary
    steps, partial = follow.scan(root)
    assert [s.step for s in steps] == [1] and partial == [root / "step-000002"]
    assert follow.newest(root).step == 1
    (root / "notes.txt").write_text("x")
    with pytest.raises(RlkitError, match="'notes.txt' is not an rlkit step directory"):
        follow.check_root(root)
    with pytest.raises(RlkitError, match="is a file"):
        follow.check_root(root / "notes.txt")


def test_prune_keeps_the_newest(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    for s in range(1, 6):
        follow.publish(root, s, _fake_step)
    assert follow.prune(root, 2) == [1, 2, 3]
    assert [s.step for s in follow.scan(root)[0]] == [4, 5]
    assert not [n for n in os.listdir(root) if n.startswith(".step-")]
    assert follow.prune(root, 0) == [4]  # never the newest
    assert follow.newest(root).step == 5


def test_keep_never_prunes_a_step_after_the_newest_snapshot_nor_that_snapshot(tmp_path):
    """update --follow --keep 1 with its newest snapshot at step 2: steps 3 and 4 stay (a restart trains them again
    from the batch files their manifests name), and of the snapshots only the newest does; a snapshots/ directory
    is not a foreign entry for the workers' scan."""
    root = tmp_path / "run"
    root.mkdir()
    for s in range(1, 5):
        follow.publish(root, s, _fake_step)
    for s in (1, 2):
        d = root / "snapshots" / snapshots.name(s)
        d.mkdir(parents=True)
        (d / "resume.json").write_text("{}")
    (root / "snapshots" / ".snapshot-000003.tmp").mkdir()  # a killed save's leftover
    assert follow.prune(root, 1, newest=2) == [1, 2]
    assert [s.step for s in follow.scan(root)[0]] == [3, 4]
    assert snapshots.prune(root, 1) == [1] and [s for s, _ in snapshots.scan(root)] == [2]
    assert snapshots.clean_stale(root) == [".snapshot-000003.tmp"]
    assert sorted(os.listdir(root / "snapshots")) == ["snapshot-000002"]


def test_lock_refuses_a_second_writer_and_dies_with_its_holder(tmp_path):
    root = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from rlkit.io import follow\n"
         f"with follow.writer_lock(Path({str(root)!r})):\n    print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RlkitError, match=f"another `rlkit update --follow` \\(pid {holder.pid}\\)"):
            with follow.writer_lock(root):
                pass
    finally:
        holder.kill()  # SIGKILL: no cleanup code runs
        holder.wait()
    with follow.writer_lock(root):  # the kernel dropped the dead holder's lock: not stale
        pass


def test_batcher_cuts_whole_groups_and_drops_lagged_rows():
    from rlkit.follow.batches import Batcher

    def batch(groups, step):
        rows = [(g, step) for g in groups for _ in range(2)]
        return pa.record_batch({"group_id": pa.array([g for g, _ in rows], pa.int64()),
                                "policy_step": pa.array([s for _, s in rows], pa.int64())})

    class Reader:
        label = "stdin"

        def __init__(self, batches):
            self.batches = batches

        def __iter__(self):
            yield from self.batches

    # n known (a follow rollout): a batch is cut as soon as its P-th group has n rows
    b = Batcher(Reader([batch([0, 1], 0), batch([2], 0), batch([3, 4, 5], 1)]), P=3, n=2, max_lag=1)
    t, lags, dropped = b.next(step=0)
    assert t.column("group_id").to_pylist() == [0, 0, 1, 1, 2, 2] and lags.tolist() == [0] * 6 and dropped == 0
    # at step 3 the step-1 rows lag 2 > 1: dropped and counted, then the stream ends
    assert b.next(step=3) is None and b.leftover == 0
    # n unknown (a plain table): a batch is cut when the next group starts, or at the end of the stream
    b = Batcher(Reader([batch([0, 1, 2], 0), batch([3], 0)]), P=2, n=None, max_lag=0)
    assert b.next(step=0)[0].column("group_id").to_pylist() == [0, 0, 1, 1]
    assert b.next(step=0)[0].column("group_id").to_pylist() == [2, 2, 3, 3]
    b = Batcher(Reader([batch([0, 1, 2], 0)]), P=2, n=None, max_lag=0)
    b.next(step=0)
    assert b.next(step=0) is None and b.leftover == 2  # one group of two rows: never a partial step
    b = Batcher(Reader([batch([0], 0), batch([1], 4)]), P=1, n=2, max_lag=1)
    t, lags, dropped = b.next(step=1)
    assert lags.tolist() == [1, 1]
    with pytest.raises(RlkitError, match="newer than this update's step 1"):
        b.next(step=1)


def test_importance_ess_by_hand():
    from rlkit.ops.losses import importance_ess

    old = torch.tensor([[0.0, 0.0, -1.0]])
    engine = torch.tensor([[0.0, -0.6931471805599453, 5.0]])
    mask = torch.tensor([[True, True, False]])
    # weights 1 and 2 on the two masked tokens: (1 + 2)^2 / (2 * (1 + 4)) = 0.9; the padded one is ignored
    assert importance_ess(old, engine, mask) == pytest.approx(0.9)
    assert importance_ess(old, old, mask) == pytest.approx(1.0)


# --- real pipes -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_k1_pipe_resumes_without_losing_or_repeating_a_step(sft_dir, ref_dir, tmp_path):
    root = tmp_path / "ckpts"
    tb = f"--tensorboard {tmp_path / 'tb'}"  # a tracker: one row per step, the resumed run continuing its tracker run
    r = _pipe(sft_dir, ref_dir, root, lag=1, steps=2, extra_update=f"--keep 2 {tb} --run-name k1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--keep 2 raised to 3" in r.stderr
    assert os.readlink(root / "latest") == "step-000002"
    rows = [json.loads(line) for line in (tmp_path / "ckpts.metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2]
    assert rows[0]["lag_max"] == 0 and rows[1]["lag_max"] == 1  # batch 1 was sampled by step 0 while step 1 trained
    assert rows[1]["old_logprobs"] == "recompute" and 0 < rows[1]["is_ess"] <= 1
    assert rows[1]["tis_weight_mean"] > 0 and rows[1]["rows_dropped"] == 0
    # the same command again with a higher --max-steps resumes from latest: step 3 only, trained from step 2
    r = _pipe(sft_dir, ref_dir, root, lag=1, steps=3, extra_update=f"--keep 2 {tb}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" in r.stderr and f"continuing the run of {root / 'step-000002'}" in r.stderr
    rows = [json.loads(line) for line in (tmp_path / "ckpts.metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3]
    assert [s.step for s in follow.scan(root)[0]] == [1, 2, 3]  # --keep is at least --max-lag + 2
    m = manifests.read_manifest(root / "step-000003")
    # a step is what a worker loads (weights, config, tokenizer); the optimizer is in the snapshot (every step on a
    # stream), of which --keep leaves the newest
    assert m["step"] == 3 and not (root / "step-000003/trainer").exists()
    assert sorted(p.name for p in (root / "snapshots").iterdir()) == ["snapshot-000003"]
    assert json.loads((root / "snapshots/snapshot-000003/resume.json").read_text())["trainer"]["updates"] == 3
    assert m["tracking"]["run_name"] == "k1"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("update/lag_max")] == [(m["step"], m["lag_max"]) for m in rows]
    # and a finished run is left as it is, also when rollout knows it (--max-steps: an empty stream, no engine)
    r = _pipe(sft_dir, ref_dir, root, lag=1, steps=3)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "nothing to do" in r.stderr and follow.newest(root).step == 3
    r = _pipe(sft_dir, ref_dir, root, lag=1, steps=3, extra_rollout="--max-steps 3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "nothing to sample" in r.stderr and "engine hf" not in r.stderr and follow.newest(root).step == 3


@pytest.mark.slow
def test_ppo_resumes_its_critic_from_the_snapshot(sft_dir, ref_dir, tmp_path):
    """--algo ppo trains a critic beside the policy: it goes into each snapshot (extra/critic), not into the steps the
    workers load, and a run of 2 steps taken on to 3 ends with the weights of 3 steps at once."""
    ppo = "--algo ppo --beta 0 --length-penalty 0.1 --lr 1e-3"  # lengths vary: rewards, so a gradient
    for root, steps in ((tmp_path / "resumed", 2), (tmp_path / "resumed", 3), (tmp_path / "whole", 3)):
        r = _pipe(sft_dir, ref_dir, root, lag=0, steps=steps, extra_update=ppo)
        assert r.returncode == 0, r.stderr[-3000:]
        if steps == 3 and root.name == "resumed":
            assert "critic resumed" in r.stderr and "from its snapshot of step 2" in r.stderr
    snap = tmp_path / "resumed" / "snapshots" / "snapshot-000003"
    assert (snap / "extra" / "critic" / "model.safetensors").is_file()
    assert not (tmp_path / "resumed" / "step-000003" / "critic").exists()
    a, b = (_weights(tmp_path / d / "step-000003") for d in ("resumed", "whole"))
    assert max(float((a[k] - _weights(sft_dir)[k]).abs().max()) for k in a) > 1e-4
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@pytest.mark.slow
def test_sigkill_while_a_step_is_written_leaves_no_step_that_looks_complete(sft_dir, ref_dir, tmp_path):
    """Kill `update --follow` (SIGKILL) the moment a step's hidden directory appears, then resume."""
    root = tmp_path / "ckpts"
    cmd = rlkit_cmd()
    scored = _scored(sft_dir, ref_dir, tmp_path / "scored.arrow", 3 * P, seed=5)
    # --max-lag 10: a restarted update re-reads the file from its start, and trains all three batches again
    upd = [*cmd, "update", "--follow", "--policy", str(sft_dir), "--out", str(root), "--batch-prompts", str(P),
           "--in", str(scored), "--max-lag", "10", *UPDATE]
    proc = subprocess.Popen(upd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    caught = None
    deadline = time.monotonic() + 120
    while caught is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            caught = next((n for n in os.listdir(root) if n.startswith(".step-")), None)
        except FileNotFoundError:
            pass
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert caught, "the writer's hidden step directory never showed"
    steps, partial = follow.scan(root)
    for s in steps:  # whatever is visible is complete and hashes right
        follow.verify_step(s.path)
    assert not partial and [s.step for s in steps] == list(range(1, len(steps) + 1))
    left = [n for n in os.listdir(root) if n.startswith(".step-")]
    snapped = max([len(steps), *(s for s, _ in snapshots.scan(root))])
    r = subprocess.run(upd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("unfinished step" in r.stderr) == bool(left)
    # resumed from the newest snapshot (every step on a stream, saved before the step is published): the step caught
    # in its publish is published from it, then three more
    assert [s.step for s in follow.scan(root)[0]] == list(range(1, snapped + 4))
    assert not [n for n in os.listdir(root) if n.startswith(".step-")]


@pytest.mark.slow
def test_follow_bad_input_one_line_each(sft_dir, ref_dir, tmp_path):
    scored = _scored(sft_dir, ref_dir, tmp_path / "scored.arrow", 2 * P, seed=7)
    update = ["update", "--follow", "--policy", str(sft_dir), "--batch-prompts", str(P), *UPDATE]

    # a directory that is not a follow directory: a file in it, a model directory, a file
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    assert "'notes.txt' is not an rlkit step directory" in one_error_line(run_cli_inproc(*update, "--out", str(junk),
                                                                                         "--in", str(scored)))
    assert "is a model directory" in one_error_line(run_cli_inproc(*update, "--out", str(ref_dir), "--in", str(scored)))
    assert "one of this stage's inputs (--policy" in one_error_line(run_cli_inproc(*update, "--out", str(sft_dir), "--in",
                                                                           str(scored)))
    assert "'notes.txt' is not an rlkit step directory" in one_error_line(
        run_cli_inproc("rollout", "--follow", str(junk), "--policy", str(sft_dir), "--out", str(tmp_path / "x.arrow")))
    assert (junk / "notes.txt").read_text() == "mine" and sorted(os.listdir(junk)) == ["notes.txt"]
    # a stream cannot be read again: a snapshot of every step, or no exact resume
    r = run_cli_inproc(*update, "--out", str(tmp_path / "k2"), "--in", str(scored), "--snapshot-every", "2")
    assert r.returncode == 2 and "--snapshot-every 2: a stream cannot be read again" in one_error_line(r)
    assert not (tmp_path / "k2").exists()

    # upstream dying mid-stream: the first full batch is a step, the partial second one is not
    cut = tmp_path / "cut.arrow"
    t, _ = streams.read_table(scored, ["scored"])
    with pa.OSFile(str(cut), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
        w.write_table(t.slice(0, P * N + N))  # one whole batch and one group more, and no end marker
    root = tmp_path / "ckpts"
    r = run_cli(*update, "--out", str(root), "--in", str(cut))
    err = r.stderr.decode()
    assert r.returncode == 3 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("rlkit: error:") and "without rlkit's end marker" in err
    assert [s.step for s in follow.scan(root)[0]] == [1]

    # a step whose tokenizer differs from the policy's (weights intact)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copytree(root / "step-000001", other / "step-000001")
    tok_file = other / "step-000001" / "tokenizer.json"
    tj = json.loads(tok_file.read_text())
    vocab = tj["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    tok_file.write_text(json.dumps(tj))
    assert "different tokenizer" in one_error_line(
        run_cli_inproc("rollout", "--follow", str(other), "--policy", str(sft_dir), "--out", str(tmp_path / "z.arrow")))
    assert "different tokenizer" in one_error_line(run_cli_inproc(*update, "--out", str(other), "--in", str(scored)))

    # a checkpoint that fails its hash: rollout and a resuming update refuse it
    w = root / "step-000001" / "model.safetensors"
    blob = bytearray(w.read_bytes())
    blob[-1] ^= 1
    w.write_bytes(bytes(blob))
    assert "fails its hash check" in one_error_line(run_cli_inproc(*update, "--out", str(root), "--in", str(scored)))
    assert "fails its hash check" in one_error_line(
        run_cli_inproc("rollout", "--follow", str(root), "--policy", str(sft_dir), "--out", str(tmp_path / "y.arrow")))
    assert not (tmp_path / "y.arrow").exists() and [s.step for s in follow.scan(root)[0]] == [1]

    # two writers on one directory: the second is refused while the first waits on an open stdin
    root2 = tmp_path / "ckpts2"
    first = subprocess.Popen([*rlkit_cmd(), *update, "--out", str(root2)], stdin=subprocess.PIPE,
                             stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (root2 / ".lock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        # a real process: the lock is taken after the input's reader thread has started, which only a process
        # exit ends (rlkit.cli.main's os._exit), not an in-process run
        line = one_error_line(run_cli(*update, "--out", str(root2), "--in", str(scored)))
        assert f"(pid {first.pid})" in line and "refusing to start a second writer" in line
    finally:
        first.kill()
        first.wait()
    # (that a SIGKILLed writer leaves no stale lock: test_lock_refuses_a_second_writer_and_dies_with_its_holder)


@pytest.mark.slow
def test_rollout_follow_never_reads_a_half_written_step(sft_dir, ref_dir, tmp_path):
    root = tmp_path / "ckpts"
    scored = _scored(sft_dir, ref_dir, tmp_path / "scored.arrow", P, seed=7)
    r = run_cli("update", "--follow", "--policy", str(sft_dir), "--out", str(root), "--in", str(scored),
                "--batch-prompts", str(P), *UPDATE)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    half = root / "step-000002"
    half.mkdir()
    shutil.copy(root / "step-000001" / "config.json", half)
    (half / "model.safetensors").write_bytes(b"not yet")  # no rlkit.json: still being written
    out = tmp_path / "r.arrow"
    r = run_cli("rollout", "--follow", str(root), "--policy", str(sft_dir), "--n", str(N), "--batch-prompts", str(P),
                "--max-steps", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    t, _ = streams.read_table(out, ["rollouts"])
    assert set(t.column("policy_step").to_pylist()) == {1}  # sampled by step 1, not the half-written step 2
    assert len(t) == P * N and min(t.column("group_id").to_pylist()) == P  # batch 1: groups P .. 2P-1


@pytest.mark.slow
def test_score_ref_streams_an_unbounded_input(sft_dir, ref_dir, tmp_path):
    """score-ref answers a batch while its input is still open (it must not wait for the end)."""
    src = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(sft_dir), "--num-prompts", str(P), "--n", str(N), "--out", str(src))
    assert r.returncode == 0
    t, reader = streams.read_table(src, ["rollouts"])
    m = dict(reader.manifest)
    m["config"] = {**m["config"], "follow": str(tmp_path / "ckpts"), "batch_prompts": P}
    proc = subprocess.Popen([*rlkit_cmd(), "score-ref", "--ref", str(ref_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    w = pa.ipc.new_stream(proc.stdin, t.schema.with_metadata({b"rlkit": json.dumps(m).encode()}))
    w.write_table(t)
    proc.stdin.flush()
    out = pa.ipc.open_stream(proc.stdout)  # blocks until score-ref writes its schema
    got = out.read_next_batch()  # ... and its first scored batch, while our stdin is still open
    assert got.num_rows == len(t) and "ref_logprobs" in got.schema.names
    assert proc.poll() is None
    proc.stdout.close()  # the downstream ends: score-ref notices and stops cleanly, input still open
    assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()[-2000:]
    assert b"the downstream stage ended" in proc.stderr.read()
    proc.stdin.close()


_TWO_TURNS = '''
from rlkit.envs.base import Step


class TwoTurns:
    """Two model turns: the task's prompt, then a fixed feedback text; reward: 1 per turn of odd length."""

    def reset(self, example):
        self.turn = 0
        return example.prompt

    def step(self, action):
        self.turn += 1
        r = float(len(action) % 2)
        return Step(None, r, terminated=True) if self.turn >= 2 else Step(" again=", r)
'''


@pytest.mark.slow
def test_env_rollout_follow_streams_trajectories_into_update(sft_dir, tmp_path):
    """`rollout --follow --env` writes trajectory rows batch by batch, each batch by the newest step, and `update
    --follow` trains a step on each."""
    env = tmp_path / "two.py"
    env.write_text(_TWO_TURNS)
    root, rolls = tmp_path / "ckpts", tmp_path / "rolls.arrow"
    cmd = " ".join(fast_rlkit_cmd())
    script = (
        "set -euo pipefail\n"
        f"{cmd} rollout --follow {root} --policy {sft_dir} --env {env}:TwoTurns --n {N} --batch-prompts {P} "
        f"--max-lag 0 --max-steps 2 --seed 100 "
        f"| tee {rolls} "
        f"| {cmd} update --follow --policy {sft_dir} --out {root} --max-steps 2 --max-lag 0 --beta 0 "
        f"{' '.join(UPDATE)} --metrics {root}.metrics.jsonl\n"
    )
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "RLKIT_DEBUG": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [s.step for s in follow.scan(root)[0]] == [1, 2]
    metrics = [json.loads(line) for line in Path(f"{root}.metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["sequences_trained"] == P * N for m in metrics)
    # each step's table: the batch's turns and environment-token share, said to be the batch's
    shown = " ".join(r.stderr.split())
    assert shown.count("figures of this step's batch, not running means") == 2, r.stderr[-3000:]
    for m in metrics:
        assert m["mean_turns"] == 2.0 and 0 < m["environment_token_fraction"] < 1
        share = m["environment_token_fraction"]
        assert "mean_turns │ 2 │" in shown and f"environment_token_fraction │ {share:.4g} │" in shown
    t, reader = streams.read_table(rolls, ["rollouts"])
    assert reader.manifest["config"]["env"] == f"{env}:TwoTurns"
    rows = t.to_pylist()
    assert len(rows) == 2 * P * N
    # batch b (groups bP .. bP+P-1) was sampled by step b (--max-lag 0: the step trained on batch b - 1)
    assert {(row["group_id"] // P, row["policy_step"]) for row in rows} == {(0, 0), (1, 1)}
    for row in rows:
        assert row["turns"] == 2 and row["end_reason"] == "terminated" and row["terminated"]
        mask, lps = row["loss_mask"], row["old_logprobs"]
        assert len(mask) == len(row["completion_ids"]) == len(lps)
        first = mask.index(0)  # the first turn, then the feedback's tokens (mask 0, log-prob 0.0), then the second
        assert mask[first:first + len(" again=")] == [0] * len(" again=") and 1 in mask[first + len(" again="):]
        assert [lp for lp, m in zip(lps, mask, strict=True) if m == 0] == [0.0] * mask.count(0)
        assert row["reward/env"] == sum(row["turn_rewards"])
