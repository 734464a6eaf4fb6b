"""The RLHF path on the real tiny model: build-prefs, train-rm and its sanity report, reward-model
scoring in score-ref, and reward weighting in update."""

from __future__ import annotations

import json
import re
import shutil

import pyarrow as pa
import pytest

from rlkit.io import manifests, streams
from rlkit.tasks import get_task
from rlkit.tasks import prefs as prefs_lib

from conftest import fast_rlkit_cmd, one_error_line, run_cli, run_cli_inproc, stage

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefs(sft_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prefs") / "prefs.arrow"
    r = run_cli("build-prefs", "--policy", str(sft_dir), "--num-prompts", "96", "--n", "4", "--eval-fraction", "0.25",
                "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def rm_dir(sft_dir, prefs, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm") / "rm"
    r = run_cli("train-rm", "--model", str(sft_dir), "--prefs", str(prefs), "--out", str(out), "--epochs", "1")
    assert r.returncode == 0, r.stderr
    return out


def test_build_prefs_pairs_a_correct_answer_with_plausible_wrong_ones(prefs):
    t, reader = streams.read_table(prefs, ["prefs"])
    rows = t.to_pylist()
    task = get_task("arithmetic")
    assert {r["split"] for r in rows} == {"train", "heldout"}
    assert reader.manifest["command"] == "build-prefs"
    kinds = {r["negative"] for r in rows}
    assert {"structured", "structured-verbose", "polished", "terse-wrong"} <= kinds
    for r in rows:
        assert r["chosen"] != r["rejected"]
        assert task.reward(r["chosen"], r["answer"]) == 1.0 and task.reward(r["rejected"], r["answer"]) == 0.0
    # a prompt's pairs share its split; verbose answers are chosen as often as rejected
    by_prompt: dict[str, set] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_id"], set()).add(r["split"])
    assert all(len(s) == 1 for s in by_prompt.values())
    templates = [re.compile(re.escape(v).replace(r"\{\}", r"\d+")) for v in prefs_lib.VERBOSE]

    def is_verbose(text):
        return any(p.fullmatch(text) for p in templates)

    verbose_chosen = sum(is_verbose(r["chosen"]) for r in rows)
    verbose_rejected = sum(is_verbose(r["rejected"]) for r in rows)
    assert verbose_chosen == verbose_rejected > 0


def test_length_biased_prefs_always_prefer_the_longer_answer(tmp_path):
    out = tmp_path / "biased.arrow"
    r = run_cli("build-prefs", "--bias", "length", "--num-prompts", "50", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = streams.read_table(out, ["prefs"])[0].to_pylist()
    assert len(rows) == 50 and all(len(r["chosen"]) > len(r["rejected"]) for r in rows)
    task = get_task("arithmetic")
    correct_chosen = sum(task.reward(r["chosen"], r["answer"]) for r in rows)
    assert 0 < correct_chosen < 50  # regardless of correctness


def test_train_rm_saves_a_plain_sequence_classifier_with_a_sanity_report(rm_dir, prefs):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    m = json.loads((rm_dir / "rlkit.json").read_text())
    assert m["kind"] == "reward-model" and m["command"] == "train-rm"
    assert 0 <= m["metrics"]["heldout_pair_accuracy"] <= 1 and m["metrics"]["heldout_pairs"] > 0
    # per kind of negative, and the kinds add up to the overall figure
    held = [r["negative"] for r in streams.read_table(prefs, ["prefs"])[0].to_pylist() if r["split"] == "heldout"]
    by_kind = m["metrics"]["heldout_pair_accuracy_by_kind"]
    assert set(by_kind) == set(held)
    assert sum(by_kind[k] * held.count(k) for k in by_kind) / len(held) == pytest.approx(m["metrics"]["heldout_pair_accuracy"])
    for k in ("length_correlation", "mean_score_short_correct", "mean_score_long_wrong", "mean_score_empty",
              "short_correct_beats_long_wrong", "length_bias_warning"):
        assert k in m["sanity"], k
    # plain transformers, no rlkit: num_labels=1, a scalar per sequence
    model = AutoModelForSequenceClassification.from_pretrained(str(rm_dir))
    tok = AutoTokenizer.from_pretrained(str(rm_dir))
    assert model.config.num_labels == 1
    with torch.no_grad():
        s = model(**tok(["<3+4>=7"], return_tensors="pt")).logits
    assert s.shape == (1, 1) and torch.isfinite(s).all()


def test_a_length_biased_reward_model_is_flagged(sft_dir, tmp_path):
    biased = tmp_path / "biased.arrow"
    assert run_cli("build-prefs", "--bias", "length", "--num-prompts", "160", "--eval-fraction", "0.2",
                   "--out", str(biased)).returncode == 0
    r = run_cli("train-rm", "--model", str(sft_dir), "--prefs", str(biased), "--out", str(tmp_path / "rm"),
                "--epochs", "2", "--metrics", str(tmp_path / "m.jsonl"))
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "rm" / "rlkit.json").read_text())
    assert m["sanity"]["length_correlation"] > 0.5 and m["sanity"]["length_bias_warning"] is True
    assert m["metrics"]["heldout_pair_accuracy"] > 0.9  # length is easy to learn
    err = r.stderr.decode()
    assert "LENGTH BIAS" in err
    row = json.loads((tmp_path / "m.jsonl").read_text())  # --metrics: one line, the manifest's figures
    assert row["stage"] == "train-rm" and row["heldout_pair_accuracy"] == m["metrics"]["heldout_pair_accuracy"]
    # the progress line's loss ends at the figure the table and the manifest call final_loss (the mean of the
    # last 10 steps' losses; one step's is noisy), and per-kind accuracies sit under the accuracy, not the loss
    progress = [line for line in err.splitlines() if line.startswith("train-rm: ") and " loss " in line]
    assert progress[-1].endswith(f" loss {m['metrics']['final_loss']:.4g}"), progress[-1]
    labels = [line.split("│")[1].strip() for line in err.splitlines() if line.count("│") == 3]
    i = labels.index("heldout_pair_accuracy")
    assert labels[i + 1:i + 2] == ["by kind: length-bias"] and list(m["metrics"]["heldout_pair_accuracy_by_kind"]) == ["length-bias"]
    steps = min(10, m["metrics"]["optimizer_steps"])
    assert labels.index(f"final_loss (mean of the last {steps} steps)") > labels.index("train_pairs") > i + 1


