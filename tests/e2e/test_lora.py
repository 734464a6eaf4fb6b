"""LoRA (`--lora-rank R`, rlkit.training.lora) on the real tiny model, through real `rlkit` processes: sft, update
(GRPO, PPO with its critic, DPO), train-rm, score-ref, rollout, eval, freeze-ref --link, `--follow`, the
PEFT layout loaded without rlkit, N sequential processes equal to one, and the bad inputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlkit import training
from rlkit.algorithms.inputs import build_batch
from rlkit.io import adapters, checkpoints, fingerprints, streams
from rlkit.training import LoraOptions, TrainOptions, lora

from conftest import (
    fast_rlkit_cmd,
    make_lora_checkpoint,
    one_error_line,
    run_cli,
    run_cli_inproc,
    updates_in_one_process,
)

pytestmark = pytest.mark.slow

LORA = LoraOptions(rank=4)  # what `--lora-rank 4` gives: alpha 8, dropout 0, every linear layer of the blocks


def _rollouts(policy: Path, out: Path, seed: int, num: int = 12, n: int = 4) -> Path:
    """A rollouts table made in-process (not what these tests are about)."""
    from rlkit.stages.rollout import RolloutConfig, run

    run(RolloutConfig(policy=policy, out=out, num_prompts=num, n=n, seed=seed, engine="hf"))
    return out


@pytest.fixture(scope="module")
def lora_sft(sft_dir, tmp_path_factory) -> Path:
    """`rlkit sft --model SFT --lora-rank 4`: an adapter trained on top of the session's SFT checkpoint."""
    out = tmp_path_factory.mktemp("lora") / "sft-lora"
    r = run_cli("sft", "--model", str(sft_dir), "--lora-rank", "4", "--num-examples", "200", "--eval-num", "10",
                "--lr", "5e-3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def rolls(sft_dir, tmp_path_factory) -> tuple[Path, Path]:
    """Two rollout batches of the SFT policy (12 prompts x 4 samples) for the two updates of a run."""
    d = tmp_path_factory.mktemp("lora-rolls")
    return _rollouts(sft_dir, d / "r1.arrow", seed=1), _rollouts(sft_dir, d / "r2.arrow", seed=2)


@pytest.fixture(scope="module")
def prefs(sft_dir, tmp_path_factory) -> Path:
    from rlkit.stages.build_prefs import BuildPrefsConfig, run

    out = tmp_path_factory.mktemp("lora-prefs") / "prefs.arrow"
    run(BuildPrefsConfig(out=out, policy=sft_dir, num_prompts=24, n=2, eval_fraction=0.25))
    return out


def _adapter(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / adapters.ADAPTER_WEIGHTS))


# PEFT's own loader, in a process that never imports rlkit: prints the policy's logits (and a reward
# model's scores) on fixed token ids
_NO_RLKIT = """
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
base, policy, rm = sys.argv[1:4]
ids = torch.tensor([[1, 20, 30, 21, 40, 33]])
with torch.no_grad():
    pol = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), policy)
    out = {"logits": pol(ids).logits[0].tolist()}
    seq = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    out["score"] = PeftModel.from_pretrained(seq, rm)(ids).logits[0, 0].item()
assert not any(m == "rlkit" or m.startswith("rlkit.") for m in sys.modules)
print(json.dumps(out))
"""


