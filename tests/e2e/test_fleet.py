"""Many rollout workers feeding one `update --follow` through a spool directory (rlkit.io.spool), and
`update --follow` under torchrun: real worker processes, real spool files, the real tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlkit.follow import snapshots
from rlkit.io import follow, manifests, spool

from conftest import fast_rlkit_cmd, one_error_line

pytestmark = pytest.mark.slow

P, N, C = 8, 4, 4  # prompts a step, samples a prompt, prompts a generation chunk: two workers get a chunk each
STEPS = 2
WORKER = ["--n", str(N), "--batch-prompts", str(P), "--seed", "100"]
UPDATE = ["--minibatch-size", "16", "--epochs", "2", "--seed", "0", "--beta", "0"]
STALL = ("import os, time\nCALLS = [0]\n\ndef stall(completion):\n    CALLS[0] += 1  # one call a row: rows 9.. are the 2nd chunk\n"
         "    if os.environ.get('STALL') and CALLS[0] > 8:\n        time.sleep(600)\n    return 0.0\n")


def _env(**extra: str) -> dict:
    return {**os.environ, "RLKIT_DEBUG": "0", "OMP_NUM_THREADS": "1", **extra}


def _worker(sft, root: Path, sp: Path, i: int, m: int, *, lag: int = 0, steps: int = STEPS, chunk: int = C, extra=(),
            env=None) -> subprocess.Popen:
    """Worker i of m: `rollout --follow ROOT --shard i/m --spool SP` (no reference: the update runs --beta 0)."""
    cmd = [*fast_rlkit_cmd(), "rollout", "--follow", str(root), "--policy", str(sft), "--shard", f"{i}/{m}", *WORKER,
           "--chunk-prompts", str(chunk),
           "--max-lag", str(lag), "--max-steps", str(steps), "--spool", str(sp), *extra]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env or _env(), start_new_session=True)


def _update_cmd(sft, root: Path, sp: Path, *, lag: int = 0, steps: int = STEPS, extra=(), nproc: int = 1) -> list:
    args = ["update", "--follow", "--in", str(sp), "--policy", str(sft), "--out", str(root), "--max-steps", str(steps),
            "--max-lag", str(lag), *UPDATE, *extra]
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
                "rlkit", *args]
    return [*fast_rlkit_cmd(), *args]


def _scoring_worker(sft, ref, root: Path, sp: Path, i: int, m: int) -> subprocess.Popen:
    """Worker i of m as a pipe: `rollout --follow ROOT --shard i/m | score-ref --ref REF --spool SP`."""
    cmd = " ".join(fast_rlkit_cmd())
    script = (f"set -o pipefail\n{cmd} rollout --follow {root} --policy {sft} --shard {i}/{m} {' '.join(WORKER)} "
              f"--chunk-prompts {C} --max-lag 0 --max-steps {STEPS} | {cmd} score-ref --ref {ref} --spool {sp}\n")
    return subprocess.Popen(["bash", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)


def _fleet(sft, tmp: Path, name: str, *, workers: int = 2, nproc: int = 1, extra=(), ref=None,
           steps: int = STEPS) -> tuple[Path, str]:
    """`workers` workers (with `ref`: each a pipe through score-ref) and one update (`nproc` processes) at --max-lag
    0 for STEPS steps. -> (ckpts, update stderr)."""
    root, sp = tmp / f"{name}-ckpts", tmp / f"{name}-spool"
    sp.mkdir()
    ws = [_worker(sft, root, sp, i, workers, steps=steps) if ref is None else _scoring_worker(sft, ref, root, sp, i, workers)
          for i in range(workers)]
    try:
        r = subprocess.run(_update_cmd(sft, root, sp, nproc=nproc, extra=extra, steps=steps), capture_output=True, text=True,
                           timeout=300, env=_env())
        assert r.returncode == 0, r.stderr[-3000:]
        for w in ws:
            assert w.wait(timeout=60) == 0, w.stderr.read()[-2000:]
    finally:
        for w in ws:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
    return root, r.stderr


def _one_worker(sft, tmp: Path) -> Path:
    """The same run as one `rollout --follow | update --follow` pipe sampling every prompt."""
    root = tmp / "one-ckpts"
    cmd = " ".join(fast_rlkit_cmd())
    script = (f"set -euo pipefail\n{cmd} rollout --follow {root} --policy {sft} {' '.join(WORKER)} --chunk-prompts {C} --max-lag 0 "
              f"--max-steps {STEPS} | {cmd} update --follow --policy {sft} --out {root} --max-steps {STEPS} "
              f"--max-lag 0 {' '.join(UPDATE)}\n")
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def _weights(root: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(str(root / follow.step_name(step) / "model.safetensors"))


def _batches(root: Path, step: int) -> list[str]:
    return manifests.read_manifest(root / follow.step_name(step))["follow"].get("batches", [])


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's ranks run in sessions of their own: a signal to its group misses them)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _kill_all(p: subprocess.Popen) -> None:
    """SIGKILL `p`, its group and every process below it, at once: the update killed whole, as a node is lost."""
    below = _descendants(p.pid)
    os.killpg(p.pid, signal.SIGKILL)
    for k in below:
        try:
            os.kill(k, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(pred, timeout: float = 120, what: str = "") -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def fleet(sft_dir, ref_dir, tmp_path_factory):
    """Two workers (`rollout --follow --shard I/2 | score-ref --spool`) and one update at --max-lag 0, the spool's
    files kept (--keep-batches). The update runs --beta 0: the reference's log-probs ride along, unused."""
    return _fleet(sft_dir, tmp_path_factory.mktemp("fleet"), "two", extra=("--keep-batches",), ref=ref_dir)