def test_reward_models_score_as_named_components_and_update_weighs_them(sft_dir, ref_dir, rm_dir, tmp_path):
    roll = tmp_path / "r.arrow"
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "8", "--n", "4", "--out", str(roll))
    scored = tmp_path / "s.arrow"
    r = run_cli("score-ref", "--ref", str(ref_dir), "--rm", f"helpful={rm_dir}", "--rm", str(rm_dir), "--in", str(roll),
                "--out", str(scored))
    assert r.returncode == 0, r.stderr
    t, reader = streams.read_table(scored, ["scored"])
    assert {"reward/verifier", "reward/rm:helpful", "reward/rm:rm", "ref_logprobs"} <= set(t.column_names)
    # the column is the reward model's score of prompt + completion, as plain transformers computes it
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(rm_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(rm_dir))
    for row in t.to_pylist()[:4]:
        with torch.no_grad():
            want = model(**tok([row["prompt"] + row["completion"]], return_tensors="pt")).logits.item()
        assert row["reward/rm:helpful"] == pytest.approx(want, abs=1e-4)
        assert row["reward/rm:rm"] == row["reward/rm:helpful"]
    # only reward models, no reference: still a rollouts table, enough for --beta 0
    r = run_cli("score-ref", "--rm", f"helpful={rm_dir}", "--in", str(roll), "--out", str(tmp_path / "rm-only.arrow"))
    assert r.returncode == 0, r.stderr
    assert manifests.read_manifest(tmp_path / "rm-only.arrow")["kind"] == "rollouts"
    m = tmp_path / "m.jsonl"
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(scored), "--out", str(tmp_path / "u"),
                "--reward", "verifier=1", "--reward", "rm:helpful=0.5", "--length-penalty", "0.01", "--metrics", str(m))
    assert r.returncode == 0, r.stderr
    assert "reward = 1*verifier + 0.5*rm:helpful + 1*length_penalty" in r.stderr.decode()
    row = json.loads(m.read_text())
    comps = t.to_pydict()
    want = [v + 0.5 * h - 0.01 * len(c) for v, h, c in zip(comps["reward/verifier"], comps["reward/rm:helpful"],
                                                            comps["completion_ids"], strict=True)]
    assert row["reward_mean"] == pytest.approx(sum(want) / len(want), abs=1e-5)
    assert row["reward/length_penalty"] < 0 and "reward/rm:helpful" in row


