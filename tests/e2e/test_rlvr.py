"""The RLVR loop on the real tiny model: rollout | score-ref | update over real pipes."""

import json
import os
import signal
import subprocess
import time

import pyarrow as pa
import pytest
import torch

from rlkit.io import checkpoints, fingerprints, manifests, streams

from conftest import (
    fast_rlkit_cmd,
    one_error_line,
    rlkit_cmd,
    rlkit_path,
    run_cli,
    run_cli_inproc,
    stage,
    updates_in_one_process,
)

pytestmark = pytest.mark.slow


def _rollouts(sft_dir, out, seed=0, num=16, n=4, extra=()):
    """A rollouts table, made in this process (`stage`)."""
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", str(num), "--n", str(n), "--seed", str(seed),
          "--out", str(out), *extra)
    return out


def _table_rows(path):
    t, _ = streams.read_table(path, ["rollouts", "scored"])
    return t.to_pylist()


def test_rollout_schema_and_determinism(sft_dir, tmp_path):
    a = _rollouts(sft_dir, tmp_path / "a.arrow", seed=3)
    b = tmp_path / "b.arrow"  # the command, in its own process: the same table
    r = run_cli("rollout", "--policy", str(sft_dir), "--num-prompts", "16", "--n", "4", "--seed", "3", "--out", str(b))
    assert r.returncode == 0, r.stderr
    c = _rollouts(sft_dir, tmp_path / "c.arrow", seed=4)
    rows = _table_rows(a)
    assert len(rows) == 16 * 4
    assert rows == _table_rows(b)  # same seed, same inputs -> identical table
    assert [r["completion"] for r in rows] != [r["completion"] for r in _table_rows(c)]
    tok = checkpoints.load_tokenizer(sft_dir)
    for r in rows:
        assert len(r["completion_ids"]) == len(r["old_logprobs"]) >= 1
        assert all(lp <= 0 for lp in r["old_logprobs"])
        assert r["finish_reason"] in ("eos", "length")
        assert (r["completion_ids"][-1] == tok.eos_token_id) == (r["finish_reason"] == "eos")
        assert tok.decode(r["completion_ids"], skip_special_tokens=True) == r["completion"]
        assert r["reward/verifier"] in (0.0, 1.0)
        assert r["policy_step"] == 0 and r["policy_fingerprint"] == fingerprints.fingerprint(sft_dir)
    groups = {}
    for r in rows:
        groups.setdefault(r["group_id"], set()).add((r["prompt_id"], r["sample_idx"]))
    assert len(groups) == 16 and all(len(g) == 4 for g in groups.values())
    m = manifests.read_manifest(a)
    assert m["kind"] == "rollouts" and m["config"]["temperature"] == 1.0 and m["tokenizer"].startswith("tok:")


def test_old_logprobs_match_the_trainers_forward_pass(sft_dir, tmp_path):
    """pi_old logged by the engine equals the policy's own log-prob of the sampled tokens."""
    from rlkit.algorithms.inputs import build_batch
    from rlkit.ops.logprobs import completion_logprobs, padded

    t, _ = streams.read_table(_rollouts(sft_dir, tmp_path / "r.arrow"), ["rollouts"])
    model, tok = checkpoints.load_policy(sft_dir)
    b, _ = build_batch(t, tok.pad_token_id)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, padded(b.input_ids, b.attn, b.start))
    assert float((lp - b.old_logp)[b.mask].abs().max()) < 1e-4