def test_two_workers_give_the_weights_one_worker_gives(fleet, sft_dir, tmp_path):
    root, err = fleet
    sp = root.with_name("two-spool")
    one = _one_worker(sft_dir, tmp_path)
    a, b = _weights(root), _weights(one)
    assert a.keys() == b.keys()
    for k in a:  # the same rows in the same order, the same seeds: the same arithmetic
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    sft = load_file(str(sft_dir / "model.safetensors"))
    assert max(float((a[k] - sft[k]).abs().max()) for k in a) > 1e-5
    # step b + 1 trained batch b of both workers, in worker order; kept in done/, nothing left claimed or waiting
    for s in (1, 2):
        assert _batches(root, s) == [spool.batch_name(s - 1, i, 2, s - 1) for i in (0, 1)]
    assert sorted(p.name for p in (sp / spool.DONE).iterdir()) == sorted(_batches(root, 1) + _batches(root, 2))
    assert spool.scan(sp) == [] and spool.claimed(sp) == []
    assert spool.ended_workers(sp) == {(0, 2), (1, 2)} and spool.update_ended(sp) == STEPS
    assert not [p for p in sp.iterdir() if p.name.startswith(".b")]  # no unfinished file left
    from rlkit.io import streams

    t, man = streams.read_table(sp / spool.DONE / _batches(root, 1)[1], ["scored"])  # scored by the worker's pipe
    assert t.column("group_id").to_pylist() == [g for g in range(4, 8) for _ in range(N)]
    assert set(t.column("policy_step").to_pylist()) == {0} and "ref_logprobs" in t.column_names
    # a step is what a worker loads: fp32 weights on a CPU, config, tokenizer; the optimizer is in the snapshot taken
    # at the clean end, written as torch's distributed checkpoint
    step = root / "step-000002"
    assert not (step / "trainer").exists() and not list(step.glob("*.distcp"))
    assert json.loads((step / "config.json").read_text())["dtype"] == "float32"
    m = manifests.read_manifest(step)["metrics"]
    assert m["publish_dtype"] == "fp32"
    snap = root / "snapshots" / "snapshot-000002"
    assert sorted(p.name for p in snap.iterdir()) == [".metadata", "__0_0.distcp", "resume.json", "rng-rank0.safetensors"]
    weights = (step / "model.safetensors").stat().st_size
    # AdamW's two fp32 moments and the fp32 weights: three times what a worker reads
    assert (snap / "__0_0.distcp").stat().st_size > 2.9 * weights


def test_update_follow_under_torchrun_matches_one_process(fleet, sft_dir, tmp_path):
    """2 workers, and the update on 2 processes (gloo, FSDP2): the one-process weights up to float summation order."""
    root, err = _fleet(sft_dir, tmp_path, "dp", nproc=2)
    a, b = _weights(root), _weights(fleet[0])
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5)
    m = manifests.read_manifest(root / "step-000002")
    assert m["metrics"]["world_size"] == 2 and m["step"] == 2
    assert err.count("rlkit: error") == 0 and "--max-steps 2 reached" in err