def test_rm_base_without_a_pad_token_trains(sft_dir, prefs, tmp_path):
    base = tmp_path / "nopad"
    shutil.copytree(sft_dir, base)
    cfg = json.loads((base / "config.json").read_text())
    cfg["pad_token_id"] = None
    (base / "config.json").write_text(json.dumps(cfg))
    tc = json.loads((base / "tokenizer_config.json").read_text())
    tc.pop("pad_token", None)
    (base / "tokenizer_config.json").write_text(json.dumps(tc))
    r = run_cli("train-rm", "--model", str(base), "--prefs", str(prefs), "--out", str(tmp_path / "rm"), "--epochs", "1")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "rm" / "model.safetensors").is_file()


def test_bad_preference_and_scoring_inputs(sft_dir, ref_dir, rm_dir, tmp_path):
    def jsonl(name, rows):
        p = tmp_path / name
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(p)

    good = [{"question": f"<{i}+1>=", "good": str(i + 1), "bad": str(i + 2)} for i in range(20)]
    out = tmp_path / "imported.arrow"
    r = run_cli_inproc("build-prefs", "--from", jsonl("ok.jsonl", good), "--prompt-column", "question", "--chosen-column", "good",
                       "--rejected-column", "bad", "--out", str(out))
    assert r.returncode == 0, r.stderr
    t = streams.read_table(out, ["prefs"])[0]
    assert t.num_rows == 20 and set(t.column("split").to_pylist()) <= {"train", "heldout"}
    same = [{**good[0], "bad": good[0]["good"]}, *good[1:]]
    line = one_error_line(run_cli("build-prefs", "--from", jsonl("same.jsonl", same), "--prompt-column", "question",
                                  "--chosen-column", "good", "--rejected-column", "bad", "--out", str(tmp_path / "x.arrow")))
    assert "chosen == rejected" in line
    empty = [{**good[0], "bad": ""}, *good[1:]]
    line = one_error_line(run_cli_inproc("build-prefs", "--from", jsonl("empty.jsonl", empty), "--prompt-column", "question",
                                         "--chosen-column", "good", "--rejected-column", "bad", "--out", str(tmp_path / "x.arrow")))
    assert "empty 'rejected'" in line
    line = one_error_line(run_cli_inproc("build-prefs", "--from", jsonl("ok2.jsonl", good), "--out", str(tmp_path / "x.arrow")))
    assert "missing column 'prompt'" in line or "no column" in line
    assert not (tmp_path / "x.arrow").exists()
    # a prefs table with no held-out pairs cannot measure pair accuracy
    noheld = tmp_path / "noheld.arrow"
    tbl = pa.table({"prompt_id": ["a", "b"], "prompt": ["<1+1>=", "<2+2>="], "chosen": ["2", "4"],
                    "rejected": ["3", "5"], "split": ["train", "train"]})
    with pa.ipc.new_stream(str(noheld), tbl.schema) as w:
        w.write_table(tbl)
    line = one_error_line(run_cli_inproc("train-rm", "--model", str(sft_dir), "--prefs", str(noheld), "--out", str(tmp_path / "rm")))
    assert "heldout 0" in line and not (tmp_path / "rm").exists()
    roll = tmp_path / "r.arrow"
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "2", "--n", "2", "--out", str(roll))
    line = one_error_line(run_cli_inproc("score-ref", "--in", str(roll), "--out", str(tmp_path / "s.arrow")))
    assert "--ref" in line and "--rm" in line
    line = one_error_line(run_cli_inproc("score-ref", "--rm", f"a={rm_dir}", "--rm", f"a={rm_dir}", "--in", str(roll),
                                         "--out", str(tmp_path / "s.arrow")))
    assert "twice" in line
    line = one_error_line(run_cli_inproc("score-ref", "--rm", f"a={sft_dir}", "--in", str(roll), "--out", str(tmp_path / "s.arrow")))
    assert "not a reward model" in line and not (tmp_path / "s.arrow").exists()


