"""`update` under torchrun: 2 processes on CPU (gloo, FSDP2) against 1 process on the same batch."""

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

from conftest import run_cli, stage

pytestmark = pytest.mark.slow


def torchrun(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "rlkit", *args]
    return subprocess.run(cmd, input=stdin if stdin is not None else b"", capture_output=True, timeout=600,
                          env={**os.environ, "RLKIT_DEBUG": "0", "OMP_NUM_THREADS": "1"})


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        at = todo.pop()
        kids = [c for c, pp in parent.items() if pp == at]
        out += kids
        todo += kids
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_two_processes_match_one_and_resume_across_world_sizes(sft_dir, tmp_path):
    rolls = []
    for seed in (1, 2):
        stage("rollout", "--policy", str(sft_dir), "--num-prompts", "24", "--n", "4", "--seed", str(seed),
              "--out", str(tmp_path / f"r{seed}.arrow"))
        rolls.append(tmp_path / f"r{seed}.arrow")
    # the session SFT model is weak (rewards mostly 0): a length penalty gives every group a signal
    flags = ["--beta", "0", "--lr", "1e-3", "--minibatch-size", "32", "--epochs", "2", "--seed", "3",
             "--length-penalty", "0.05"]

    one = tmp_path / "one"
    # pi_old recomputed by the trainer: under torchrun each rank runs its half of the rows, then all-gathers
    recompute = ["--old-logprobs", "recompute"]
    assert run_cli("update", "--policy", str(sft_dir), "--in", str(rolls[0]), "--out", str(one), *flags,
                   *recompute).returncode == 0
    two = tmp_path / "two"  # the batch on stdin: rank 0 reads it and broadcasts it
    # in micro-batches too: 16 rows per rank and minibatch, as 5 + 5 + 5 + 1 (each loss term scaled by its share
    # of the whole minibatch, across ranks): the same update as one process in one forward
    r = torchrun("update", "--policy", str(sft_dir), "--out", str(two), *flags, *recompute, "--micro-batch-size", "5",
                 "--dist-timeout", "5", stdin=rolls[0].read_bytes())
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert r.stderr.decode().count("data-parallel over 2 processes") == 1  # rank 0 alone talks

    w1, w2, w0 = (load_file(str(d / "model.safetensors")) for d in (one, two, sft_dir))
    moved = _max_diff(w1, w0)
    assert moved > 1e-3 and _max_diff(w1, w2) < 0.02 * moved  # same update up to float summation order
    o1, o2 = (load_file(str(d / "trainer" / "optimizer.safetensors")) for d in (one, two))
    o1.pop("rng/torch"), o2.pop("rng/torch")
    assert _max_diff(o1, o2) < 1e-3
    m1, m2 = (json.loads((d / "rlkit.json").read_text()) for d in (one, two))
    assert m2["metrics"]["world_size"] == 2 and m2["step"] == m1["step"] == 1
    for k in ("sequences", "optimizer_steps", "clip_fraction", "reward_mean"):
        assert m2["metrics"][k] == pytest.approx(m1["metrics"][k], rel=1e-6, abs=1e-9), k
    # pi_old: rank 0 recomputed half the rows, and the gathered log-probs are one process's
    assert m1["metrics"]["recompute_rows"] == m1["metrics"]["sequences"] == 96
    assert m2["metrics"]["recompute_rows"] == 48
    assert m2["metrics"]["logprob_mismatch"] == pytest.approx(m1["metrics"]["logprob_mismatch"], rel=1e-3, abs=1e-6)
    assert m2["config"]["train"]["dist_timeout"] == 5.0
    assert m2["metrics"]["loss"] == pytest.approx(m1["metrics"]["loss"], abs=1e-4)
    # the gradient's size too (AdamW's steps hardly depend on it: a gradient scaled by a constant moves the weights alike)
    assert m2["metrics"]["grad_norm"] == pytest.approx(m1["metrics"]["grad_norm"], rel=1e-3)
    assert json.loads((two / "trainer" / "state.json").read_text()) == json.loads((one / "trainer" / "state.json").read_text())
    # an ordinary Hugging Face checkpoint: loads without rlkit
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(two))

    # resume with another world size: 1 process -> 2 processes equals 1 -> 1
    a, b = tmp_path / "one-one", tmp_path / "one-two"
    assert run_cli("update", "--policy", str(one), "--in", str(rolls[1]), "--out", str(a), *flags).returncode == 0
    r = torchrun("update", "--policy", str(one), "--in", str(rolls[1]), "--out", str(b), *flags,
                 "--micro-batch-tokens", "48")  # and micro-batches of rows up to 48 tokens
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert _max_diff(wa, wb) < 0.02 * _max_diff(wa, w1)
    ma, mb = (json.loads((d / "rlkit.json").read_text())["metrics"] for d in (a, b))
    assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-3)
    assert json.loads((b / "rlkit.json").read_text())["step"] == 2