def test_the_pipe_from_the_users_card(sft_dir, ref_dir, tmp_path):
    out = tmp_path / "ckpt"
    metrics = tmp_path / "m.jsonl"
    p1 = subprocess.Popen([*fast_rlkit_cmd(), "rollout", "--policy", str(sft_dir), "--n", "8", "--task", "arithmetic",
                           "--num-prompts", "32"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p2 = subprocess.Popen([*fast_rlkit_cmd(), "score-ref", "--ref", str(ref_dir)], stdin=p1.stdout,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p1.stdout.close()
    p3 = subprocess.run([*fast_rlkit_cmd(), "update", "--policy", str(sft_dir), "--out", str(out), "--metrics", str(metrics)],
                        stdin=p2.stdout, capture_output=True)
    p2.stdout.close()
    assert p1.wait() == 0 and p2.wait() == 0, (p1.stderr.read(), p2.stderr.read())
    assert p3.returncode == 0, p3.stderr
    m = json.loads((out / "rlkit.json").read_text())
    assert m["step"] == 1 and m["command"] == "update"
    row = json.loads(metrics.read_text())
    for key in ("reward_mean", "reward/verifier", "verifier_accuracy", "kl_per_token", "kl_per_seq", "entropy",
                "clip_fraction", "dual_clip_fraction", "ratio_min", "ratio_mean", "ratio_max", "grad_norm",
                "mean_response_tokens", "singleton_groups",
                "degenerate_group_fraction", "tokens_per_s", "train_seconds"):
        assert row[key] is not None, key
    assert row["sequences"] == 256 and row["kl_per_token"] >= 0
    before = checkpoints.load_policy(sft_dir)[0].state_dict()
    after = checkpoints.load_policy(out)[0].state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (out / "trainer" / "optimizer.safetensors").is_file()
    assert not list(out.glob("*.bin")) and not list(out.rglob("*.pt"))
    assert m["reference"] == {"path": str(ref_dir.absolute()), "fingerprint": fingerprints.fingerprint(ref_dir)}

    # the card's line as written, without --ref: score-ref scores with the reference ckpt/ was trained against
    card = "rlkit rollout --policy ckpt/ --n 8 | rlkit score-ref | rlkit update --policy ckpt/ --out ckpt2/"
    env = {**os.environ, "PATH": rlkit_path(os.environ["PATH"])}
    r = subprocess.run(["bash", "-c", f"set -euo pipefail; {card}"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"score-ref: reference {ref_dir.absolute()} (recorded by ckpt)" in r.stderr
    m2 = json.loads((tmp_path / "ckpt2" / "rlkit.json").read_text())
    assert m2["step"] == 2 and m2["reference"] == m["reference"] and m2["metrics"]["kl_per_token"] >= 0

    # an SFT checkpoint records no reference: the error says how to make one
    roll = tmp_path / "sft-rollouts.arrow"
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "2", "--n", "2", "--out", str(roll))
    line = one_error_line(run_cli_inproc("score-ref", "--in", str(roll), "--out", str(tmp_path / "s.arrow")))
    assert f"`rlkit freeze-ref --policy {sft_dir} --out ref/` and pass `--ref ref/`" in line, line
    assert not (tmp_path / "s.arrow").exists()


def test_truncated_upstream_fails_downstream_and_writes_nothing(sft_dir, ref_dir, tmp_path):
    out = tmp_path / "scored.arrow"
    p1 = subprocess.Popen([*rlkit_cmd(), "rollout", "--policy", str(sft_dir), "--num-prompts", "5000", "--n", "4"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p2 = subprocess.Popen([*rlkit_cmd(), "score-ref", "--ref", str(ref_dir), "--out", str(out)], stdin=p1.stdout,
                          stderr=subprocess.PIPE)
    p1.stdout.close()
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob(".scored.arrow.tmp*")):
        time.sleep(0.1)  # score-ref has read the schema and opened its output
    time.sleep(3)  # let a few batches through
    p1.send_signal(signal.SIGKILL)
    _, err = p2.communicate(timeout=120)
    assert p2.returncode == 3, err
    assert b"truncated" in err or b"end marker" in err
    assert list(tmp_path.iterdir()) == []


def test_sequential_updates_equal_one_process(sft_dir, tmp_path):
    from rlkit.algorithms.config import RLConfig

    r1 = _rollouts(sft_dir, tmp_path / "r1.arrow", seed=1, num=12)
    r2 = _rollouts(sft_dir, tmp_path / "r2.arrow", seed=2, num=12)
    flags = ["--beta", "0", "--minibatch-size", "16", "--epochs", "2", "--lr", "1e-3"]
    for src, pol, out in ((r1, sft_dir, tmp_path / "u1"), (r2, tmp_path / "u1", tmp_path / "u2")):
        r = run_cli("update", "--policy", str(pol), "--in", str(src), "--out", str(out), *flags)
        assert r.returncode == 0, r.stderr
    # the same two updates in one process, state kept in memory
    cfg = RLConfig(beta=0.0, minibatch_size=16, epochs=2, lr=1e-3)
    model, tok = checkpoints.load_policy(sft_dir)
    state = updates_in_one_process(model, tok, cfg, [r1, r2])
    seq = checkpoints.load_policy(tmp_path / "u2")[0].state_dict()
    one = model.state_dict()
    sft = checkpoints.load_policy(sft_dir)[0].state_dict()
    assert all(torch.allclose(seq[k], one[k], atol=1e-6, rtol=1e-5) for k in seq)
    assert any(not torch.allclose(sft[k], one[k]) for k in seq)  # and they did move
    assert json.loads((tmp_path / "u2" / "rlkit.json").read_text())["step"] == 2
    st = json.loads((tmp_path / "u2" / "trainer" / "state.json").read_text())
    assert st["optimizer_step"] == state.optimizer_step == 2 * 2 * 3  # 48 rows / 16 = 3 steps x 2 epochs x 2 updates


def test_bad_inputs_to_the_loop(sft_dir, ref_dir, tmp_path):
    roll = _rollouts(sft_dir, tmp_path / "r.arrow", num=4)
    # beta > 0 without reference log-probs
    line = one_error_line(run_cli("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(tmp_path / "u"),
                                   "--beta", "0.1"))
    assert "score-ref" in line and not (tmp_path / "u").exists()
    # rollouts without token ids (a plain table from another tool)
    t, _ = streams.read_table(roll, ["rollouts"])
    plain = tmp_path / "plain.arrow"
    stripped = t.drop_columns(["completion_ids"]).replace_schema_metadata(None)
    with pa.ipc.new_stream(str(plain), stripped.schema) as w:
        w.write_table(stripped)
    line = one_error_line(run_cli_inproc("score-ref", "--ref", str(ref_dir), "--in", str(plain), "--out", str(tmp_path / "s.arrow")))
    assert "missing column 'completion_ids'" in line and "`rlkit rollout`" in line
    # empty input
    empty = tmp_path / "empty.arrow"
    with streams.write_table("rollouts", empty, manifests.read_manifest(roll),
                               [pa.field("reward/verifier", pa.float64())]):
        pass
    line = one_error_line(run_cli_inproc("score-ref", "--ref", str(ref_dir), "--in", str(empty), "--out", str(tmp_path / "s.arrow")))
    assert "no rows" in line and not (tmp_path / "s.arrow").exists()
    line = one_error_line(run_cli_inproc("update", "--policy", str(sft_dir), "--in", str(empty), "--out", str(tmp_path / "u"),
                                   "--beta", "0"))
    assert "no rows" in line
    # a reference whose tokenizer differs from the policy's
    import shutil

    from rlkit.stages.freeze_ref import FreezeRefConfig
    from rlkit.stages.freeze_ref import run as freeze

    other = tmp_path / "other"
    shutil.copytree(sft_dir, other)
    tok = checkpoints.load_tokenizer(other)
    tok.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    tok.save_pretrained(other)
    freeze(FreezeRefConfig(policy=other, out=tmp_path / "other-ref"))
    line = one_error_line(run_cli_inproc("score-ref", "--ref", str(tmp_path / "other-ref"), "--in", str(roll),
                                   "--out", str(tmp_path / "s.arrow")))
    assert "different tokenizer" in line and not (tmp_path / "s.arrow").exists()
    # a prompts table is not rollouts
    p = tmp_path / "p.arrow"
    stage("prompts", "--num-prompts", "3", "--out", str(p))
    line = one_error_line(run_cli_inproc("update", "--policy", str(sft_dir), "--in", str(p), "--out", str(tmp_path / "u")))
    assert "is a 'prompts' table, expected a 'rollouts' or 'scored' table" in line
    # k1 in the loss has zero expected gradient: refused before anything is read or written
    scored = tmp_path / "scored.arrow"
    stage("score-ref", "--ref", str(ref_dir), "--in", str(roll), "--out", str(scored))
    line = one_error_line(run_cli_inproc("update", "--policy", str(sft_dir), "--in", str(scored), "--out", str(tmp_path / "u"),
                                   "--kl-estimator", "k1", "--kl-in", "loss"))
    assert "zero expected gradient" in line and "k3+" in line and not (tmp_path / "u").exists()
    line = one_error_line(run_cli_inproc("update", "--policy", str(sft_dir), "--in", str(scored), "--out", str(tmp_path / "u"),
                                   "--dual-clip", "1"))
    assert "--dual-clip 1 must be > 1" in line and not (tmp_path / "u").exists()


def test_groups_of_one_are_warned_about_and_get_no_push(sft_dir, tmp_path):
    """--n 1 under a group baseline: every advantage is 0 (no baseline), the update says so on stderr.
    A length penalty makes the rewards differ from row to row, so only the missing baseline zeroes them."""
    roll = _rollouts(sft_dir, tmp_path / "r.arrow", num=8, n=1)
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(tmp_path / "u"), "--beta", "0",
                "--length-penalty", "0.1", "--metrics", str(tmp_path / "m.jsonl"))
    assert r.returncode == 0, r.stderr
    assert "8 groups have one sample and get advantage 0 under --algo grpo" in r.stderr.decode()
    m = json.loads((tmp_path / "m.jsonl").read_text())
    assert m["singleton_groups"] == 8 and m["advantage_abs_mean"] == 0.0
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(tmp_path / "u2"), "--beta", "0",
                "--length-penalty", "0.1", "--algo", "reinforce-pp", "--metrics", str(tmp_path / "m2.jsonl"))
    assert r.returncode == 0 and "one sample" not in r.stderr.decode()
    assert json.loads((tmp_path / "m2.jsonl").read_text())["advantage_abs_mean"] > 0


def test_gspo_runs_with_its_own_defaults(sft_dir, tmp_path):
    """A plug-in algorithm end to end: `--algo gspo` needs no reference (beta 0), records its clip range and
    aggregation, and trains (a length penalty gives every group a signal)."""
    from safetensors.torch import load_file

    roll = _rollouts(sft_dir, tmp_path / "r.arrow", num=8)
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(tmp_path / "u"), "--algo", "gspo",
                "--length-penalty", "0.1", "--minibatch-size", "16", "--lr", "1e-3", "--metrics", str(tmp_path / "m.jsonl"))
    assert r.returncode == 0, r.stderr
    rl = json.loads((tmp_path / "u" / "rlkit.json").read_text())["config"]["rl"]
    assert (rl["beta"], rl["clip_low"], rl["clip_high"], rl["loss_agg"]) == (0.0, 3e-4, 4e-4, "seq-mean-token-mean")
    m = json.loads((tmp_path / "m.jsonl").read_text())
    assert m["optimizer_steps"] == 4 and m["advantage_abs_mean"] > 0 and 0 < m["clip_fraction"] <= 1
    moved = load_file(str(tmp_path / "u" / "model.safetensors"))
    sft = load_file(str(sft_dir / "model.safetensors"))
    assert any(not torch.equal(moved[k], sft[k]) for k in sft)


def test_cispo_runs_with_its_own_defaults_and_keeps_the_clipped_tokens_gradient(sft_dir, tmp_path):
    """`--algo cispo` end to end: no reference needed (beta 0), its clip range recorded, and it trains; a high
    learning rate moves ratios past 1 + clip_high in the second epoch, whose tokens CISPO counts as clipped and
    still trains on."""
    from safetensors.torch import load_file

    roll = _rollouts(sft_dir, tmp_path / "r.arrow", num=8)
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(tmp_path / "u"), "--algo", "cispo",
                "--length-penalty", "0.1", "--minibatch-size", "16", "--lr", "1e-2", "--metrics", str(tmp_path / "m.jsonl"))
    assert r.returncode == 0, r.stderr
    rl = json.loads((tmp_path / "u" / "rlkit.json").read_text())["config"]["rl"]
    assert (rl["algo"], rl["beta"], rl["clip_low"], rl["clip_high"], rl["loss_agg"]) == ("cispo", 0.0, 1.0, 0.28,
                                                                                          "token-mean")
    m = json.loads((tmp_path / "m.jsonl").read_text())
    assert m["optimizer_steps"] == 4 and m["advantage_abs_mean"] > 0 and 0 < m["clip_fraction"] <= 1
    assert m["dual_clip_fraction"] == 0
    moved = load_file(str(tmp_path / "u" / "model.safetensors"))
    sft = load_file(str(sft_dir / "model.safetensors"))
    assert any(not torch.equal(moved[k], sft[k]) for k in sft)


def test_overlong_punishment_and_masking_truncated_completions(sft_dir, tmp_path):
    """DAPO's overlong shaping on real rollouts cut at 3 tokens: the `overlong` component is the soft punishment of
    each row's length, and --mask-truncated trains on the rows that ended (a figure of how many were left out)."""
    from rlkit.ops.shaping import overlong_penalty

    roll = _rollouts(sft_dir, tmp_path / "r.arrow", num=8, extra=("--max-new-tokens", "3"))
    rows = _table_rows(roll)
    cut = sum(r["finish_reason"] == "length" for r in rows)
    assert 0 < cut < len(rows)  # some answers need more than 3 tokens, some end sooner
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(tmp_path / "u"), "--beta", "0",
                "--overlong-buffer", "2", "--overlong-penalty", "0.5", "--mask-truncated",
                "--metrics", str(tmp_path / "m.jsonl"))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    m = json.loads((tmp_path / "m.jsonl").read_text())
    want = overlong_penalty([len(x["completion_ids"]) for x in rows], 3, 2, 0.5)
    assert m["reward/overlong"] == pytest.approx(sum(want) / len(want)) and min(want) == -0.5
    assert m["truncated_masked_fraction"] == pytest.approx(cut / len(rows))
    assert "overlong" in json.loads((tmp_path / "u" / "rlkit.json").read_text())["reward_weights"]
    # a buffer that is not below the rollout's length limit: one line, nothing written
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(tmp_path / "bad"), "--beta", "0",
                "--overlong-buffer", "3")
    assert r.returncode == 2 and not (tmp_path / "bad").exists()
    assert "--overlong-buffer 3 must be below the rollout's --max-new-tokens 3" in r.stderr.decode()