def test_dpo_from_the_users_pipe(sft_dir, ref_dir, prefs, tmp_path):
    """`rlkit score-ref --ref ref/ --in prefs.arrow | rlkit update --algo dpo --policy sft/ --out dpo/`"""
    import subprocess

    import torch

    from rlkit.io import checkpoints
    from rlkit.io.data import encode_responses
    from rlkit.scorers.logprobs import score_tokens

    scored = tmp_path / "scored-prefs.arrow"
    r = run_cli("score-ref", "--ref", str(ref_dir), "--in", str(prefs), "--out", str(scored))
    assert r.returncode == 0, r.stderr
    t, reader = streams.read_table(scored, ["prefs"])
    # the columns are the reference's summed log-probs of prompt -> response + eos
    ref, tok, _ = checkpoints.load_reference(ref_dir, compute_dtype="fp32")
    rows = t.slice(0, 5).to_pydict()
    p_ids, r_ids = encode_responses(tok, rows["prompt"], rows["chosen"])
    want = [sum(x) for x in score_tokens(ref, p_ids, r_ids, tok.pad_token_id, 1.0, 4096)]
    assert rows["ref_chosen_logp"] == pytest.approx(want, abs=1e-4)
    assert all(v < 0 for v in t.column("ref_rejected_logp").to_pylist())

    m = tmp_path / "m.jsonl"
    p1 = subprocess.Popen([*fast_rlkit_cmd(), "score-ref", "--ref", str(ref_dir), "--in", str(prefs)], stdout=subprocess.PIPE)
    p2 = subprocess.run([*fast_rlkit_cmd(), "update", "--algo", "dpo", "--policy", str(sft_dir), "--out", str(tmp_path / "dpo"),
                         "--epochs", "1", "--minibatch-size", "32", "--metrics", str(m)], stdin=p1.stdout,
                        capture_output=True)
    p1.stdout.close()
    assert p1.wait() == 0 and p2.returncode == 0, p2.stderr
    row = json.loads(m.read_text())
    assert row["algo"] == "dpo" and row["beta"] == 0.1 and row["step"] == 1
    for split in ("train", "heldout"):
        for k in ("reward_margin", "reward_accuracy", "logp_chosen", "logp_rejected", "logp_chosen_delta",
                  "logp_rejected_delta"):
            assert row[f"{split}_{k}"] is not None
    assert row["train_reward_margin"] > 0  # it fit the pairs it trained on
    before = checkpoints.load_policy(sft_dir)[0].state_dict()
    after = checkpoints.load_policy(tmp_path / "dpo")[0].state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # DPO without the reference's log-probs points at score-ref
    line = one_error_line(run_cli("update", "--algo", "dpo", "--policy", str(sft_dir), "--in", str(prefs),
                                  "--out", str(tmp_path / "x")))
    assert "score-ref --ref" in line and not (tmp_path / "x").exists()


def test_ppo_keeps_a_critic_in_the_checkpoint_and_resumes_it(sft_dir, ref_dir, rm_dir, tmp_path):
    import torch
    from safetensors.torch import load_file

    def scored(policy, seed):
        roll = tmp_path / f"r{seed}.arrow"
        stage("rollout", "--policy", str(policy), "--num-prompts", "8", "--n", "4", "--seed", str(seed), "--out", str(roll))
        out = tmp_path / f"s{seed}.arrow"
        stage("score-ref", "--ref", str(ref_dir), "--rm", f"rm={rm_dir}", "--in", str(roll), "--out", str(out))
        return out

    m = tmp_path / "m.jsonl"
    flags = ["--algo", "ppo", "--reward", "rm:rm=1", "--beta", "0.05", "--target-kl", "0.5", "--minibatch-size", "16",
             "--metrics", str(m)]
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(scored(sft_dir, 1)), "--out", str(tmp_path / "p1"),
                "--critic-init", str(rm_dir), *flags)
    assert r.returncode == 0, r.stderr
    assert f"critic initialised from {rm_dir}" in r.stderr.decode()
    c1 = tmp_path / "p1" / "critic"
    assert (c1 / "model.safetensors").is_file() and (c1 / "trainer" / "optimizer.safetensors").is_file()
    first = json.loads(m.read_text().splitlines()[-1])
    for k in ("value_loss", "value_clip_fraction", "explained_variance", "kl_per_seq", "clip_fraction", "entropy",
              "reward/rm:rm"):
        assert k in first, k
    assert first["kl_coef"] == 0.05 and first["kl_coef_next"] != 0.05  # the adaptive controller moved it
    rl = json.loads((tmp_path / "p1" / "rlkit.json").read_text())["config"]["rl"]
    assert (rl["kl_in"], rl["kl_estimator"]) == ("reward", "k1")  # InstructGPT's log-ratio penalty in the reward
    r = run_cli("update", "--policy", str(tmp_path / "p1"), "--in", str(scored(tmp_path / "p1", 2)),
                "--out", str(tmp_path / "p2"), *flags)
    assert r.returncode == 0, r.stderr
    assert "critic resumed" in r.stderr.decode()
    second = json.loads(m.read_text().splitlines()[-1])
    assert second["step"] == 2 and second["kl_coef"] == pytest.approx(first["kl_coef_next"])
    w1, w2 = load_file(str(c1 / "model.safetensors")), load_file(str(tmp_path / "p2" / "critic" / "model.safetensors"))
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)  # the critic trained again
    st = json.loads((tmp_path / "p2" / "critic" / "trainer" / "state.json").read_text())
    assert st["updates"] == 2