def test_a_worker_killed_mid_batch_loses_only_that_batch(sft_dir, tmp_path):
    """Worker 1 is SIGKILLed while its batch 0 is half written: the update never reads the hidden file, names the
    worker after --worker-timeout and trains step 1 on worker 0's batch; worker 1 restarted removes its leftover and
    resumes at the newest step; the run completes."""
    (tmp_path / "rw.py").write_text(STALL)
    fn = ("--reward-fn", f"stall={tmp_path}/rw.py:stall", "--reward-timeout", "0")
    root, sp = tmp_path / "ckpts", tmp_path / "spool"
    sp.mkdir()
    upd = subprocess.Popen(_update_cmd(sft_dir, root, sp, extra=("--worker-timeout", "10", "--keep-batches")),
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env=_env(), start_new_session=True)
    # two chunks of 2 prompts a worker: worker 1 stalls in its second, its batch file half written
    w0 = _worker(sft_dir, root, sp, 0, 2, chunk=2, extra=fn)
    w1 = _worker(sft_dir, root, sp, 1, 2, chunk=2, extra=fn, env=_env(STALL="1"))
    procs = [upd, w0, w1]
    try:
        hidden = lambda: [p for p in sp.iterdir() if p.name.startswith(".b000000-w01of02")]  # noqa: E731
        _wait(lambda: hidden(), what="worker 1's half-written batch")
        os.killpg(w1.pid, signal.SIGKILL)
        w1.wait(timeout=30)
        assert not (sp / spool.batch_name(0, 1, 2, 0)).exists()
        _wait(lambda: (root / "step-000001").is_dir(), what="step 1")
        assert _batches(root, 1) == [spool.batch_name(0, 0, 2, 0)]  # worker 0's half of batch 0 only
        w1 = _worker(sft_dir, root, sp, 1, 2, chunk=2, extra=fn)
        procs.append(w1)
        err = upd.communicate(timeout=240)[1]
        assert upd.returncode == 0, err[-3000:]
        assert "worker(s) 1/2 wrote no batch 0 and gave no sign of life for 10 s (--worker-timeout)" in err
        assert w0.wait(timeout=60) == 0 and w1.wait(timeout=60) == 0
        assert "removed 1 unfinished batch file(s) a killed w01of02 left" in w1.stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert _batches(root, 2) == [spool.batch_name(1, i, 2, 1) for i in (0, 1)]
    assert len(list((sp / spool.DONE).iterdir())) == 3 and not list(sp.glob(".b*"))


def test_update_killed_mid_step_resumes_without_training_a_batch_twice(fleet, sft_dir, tmp_path):
    """SIGKILL the update while step 2's batch is claimed; the same command again resumes from step 1, puts the
    claimed files back, and ends with the uninterrupted run's weights: no batch lost, none trained twice."""
    root, sp = tmp_path / "ckpts", tmp_path / "spool"
    sp.mkdir()
    cmd = _update_cmd(sft_dir, root, sp, extra=("--keep-batches",))
    upd = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, env=_env(), start_new_session=True)
    ws = [_worker(sft_dir, root, sp, i, 2) for i in (0, 1)]
    try:
        _wait(lambda: (root / "step-000001").is_dir() and bool(spool.claimed(sp)), what="step 2's claimed batch")
        os.killpg(upd.pid, signal.SIGKILL)
        upd.wait(timeout=30)
        assert follow.newest(root).step in (1, 2)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
        assert r.returncode == 0, r.stderr[-3000:]
        assert "a killed update had claimed" in r.stderr
        for w in ws:
            assert w.wait(timeout=60) == 0, w.stderr.read()[-2000:]
    finally:
        for p in (upd, *ws):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    trained = _batches(root, 1) + _batches(root, 2)
    assert len(trained) == len(set(trained)) == 4
    assert sorted(p.name for p in (sp / spool.DONE).iterdir()) == sorted(trained) and spool.claimed(sp) == []
    a, b = _weights(root), _weights(fleet[0])
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@pytest.mark.parametrize("nproc", [1, 2])
def test_update_killed_between_snapshots_ends_with_the_uninterrupted_weights(sft_dir, tmp_path, nproc):
    """--snapshot-every 2, 4 steps, in one process and on 2 (torchrun, gloo): the update is SIGKILLed once step 3 is
    published, its newest snapshot step 2's. Rerun, it resumes from that snapshot, trains step 3 again from the
    claimed files its manifest names (not publishing it twice), then step 4: the weights of the same run
    uninterrupted, bit for bit."""
    steps, extra = 4, ("--snapshot-every", "2", "--keep-batches")
    whole, _ = _fleet(sft_dir, tmp_path, "whole", nproc=nproc, extra=extra, steps=steps)
    root, sp = tmp_path / "ckpts", tmp_path / "spool"
    sp.mkdir()
    cmd = _update_cmd(sft_dir, root, sp, extra=(*extra, "--metrics", str(tmp_path / "m.jsonl")), steps=steps,
                      nproc=nproc)
    upd = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, env=_env(), start_new_session=True)
    ws = [_worker(sft_dir, root, sp, i, 2, steps=steps) for i in (0, 1)]
    try:
        log = tmp_path / "m.jsonl"  # step 3 published and logged (its row follows its publish)
        _wait(lambda: log.is_file() and len(log.read_text().splitlines()) == 3, timeout=300, what="step 3")
        _kill_all(upd)
        upd.wait(timeout=30)
        assert [s for s, _ in snapshots.scan(root)] == [2]
        assert sorted(f.path.name for f in spool.claimed(sp)) >= sorted(_batches(root, 3))  # kept: not covered yet
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
        assert r.returncode == 0, r.stderr[-3000:]
        for w in ws:
            assert w.wait(timeout=60) == 0, w.stderr.read()[-2000:]
    finally:
        for p in (upd, *ws):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert "from its snapshot of step 2" in r.stderr and "step 3 trained again" in r.stderr
    assert r.stderr.count("update: wrote ") == 1  # step 4 only
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3, 4]  # one row a step: step 3's is not logged twice
    assert rows[1]["snapshot_bytes"] > 0 and "snapshot_bytes" not in rows[2]
    trained = [f for s in range(1, steps + 1) for f in _batches(root, s)]
    assert len(trained) == len(set(trained)) == 2 * steps
    assert sorted(p.name for p in (sp / spool.DONE).iterdir()) == sorted(trained) and spool.claimed(sp) == []
    assert [s for s, _ in snapshots.scan(root)] == [2, 4]
    a, b = _weights(root, steps), _weights(whole, steps)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_a_second_update_on_one_spool_is_refused(sft_dir, tmp_path):
    sp = tmp_path / "spool"
    sp.mkdir()
    first = subprocess.Popen(_update_cmd(sft_dir, tmp_path / "a", sp, extra=("--worker-timeout", "120")),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=_env(), start_new_session=True)
    try:
        _wait(lambda: (sp / spool.LOCK).is_file() and (sp / spool.LOCK).read_text().strip(), what="the first's lock")
        r = subprocess.run(_update_cmd(sft_dir, tmp_path / "b", sp), capture_output=True, timeout=120, env=_env())
        assert r.returncode == 75
        line = one_error_line(r)
        assert f"the spool {sp} is being consumed by another `rlkit update --follow`" in line and "pid" in line
        assert not (tmp_path / "b").exists()
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)