def test_engine_choice_and_recomputed_pi_old(sft_dir, tmp_path):
    from rlkit.algorithms.config import RLConfig
    from rlkit.algorithms.inputs import build_batch
    from rlkit.algorithms.trainer import Trainer

    path = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(sft_dir), "--num-prompts", "12", "--n", "4", "--seed", "5",
                "--out", str(path))
    assert r.returncode == 0, r.stderr
    assert "rollout: engine hf (auto: no GPU here" in r.stderr.decode()  # --engine auto on a CPU, and why
    assert manifests.read_manifest(path)["engine"] == "hf"
    t, _ = streams.read_table(path, ["rollouts"])
    # trusting the HF engine's pi_old or recomputing it (with TIS) gives the same update: the engine is exact
    params, metrics = [], []
    for recompute, cap in ((False, None), (True, None), (True, 2.0)):
        cfg = RLConfig(beta=0.0, minibatch_size=16, epochs=2, lr=1e-3, tis_cap=cap)
        model, tok = checkpoints.load_policy(sft_dir)
        batch, _ = build_batch(t, tok.pad_token_id)
        metrics.append(Trainer(model, cfg).train(batch, length_norm=16.0, recompute=recompute))
        params.append(model.state_dict())
    assert metrics[0]["old_logprobs"] == "engine" and "logprob_mismatch" not in metrics[0]
    assert metrics[1]["old_logprobs"] == "recompute" and metrics[1]["logprob_mismatch"] < 1e-4
    assert abs(metrics[2]["tis_weight_mean"] - 1) < 1e-4 and metrics[2]["tis_capped_fraction"] == 0
    for other in params[1:]:
        assert all(torch.allclose(params[0][k], other[k], atol=1e-5) for k in other)
    # a mismatched engine (pi_engine made up 0.5 nats lower) shows in the gap, and TIS caps its weights
    off = batch._replace(old_logp=batch.old_logp - 0.5 * batch.mask)
    model, _ = checkpoints.load_policy(sft_dir)
    cfg = RLConfig(beta=0.0, minibatch_size=16, epochs=1, tis_cap=1.5)
    m = Trainer(model, cfg).train(off, length_norm=16.0, recompute=True)
    assert m["logprob_mismatch"] == pytest.approx(0.5, abs=1e-3)
    assert m["tis_weight_mean"] == pytest.approx(1.5, abs=1e-4) and m["tis_capped_fraction"] == 1.0