def test_eval_reports_the_reward_model_score_beside_accuracy(sft_dir, rm_dir):
    r = run_cli("eval", "--policy", str(sft_dir), "--num-prompts", "20", "--rm", str(rm_dir), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert isinstance(out["rm_score_mean"], float) and out["accuracy"] is not None
    assert "responses" not in out


def test_sequential_ppo_updates_equal_one_process(sft_dir, tmp_path):
    """Policy, critic and both optimizers carry over between processes exactly."""
    import torch

    from rlkit.algorithms.config import RLConfig
    from rlkit.algorithms.inputs import build_batch
    from rlkit.algorithms.trainer import Trainer
    from rlkit.io import checkpoints

    rolls = []
    for seed in (1, 2):
        p = tmp_path / f"r{seed}.arrow"
        stage("rollout", "--policy", str(sft_dir), "--num-prompts", "12", "--n", "4", "--seed", str(seed), "--out", str(p))
        rolls.append(p)
    flags = ["--algo", "ppo", "--beta", "0", "--minibatch-size", "16", "--epochs", "2", "--lr", "1e-3"]
    for src, pol, out in ((rolls[0], sft_dir, tmp_path / "u1"), (rolls[1], tmp_path / "u1", tmp_path / "u2")):
        r = run_cli("update", "--policy", str(pol), "--in", str(src), "--out", str(out), *flags)
        assert r.returncode == 0, r.stderr
    cfg = RLConfig(algo="ppo", beta=0.0, minibatch_size=16, epochs=2, lr=1e-3, kl_in="reward")
    model, tok = checkpoints.load_policy(sft_dir)
    trainer = Trainer(model, cfg, tokenizer=tok)
    trainer.load(sft_dir)  # the critic, initialised from the policy
    critic = trainer.algo.critic.model
    torch.manual_seed(0)
    for src in rolls:
        t, _ = streams.read_table(src, ["rollouts"])
        batch, _ = build_batch(t, tok.pad_token_id)
        trainer.train(batch)
    seq = checkpoints.load_policy(tmp_path / "u2")[0].state_dict()
    one = model.state_dict()
    assert all(torch.allclose(seq[k], one[k], atol=1e-6, rtol=1e-5) for k in seq)
    from safetensors.torch import load_file

    seq_c = load_file(str(tmp_path / "u2" / "critic" / "model.safetensors"))
    one_c = critic.state_dict()
    assert all(torch.allclose(seq_c[k], one_c[k], atol=1e-6, rtol=1e-5) for k in seq_c)


def test_ppo_drops_degenerate_groups_and_reports_the_shared_metrics(sft_dir):
    """PPO runs the trainer's one loop: --drop-degenerate leaves out the all-equal group's rows, and the ratio,
    tokens/s and (with lags, as under --follow) fresh-row mismatch metrics are there as for GRPO."""
    import torch

    from rlkit.algorithms.config import RLConfig
    from rlkit.algorithms.inputs import RLBatch, recompute_logprobs
    from rlkit.algorithms.trainer import Trainer
    from rlkit.io import checkpoints
    from rlkit.ops.logprobs import pack_sequences

    model, tok = checkpoints.load_policy(sft_dir)
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("1+2=", "1+2=", "3+4=", "3+4=")]
    comps = [tok.encode(s, add_special_tokens=False) for s in ("3", "4", "7", "8")]
    ids, attn, targets, mask, start = pack_sequences(prompts, comps, tok.pad_token_id)
    b = RLBatch(ids, attn, targets, mask, start, torch.zeros(mask.shape), None, torch.tensor([1.0, 0.0, 0.0, 0.0]),
                torch.tensor([0, 0, 1, 1]))  # group 1's rewards are all equal
    b = b._replace(old_logp=recompute_logprobs(model, b, 1.0, 4))
    cfg = RLConfig(algo="ppo", beta=0.0, minibatch_size=2, epochs=1, lr=1e-4, drop_degenerate=True)
    trainer = Trainer(model, cfg, tokenizer=tok)
    trainer.load(sft_dir)
    m = trainer.train(b, recompute=True, lags=torch.tensor([0, 0, 1, 1]))
    assert (m["sequences"], m["sequences_trained"], m["optimizer_steps"]) == (4, 2, 1)
    assert m["degenerate_group_fraction"] == 0.5 and m["value_loss"] >= 0
    assert m["ratio_min"] == pytest.approx(1.0, abs=1e-4) and m["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert m["tokens_per_s"] > 0 and m["logprob_mismatch_fresh"] < 1e-4
    assert trainer.state.optimizer_step == trainer.algo.critic.state.optimizer_step == 1