def test_sft_lora_checkpoint_is_peft_layout_with_its_base_recorded(sft_dir, lora_sft):
    files = {p.name for p in lora_sft.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "rlkit.json"} <= files
    assert "model.safetensors" not in files and "config.json" not in files  # no copy of the base
    m = checkpoints.load_manifest(lora_sft)
    entry = m["lora"]
    assert entry["base"] == str(sft_dir.absolute()) and entry["kind"] == "causal-lm"
    assert (entry["base_weights_sha256"], entry["base_weights_digest"]) == checkpoints.hash_weights(sft_dir)
    assert (entry["rank"], entry["alpha"], entry["dropout"]) == (4, 8.0, 0.0)
    assert set(entry["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    # the manifest's weights hash covers the adapter
    assert m["weights_sha256"] == {"adapter_model.safetensors": fingerprints.sha256_file(lora_sft / "adapter_model.safetensors")}
    acfg = json.loads((lora_sft / "adapter_config.json").read_text())
    assert acfg["base_model_name_or_path"] == str(sft_dir.absolute()) and acfg["r"] == 4
    assert m["metrics"]["heldout_n"] == 10
    assert any(float(v.abs().max()) > 0 for k, v in _adapter(lora_sft).items() if "lora_B" in k)  # it trained

    # rlkit loads it trainable (the adapter only) or merged; both compute what the adapter does
    trainable, _ = checkpoints.load_policy(lora_sft)
    assert training.is_peft(trainable)
    names = [n for n, p in trainable.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    merged, _ = checkpoints.load_policy(lora_sft, merged=True)
    assert not training.is_peft(merged) and set(merged.state_dict()) == set(checkpoints.load_policy(sft_dir)[0].state_dict())
    ids = torch.tensor([[1, 20, 30, 21, 40, 33]])
    with torch.no_grad():
        want = merged(ids).logits[0]
        assert torch.allclose(trainable(ids).logits[0], want, atol=1e-5)
        plain = lora.plain_state_dict(trainable)  # the merged weights, computed without merging
        assert all(torch.allclose(plain[k], v, atol=1e-6) for k, v in merged.state_dict().items())


def test_train_rm_with_lora_then_score_ref_eval_and_peft_without_rlkit(sft_dir, lora_sft, prefs, tmp_path):
    """train-rm --lora-rank, score-ref --rm on the LoRA reward model, rollout and eval on the LoRA policy,
    and PEFT's own loader (no rlkit) on both checkpoints."""
    from rlkit.ops.logprobs import completion_logprobs, padded
    from rlkit.scorers.reward_model import load_reward_model, score_texts

    rm = tmp_path / "rm"
    r = run_cli("train-rm", "--model", str(sft_dir), "--prefs", str(prefs), "--out", str(rm), "--epochs", "1",
                "--lora-rank", "4")
    assert r.returncode == 0, r.stderr
    m = checkpoints.load_manifest(rm)
    assert m["kind"] == "reward-model" and m["lora"]["kind"] == "seq-cls" and m["lora"]["base"] == str(sft_dir.absolute())
    assert "base_model.model.score.weight" in _adapter(rm)  # the value head travels with the adapter
    assert not (rm / "model.safetensors").exists()

    # rollout on the LoRA policy (hf engine: merged): pi_old is the merged model's
    roll = tmp_path / "r.arrow"
    r = run_cli("rollout", "--policy", str(lora_sft), "--num-prompts", "4", "--n", "2", "--engine", "hf", "--out", str(roll))
    assert r.returncode == 0, r.stderr
    t, _ = streams.read_table(roll, ["rollouts"])
    assert set(t.column("policy_fingerprint").to_pylist()) == {fingerprints.fingerprint(lora_sft)}
    merged, tok = checkpoints.load_policy(lora_sft, merged=True)
    b, _ = build_batch(t, tok.pad_token_id)
    with torch.no_grad():
        lp, _ = completion_logprobs(merged, padded(b.input_ids, b.attn, b.start))
    assert float((lp - b.old_logp)[b.mask].abs().max()) < 1e-4

    # score-ref --rm with the LoRA reward model: the merged model's scores
    scored = tmp_path / "s.arrow"
    r = run_cli("score-ref", "--rm", f"h={rm}", "--in", str(roll), "--out", str(scored))
    assert r.returncode == 0, r.stderr
    s, _ = streams.read_table(scored, ["rollouts"])
    model, rtok = load_reward_model(rm)
    want = score_texts(model, rtok, s.column("prompt").to_pylist(), s.column("completion").to_pylist())
    assert s.column("reward/rm:h").to_pylist() == pytest.approx(want, abs=1e-5)

    # eval of the LoRA policy with the LoRA reward model
    r = run_cli("eval", "--policy", str(lora_sft), "--num-prompts", "8", "--rm", str(rm), "--json")
    assert r.returncode == 0, r.stderr
    ev = json.loads(r.stdout)
    assert ev["n"] == 8 and ev["rm_score_mean"] is not None

    # PEFT alone loads both: the same logits and score
    r = subprocess.run([sys.executable, "-c", _NO_RLKIT, str(sft_dir), str(lora_sft), str(rm)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ids = torch.tensor([[1, 20, 30, 21, 40, 33]])
    with torch.no_grad():
        assert torch.allclose(torch.tensor(out["logits"]), merged(ids).logits[0], atol=1e-5)
        from rlkit.scorers.reward_model import forward_scores

        assert out["score"] == pytest.approx(float(forward_scores(model, [ids[0].tolist()], rtok.pad_token_id)[0]),
                                             abs=1e-5)


def test_sequential_lora_grpo_updates_equal_one_process(sft_dir, rolls, tmp_path):
    """`update --lora-rank 4` from the full SFT checkpoint, then `update` on its LoRA checkpoint (the adapter
    keeps training), equals one process doing both updates; only the adapter has optimizer state."""
    from rlkit.algorithms.config import RLConfig

    r1, r2 = rolls
    flags = ["--beta", "0", "--minibatch-size", "16", "--epochs", "2", "--lr", "1e-2"]
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(r1), "--out", str(tmp_path / "u1"), "--lora-rank", "4",
                *flags)
    assert r.returncode == 0, r.stderr
    r = run_cli("update", "--policy", str(tmp_path / "u1"), "--in", str(r2), "--out", str(tmp_path / "u2"), *flags)
    assert r.returncode == 0, r.stderr

    cfg = RLConfig(beta=0.0, minibatch_size=16, epochs=2, lr=1e-2)
    model, tok = checkpoints.load_policy(sft_dir)
    model = training.prepare_model(model, TrainOptions(lora=LORA), "causal-lm", base=sft_dir)
    state = updates_in_one_process(model, tok, cfg, [r1, r2])

    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    seq, _ = checkpoints.load_policy(tmp_path / "u2")
    seq_p, one_p = dict(seq.named_parameters()), dict(model.named_parameters())
    assert all(torch.allclose(seq_p[n], one_p[n], atol=1e-6, rtol=1e-5) for n in trained)
    assert any(float(one_p[n].detach().abs().max()) > 0 for n in trained if "lora_B" in n)  # and they did move
    base = load_file(str(sft_dir / "model.safetensors"))
    assert all(torch.equal(base[k], v) for k, v in seq.state_dict().items() if k in base)  # base untouched
    # optimizer state: the adapter's parameters only, under the same names in every process
    for d in ("u1", "u2"):
        keys = set(load_file(str(tmp_path / d / "trainer" / "optimizer.safetensors")))
        assert keys == {"rng/torch"} | {f"{n}/{k}" for n in trained for k in ("exp_avg", "exp_avg_sq", "step")}
    assert json.loads((tmp_path / "u2" / "trainer" / "state.json").read_text())["optimizer_step"] == state.optimizer_step
    m = checkpoints.load_manifest(tmp_path / "u2")
    assert m["step"] == 2 and m["lora"]["base"] == str(sft_dir.absolute())


def test_sequential_lora_ppo_updates_equal_one_process(sft_dir, rolls, tmp_path):
    """With a LoRA policy the critic is LoRA too (same settings, same base, value head trainable), kept in
    critic/ with its base recorded, and resumed exactly."""
    from rlkit.algorithms.config import RLConfig
    from rlkit.algorithms.trainer import Trainer

    r1, r2 = rolls
    flags = ["--algo", "ppo", "--beta", "0", "--minibatch-size", "16", "--epochs", "1", "--lr", "1e-2"]
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(r1), "--out", str(tmp_path / "p1"), "--lora-rank", "4",
                *flags)
    assert r.returncode == 0, r.stderr
    critic_dir = tmp_path / "p1" / "critic"
    assert (critic_dir / "adapter_config.json").is_file() and not (critic_dir / "model.safetensors").exists()
    assert checkpoints.load_manifest(critic_dir)["lora"]["base"] == str(sft_dir.absolute())
    assert "base_model.model.score.weight" in _adapter(critic_dir)
    r = run_cli("update", "--policy", str(tmp_path / "p1"), "--in", str(r2), "--out", str(tmp_path / "p2"), *flags)
    assert r.returncode == 0, r.stderr
    assert "critic resumed" in r.stderr.decode()

    cfg = RLConfig(algo="ppo", beta=0.0, minibatch_size=16, epochs=1, lr=1e-2, kl_in="reward")
    model, tok = checkpoints.load_policy(sft_dir)
    trainer = Trainer(model, cfg, tokenizer=tok, train=TrainOptions(lora=LORA), base=sft_dir)
    trainer.load(sft_dir)  # a LoRA critic too, on the same base
    model, critic = trainer.model, trainer.algo.critic.model
    for src in (r1, r2):
        t, _ = streams.read_table(src, ["rollouts"])
        batch, _ = build_batch(t, tok.pad_token_id)
        trainer.train(batch)
    seq, _ = checkpoints.load_policy(tmp_path / "p2")
    for a, b in ((seq, model), (adapters.load(tmp_path / "p2" / "critic", "seq-cls"), critic)):
        pa_, pb = dict(a.named_parameters()), dict(b.named_parameters())
        trained = [n for n, p in pb.items() if p.requires_grad]
        assert trained and all(torch.allclose(pa_[n], pb[n], atol=1e-6, rtol=1e-5) for n in trained)
    assert any("score.modules_to_save" in k for k in load_file(str(tmp_path / "p2" / "critic" / "trainer" /
                                                                   "optimizer.safetensors")))


def test_dpo_on_a_lora_adapter_with_the_base_linked_as_reference(sft_dir, lora_sft, prefs, tmp_path):
    """freeze-ref --link: the base as the reference without a second copy; DPO keeps training the SFT adapter."""
    ref = tmp_path / "ref"
    r = run_cli("freeze-ref", "--policy", str(sft_dir), "--out", str(ref), "--link")
    assert r.returncode == 0, r.stderr
    assert os.stat(ref / "model.safetensors").st_ino == os.stat(sft_dir / "model.safetensors").st_ino
    m = checkpoints.verify_reference(ref)
    assert m["config"]["dtype"] == "fp32" and m["linked_from"] == str(sft_dir.absolute())
    scored = tmp_path / "scored-prefs.arrow"
    r = run_cli("score-ref", "--ref", str(ref), "--in", str(prefs), "--out", str(scored))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "dpo"
    r = run_cli("update", "--algo", "dpo", "--policy", str(lora_sft), "--in", str(scored), "--out", str(out),
                "--epochs", "1", "--minibatch-size", "16", "--ref", str(ref))
    assert r.returncode == 0, r.stderr
    m = checkpoints.load_manifest(out)
    assert m["lora"]["base"] == str(sft_dir.absolute()) and m["metrics"]["drift"] > 0
    before, after = _adapter(lora_sft), _adapter(out)
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    # a LoRA checkpoint freezes merged: a plain reference with the merged weights (in-process: the CLI path
    # of freeze-ref ran above)
    from rlkit.stages.freeze_ref import FreezeRefConfig
    from rlkit.stages.freeze_ref import run as freeze

    freeze(FreezeRefConfig(policy=out, out=tmp_path / "ref2", dtype="fp32"))
    ref2, _, _ = checkpoints.load_reference(tmp_path / "ref2")
    merged, _ = checkpoints.load_policy(out, merged=True)
    assert all(torch.equal(v, merged.state_dict()[k]) for k, v in ref2.state_dict().items())


def test_follow_pipe_trains_a_lora_adapter(sft_dir, tmp_path):
    """rollout --follow | update --follow --lora-rank: every step is an adapter on the same base, and the
    rollout samples each with the adapter merged (hf engine)."""
    root = tmp_path / "run"
    cmd = " ".join(fast_rlkit_cmd())
    script = (f"set -euo pipefail\n{cmd} rollout --follow {root} --policy {sft_dir} --n 4 --batch-prompts 2 "
              f"--max-lag 0 --engine hf | {cmd} update --follow --policy {sft_dir} --out {root} --max-steps 2 "
              "--max-lag 0 --beta 0 --lr 1e-2 --length-penalty 0.1 --lora-rank 4\n")  # lengths vary: a gradient
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "RLKIT_DEBUG": "0"})
    assert r.returncode == 0, r.stderr
    assert "weight reloads" in r.stderr
    steps = [root / "step-000001", root / "step-000002"]
    for s in steps:
        assert checkpoints.load_manifest(s)["lora"]["base"] == str(sft_dir.absolute())
        assert not (s / "model.safetensors").exists()
    a, b = (_adapter(s) for s in steps)
    assert any(not torch.equal(a[k], b[k]) for k in a) and any(float(v.abs().max()) > 0 for k, v in b.items()
                                                               if "lora_B" in k)


def test_bad_lora_inputs_are_one_line_and_write_nothing(sft_dir, lora_sft, tmp_path):
    roll = _rollouts(sft_dir, tmp_path / "r.arrow", seed=0, num=2, n=2)
    out = tmp_path / "out"

    def refused(*args: str, subprocess: bool = False) -> str:
        line = one_error_line((run_cli if subprocess else run_cli_inproc)(*args))
        assert not out.exists()
        return line

    # the base of a LoRA checkpoint changed in place, then gone
    base = tmp_path / "base"
    shutil.copytree(sft_dir, base)
    ck = make_lora_checkpoint(base, tmp_path / "ck", seed=0)
    fp = fingerprints.fingerprint(ck)
    w = base / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    line = refused("update", "--policy", str(ck), "--in", str(roll), "--out", str(out), "--beta", "0", subprocess=True)
    assert f"LoRA checkpoint {ck.absolute()}: its base model {base.absolute()} was changed since" in line
    assert "sha256 mismatch in model.safetensors" in line
    shutil.move(base, tmp_path / "moved")
    line = refused("rollout", "--policy", str(ck), "--num-prompts", "2", "--n", "2", "--out", str(out))
    assert f"its base model {base.absolute()} is missing" in line
    assert fingerprints.fingerprint(ck) == fp  # nothing damaged

    # LoRA flags
    assert "--lora-rank 0: must be >= 1" in refused("update", "--policy", str(sft_dir), "--in", str(roll), "--out",
                                                    str(out), "--beta", "0", "--lora-rank", "0")
    assert "need --lora-rank" in refused("sft", "--model", str(sft_dir), "--out", str(out), "--lora-alpha", "16")
    fp = fingerprints.fingerprint(lora_sft)
    line = refused("update", "--policy", str(lora_sft), "--in", str(roll), "--out", str(out), "--beta", "0",
                   "--lora-rank", "8")
    assert "has rank 4" in line and "rank 8" in line and fingerprints.fingerprint(lora_sft) == fp
    line = refused("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(out), "--beta", "0",
                   "--lora-rank", "4", "--lora-targets", "q_proj,attn_out")
    assert "--lora-targets attn_out: no module" in line and "q_proj" in line
    assert "saved model directory" in refused("sft", "--model", "tiny", "--out", str(out), "--lora-rank", "4",
                                              "--num-examples", "16")

    # freeze-ref --link: not a LoRA checkpoint, not another dtype, not across filesystems
    assert "LoRA checkpoint" in refused("freeze-ref", "--policy", str(lora_sft), "--out", str(out), "--link")
    assert "--dtype bf16" in refused("freeze-ref", "--policy", str(sft_dir), "--out", str(out), "--link", "--dtype", "bf16")
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and os.stat(shm).st_dev != os.stat(tmp_path).st_dev:
        far = shm / f"rlkit-test-{os.getpid()}" / "ref"
        try:
            line = one_error_line(run_cli_inproc("freeze-ref", "--policy", str(sft_dir), "--out", str(far), "--link"))
            assert "one filesystem" in line and not far.exists()
        finally:
            shutil.rmtree(far.parent, ignore_errors=True)


def test_adapter_ranks_round_up_to_a_rank_vllm_takes():
    from rlkit.engines.vllm import vllm_rank

    assert [vllm_rank(r) for r in (1, 2, 8, 9, 300, 512, 513)] == [1, 8, 8, 16, 320, 512, None]