def test_bad_engine_and_pi_old_options(sft_dir, tmp_path):
    roll = _rollouts(sft_dir, tmp_path / "r.arrow", num=4)
    out = str(tmp_path / "x.arrow")
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--engine", "tpu", "--out", out)  # a choice, as --algo is
    assert r.returncode == 2 and "'tpu' is not one of 'auto', 'hf', 'vllm'" in r.stderr.decode()
    line = one_error_line(run_cli_inproc("rollout", "--policy", str(sft_dir), "--engine", "hf", "--tp", "2", "--out", out))
    assert "vLLM options" in line
    upd = ["update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(tmp_path / "u"), "--beta", "0"]
    line = one_error_line(run_cli_inproc(*upd, "--old-logprobs", "engine", "--tis-cap", "2"))
    assert "--tis-cap" in line and "--old-logprobs recompute" in line
    r = run_cli_inproc(*upd, "--old-logprobs", "sometimes")  # a choice: click's usage error names the option
    assert r.returncode == 2 and "'sometimes' is not one of 'engine', 'recompute', 'auto'" in r.stderr.decode()
    assert not (tmp_path / "u").exists() and not (tmp_path / "x.arrow").exists()


def test_rollout_shows_the_total_reward_update_trains_on_and_each_component(sft_dir, tmp_path):
    """A --reward-fn that gives every row 1.0: the progress and closing lines show the total (the components
    summed at weight 1, as update takes them) and one mean per component, not the verifier's alone. No
    --max-new-tokens: arithmetic's own 16, recorded."""
    (tmp_path / "rw.py").write_text("def probe(completion, row):\n    return 1.0\n")
    out = tmp_path / "r.arrow"
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--num-prompts", "8", "--n", "2", "--seed", "5",
                       "--reward-fn", f"probe={tmp_path}/rw.py:probe", "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    rows = _table_rows(out)
    verifier = sum(x["reward/verifier"] for x in rows) / len(rows)
    assert [x["reward/probe"] for x in rows] == [1.0] * 16
    err = r.stderr.decode()
    progress = [x for x in err.splitlines() if x.startswith("rollout: 16/16")]
    assert len(progress) == 1 and progress[0].endswith(f"reward {1 + verifier:.4g}  reward/verifier {verifier:.4g}  "
                                                       "reward/probe 1"), err
    assert (f"rollout: mean reward {1 + verifier:.4g} over 16 completions (reward/verifier {verifier:.4g} + "
            "reward/probe 1; update trains on this sum, or on the components weighed by its --reward)") in err
    m = manifests.read_manifest(out)
    assert m["config"]["max_new_tokens"] == 16 == json.loads((sft_dir / "rlkit.json").read_text())["config"]["max_new_tokens"]


def test_on_policy_distillation_from_a_teacher(sft_dir, ref_dir, tmp_path):
    """`score-ref --teacher` scores every sampled token with the teacher's own forward pass, and one distill update
    moves the student's log-probs of those tokens towards the teacher's. The sampling policy as its own teacher
    (its log-probs are pi_old's: teacher_kl 0, nothing to learn), a teacher with another tokenizer, and distill on a
    table without a teacher, are one line each."""
    import shutil

    from rlkit.scorers.logprobs import score_tokens

    roll = _rollouts(sft_dir, tmp_path / "r.arrow", num=8)
    same = tmp_path / "same.arrow"
    for policy in (sft_dir, tmp_path / "copy"):  # by the weights' fingerprint, wherever they are
        if policy != sft_dir:
            shutil.copytree(sft_dir, policy)
        line = one_error_line(run_cli_inproc("score-ref", "--teacher", str(policy), "--in", str(roll), "--out",
                                             str(same)))
        assert f"teacher {policy} is the policy that sampled these rollouts itself" in line, line
        assert "trains nothing (teacher_kl 0)" in line and not same.exists()
    # a teacher that differs: the sft checkpoint after one high-lr update (a length penalty gives it a signal)
    teacher = tmp_path / "teacher"
    stage("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(teacher), "--beta", "0", "--lr", "1e-2",
          "--length-penalty", "0.1")
    scored = tmp_path / "t.arrow"
    stage("score-ref", "--teacher", str(teacher), "--in", str(roll), "--out", str(scored))
    assert manifests.read_manifest(scored)["kind"] == "rollouts"  # no reference asked for
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(scored), "--out", str(tmp_path / "u"), "--algo",
                "distill", "--lr", "2e-4", "--minibatch-size", "8", "--metrics", str(tmp_path / "m.jsonl"))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    m = json.loads((tmp_path / "m.jsonl").read_text())
    assert m["teacher_kl"] > 1e-3 and m["teacher_advantage_abs_mean"] > 1e-3
    rows = _table_rows(scored)
    tok = checkpoints.load_tokenizer(sft_dir)
    prompts, comps = [r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows]
    tmodel, _ = checkpoints.load_policy(teacher)  # the teacher's own forward pass, at the rollout's temperature (1)
    for r, want in zip(rows, score_tokens(tmodel.eval(), prompts, comps, tok.pad_token_id, 1.0, 4096), strict=True):
        assert r["teacher_logprobs"] == pytest.approx(want, abs=1e-4)
    student, _ = checkpoints.load_policy(tmp_path / "u")
    new = score_tokens(student.eval(), prompts, comps, tok.pad_token_id, 1.0, 4096)

    def gap(lps):
        d = [abs(a - b) for r, lp in zip(rows, lps, strict=True) for a, b in zip(lp, r["teacher_logprobs"], strict=True)]
        return sum(d) / len(d)

    assert gap(new) < 0.9 * gap([r["old_logprobs"] for r in rows])
    # the teacher's column is carried through a later score-ref (the reference's), and a second teacher is refused
    both = tmp_path / "both.arrow"
    stage("score-ref", "--ref", str(ref_dir), "--in", str(scored), "--out", str(both))
    assert [r["teacher_logprobs"] for r in _table_rows(both)] == [r["teacher_logprobs"] for r in rows]
    line = one_error_line(run_cli_inproc("score-ref", "--teacher", str(teacher), "--in", str(scored), "--out",
                                         str(tmp_path / "twice.arrow")))
    assert "already has teacher log-probs" in line and not (tmp_path / "twice.arrow").exists()
    # refusals: distill without a teacher's log-probs; a teacher with another tokenizer
    line = one_error_line(run_cli_inproc("update", "--policy", str(sft_dir), "--in", str(roll), "--out",
                                         str(tmp_path / "no"), "--algo", "distill"))
    assert "--algo distill needs a teacher's log-probs" in line and "score-ref --teacher" in line
    assert not (tmp_path / "no").exists()
    other = tmp_path / "other"
    shutil.copytree(sft_dir, other)
    otok = checkpoints.load_tokenizer(other)
    otok.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    otok.save_pretrained(other)
    line = one_error_line(run_cli_inproc("score-ref", "--teacher", str(other), "--in", str(roll), "--out",
                                         str(tmp_path / "o.arrow")))
    assert "teacher" in line and "different tokenizer" in line and not (tmp_path / "o.arrow").exists()