def test_fleet_bad_input_one_line_each(sft_dir, tmp_path):
    from conftest import run_cli

    sp = tmp_path / "spool"
    sp.mkdir()
    roll = ["rollout", "--policy", str(sft_dir), "--n", "2"]
    cases = [
        (roll + ["--spool", str(sp)], "--spool writes the batches of a --follow run"),
        (roll + ["--follow", str(tmp_path / "c"), "--spool", str(sp), "--out", str(tmp_path / "x.arrow")],
         "two outputs for one stream"),
        (roll + ["--follow", str(tmp_path / "c"), "--spool", str(sp), "--shard", "0/2", "--batch-prompts", "8"],
         "leave this worker none"),
        (["update", "--follow", "--policy", str(sft_dir), "--out", str(tmp_path / "c"), "--in",
          str(tmp_path / "nope")], "does not exist"),
    ]
    foreign = tmp_path / "not-a-spool"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("x")
    cases.append((["update", "--follow", "--policy", str(sft_dir), "--out", str(tmp_path / "c"), "--in",
                   str(foreign)], "'notes.txt' is not a spool file"))
    for args, want in cases:
        r = run_cli(*args)
        err = r.stderr.decode()
        assert r.returncode == 2, (args, err)
        assert want in one_error_line(r), (args, err)
        assert not (tmp_path / "c").exists() and not (tmp_path / "x.arrow").exists()
    assert list(sp.iterdir()) == [] and [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_under_torchrun_the_other_ranks_wait_for_input_up_to_the_dist_timeout(sft_dir, tmp_path):
    """An upstream that never sends a batch: rank 0 waits on its pipe, rank 1 gives up after --dist-timeout with one
    line naming the wait, and the run ends non-zero (torchrun stops rank 0) with no step written."""
    root = tmp_path / "ckpts"
    cmd = [a for a in _update_cmd(sft_dir, root, Path("-"), nproc=2) if a not in ("--in", "-")]
    rd, wr = os.pipe()  # stdin: a pipe whose writer, this test, never writes and stays open
    t0 = time.monotonic()
    try:
        r = subprocess.run([*cmd, "--dist-timeout", "0.1"], stdin=rd, capture_output=True, text=True, timeout=280,
                           env=_env())
    finally:
        os.close(rd)
        os.close(wr)
    assert r.returncode != 0 and time.monotonic() - t0 < 250
    assert "rank 1: rank 0 read no input for 0.1 minutes (--dist-timeout)" in r.stderr, r.stderr[-3000:]
    assert follow.newest(root) is None