def test_ppo_with_its_critic_and_dpo_under_torchrun_match_one_process(sft_dir, ref_dir, tmp_path):
    roll = tmp_path / "r.arrow"
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "16", "--n", "4", "--out", str(roll))
    flags = ["--algo", "ppo", "--beta", "0", "--lr", "1e-3", "--minibatch-size", "32", "--length-penalty", "0.05"]
    one, two = tmp_path / "ppo1", tmp_path / "ppo2"
    assert run_cli("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(one), *flags).returncode == 0
    r = torchrun("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(two), *flags)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    w0 = load_file(str(sft_dir / "model.safetensors"))
    for sub in ("", "critic/"):  # the policy and its critic, both gathered into ordinary HF directories
        a, b = load_file(str(one / sub / "model.safetensors")), load_file(str(two / sub / "model.safetensors"))
        moved = max(float((a[k] - w0[k]).abs().max()) for k in w0 if k in a)
        assert moved > 1e-3 and _max_diff(a, b) < 0.02 * moved, sub
    assert (two / "critic" / "trainer" / "optimizer.safetensors").is_file()

    prefs, scored = tmp_path / "p.arrow", tmp_path / "sp.arrow"
    stage("build-prefs", "--policy", str(sft_dir), "--num-prompts", "32", "--n", "2", "--out", str(prefs))
    stage("score-ref", "--ref", str(ref_dir), "--in", str(prefs), "--out", str(scored))
    flags = ["--algo", "dpo", "--lr", "1e-3", "--minibatch-size", "16", "--in", str(scored)]
    d1, d2 = tmp_path / "dpo1", tmp_path / "dpo2"
    assert run_cli("update", "--policy", str(sft_dir), "--out", str(d1), *flags).returncode == 0
    r = torchrun("update", "--policy", str(sft_dir), "--out", str(d2), *flags)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    a, b = load_file(str(d1 / "model.safetensors")), load_file(str(d2 / "model.safetensors"))
    assert _max_diff(a, b) < 0.02 * _max_diff(a, w0)
    m1, m2 = (json.loads((d / "rlkit.json").read_text())["metrics"] for d in (d1, d2))
    assert m2["heldout_reward_accuracy"] == m1["heldout_reward_accuracy"]


def test_cispo_distill_and_rejection_sampling_sft_under_torchrun_match_one_process(sft_dir, tmp_path):
    """The algorithms of the field's current recipes, each 2 processes against 1 on the same table: CISPO's detached
    weight, distillation's per-token teacher advantage (a teacher's log-probs as data), and sft on the rows of a
    rollouts table that reach --min-reward (sampled token ids, no re-tokenising)."""
    roll, teacher, scored = tmp_path / "r.arrow", tmp_path / "teacher", tmp_path / "t.arrow"
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "16", "--n", "4", "--out", str(roll))
    stage("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(teacher), "--beta", "0", "--lr", "1e-2",
          "--length-penalty", "0.1")
    stage("score-ref", "--teacher", str(teacher), "--in", str(roll), "--out", str(scored))
    w0 = load_file(str(sft_dir / "model.safetensors"))
    for name, flags in (("cispo", ["--algo", "cispo", "--length-penalty", "0.05"]), ("distill", ["--algo", "distill"])):
        flags = [*flags, "--lr", "1e-3", "--minibatch-size", "32", "--in", str(scored)]
        one, two = tmp_path / f"{name}1", tmp_path / f"{name}2"
        assert run_cli("update", "--policy", str(sft_dir), "--out", str(one), *flags).returncode == 0, name
        r = torchrun("update", "--policy", str(sft_dir), "--out", str(two), *flags)
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
        assert _max_diff(a, b) < 0.02 * _max_diff(a, w0), name
        m1, m2 = (json.loads((d / "rlkit.json").read_text())["metrics"] for d in (one, two))
        assert m2["world_size"] == 2 and m2["clip_fraction"] == pytest.approx(m1["clip_fraction"], abs=1e-6), name
        if name == "distill":
            assert m1["teacher_kl"] > 1e-3 and m2["teacher_kl"] == pytest.approx(m1["teacher_kl"], rel=1e-5)
    args = ["sft", "--model", str(sft_dir), "--data", str(roll), "--best-of", "--lr", "1e-4", "--eval-num", "10"]
    s1, s2 = tmp_path / "rs1", tmp_path / "rs2"
    assert run_cli(*args, "--out", str(s1)).returncode == 0
    r = torchrun(*args, "--out", str(s2))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    a, b = load_file(str(s1 / "model.safetensors")), load_file(str(s2 / "model.safetensors"))
    assert _max_diff(a, b) < 0.02 * _max_diff(a, w0)
    m1, m2 = (json.loads((d / "rlkit.json").read_text())["metrics"] for d in (s1, s2))
    assert m2["rows_kept"] == m1["rows_kept"] == 16 and m2["tokens"] == m1["tokens"]


def test_sft_and_train_rm_under_torchrun_match_one_process(sft_dir, tmp_path):
    s1, s2 = tmp_path / "sft1", tmp_path / "sft2"
    args = ["sft", "--num-examples", "400", "--eval-num", "20"]
    assert run_cli(*args, "--out", str(s1)).returncode == 0
    r = torchrun(*args, "--out", str(s2))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    a, b = load_file(str(s1 / "model.safetensors")), load_file(str(s2 / "model.safetensors"))
    assert _max_diff(a, b) < 1e-4  # observed ~1e-6 after ~30 steps (this is ~12)
    m1, m2 = (json.loads((d / "rlkit.json").read_text())["metrics"] for d in (s1, s2))
    assert m2["world_size"] == 2 and m2["steps"] == m1["steps"] and m2["tokens"] == m1["tokens"]
    assert m2["heldout_accuracy"] == m1["heldout_accuracy"]
    # --save-steps under torchrun: killed (the whole process group) after a snapshot, rerun: s2's weights exactly
    s3, snap = tmp_path / "sft3", tmp_path / ".sft3.resume"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "rlkit",
              *args, "--out", str(s3), "--save-steps", "3"]
    p = subprocess.Popen(launch, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, "RLKIT_DEBUG": "0", "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 240
    while not (snap / "resume.json").is_file():
        assert p.poll() is None and time.monotonic() < deadline, "no snapshot before the run ended"
        time.sleep(0.005)
    for pid in [p.pid, *_descendants(p.pid)]:  # torchrun starts its workers in sessions of their own
        os.kill(pid, signal.SIGKILL)
    p.wait()
    assert not s3.exists()
    r = torchrun(*args, "--out", str(s3), "--save-steps", "3")
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert "sft: resuming from step " in r.stderr.decode()
    c = load_file(str(s3 / "model.safetensors"))
    assert all(torch.equal(b[k], c[k]) for k in b)
    assert json.loads((s3 / "rlkit.json").read_text())["metrics"]["tokens"] == m2["tokens"]  # each rank's count kept
    assert not snap.exists()

    prefs = tmp_path / "p.arrow"
    stage("build-prefs", "--policy", str(sft_dir), "--num-prompts", "48", "--n", "2", "--out", str(prefs))
    r1, r2 = tmp_path / "rm1", tmp_path / "rm2"
    assert run_cli("train-rm", "--model", str(sft_dir), "--prefs", str(prefs), "--epochs", "1", "--out",
                   str(r1)).returncode == 0
    r = torchrun("train-rm", "--model", str(sft_dir), "--prefs", str(prefs), "--epochs", "1", "--out", str(r2))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    a, b, init = (load_file(str(d / "model.safetensors")) for d in (r1, r2, sft_dir))
    assert _max_diff(a, b) < 0.02 * max(float((a[k] - init[k]).abs().max()) for k in init if k in a)
    h1, h2 = (json.loads((d / "rlkit.json").read_text())["metrics"]["heldout_pair_accuracy"] for d in (r1, r2))
    assert h1 == h2


def test_bad_input_under_torchrun_is_one_line_and_one_exit_code_on_every_rank(sft_dir, tmp_path):
    """A cut --in (rank 0 reads it and broadcasts the error: exit 3 on every rank) and a missing --policy (every
    rank sees it before the process group is up: exit 2): rank 0 alone prints the line, every rank exits with
    the same documented code, and nothing is written. torchrun's own failure summary after a non-zero exit
    (its ChildFailedError) is torchrun's: it lists each rank's exit code."""
    import re

    roll, cut = tmp_path / "r.arrow", tmp_path / "cut.arrow"
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "4", "--n", "2", "--out", str(roll))
    cut.write_bytes(roll.read_bytes()[: roll.stat().st_size // 2])
    cases = [(["--policy", str(sft_dir), "--in", str(cut)], 3, "truncated Arrow stream"),
             (["--policy", str(tmp_path / "nosuch"), "--in", str(roll)], 2, "nosuch not found")]
    for args, code, said in cases:
        r = torchrun("update", *args, "--out", str(tmp_path / "out"))
        err = r.stderr.decode()
        ours = [line for line in err.splitlines() if line.startswith("rlkit:")]
        assert len(ours) == 1 and ours[0].startswith("rlkit: error: ") and said in ours[0], err[-3000:]
        assert re.findall(r"^\s+exitcode\s+:\s*(-?\d+)", err, re.M) == [str(code)] * 2, err[-3000:]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.arrow", "r.arrow"]
