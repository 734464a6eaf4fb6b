"""A NaN or inf loss says "lower --lr" only when the step's inputs were finite; when an input was not (a
NaN old log-prob or reward in the input table, NaN starting weights) the error names that input instead."""

import math

import pyarrow as pa
import pytest
import torch

from rlkit.algorithms.config import RLConfig
from rlkit.errors import RlkitError, non_finite_cause
from rlkit.io import manifests, schemas, streams

from conftest import one_error_line, run_cli, run_cli_inproc, stage


def _last_error_line(r) -> str:
    """A failed stage: exit 2, no traceback, the `rlkit: error:` line last (after the stage's info lines)."""
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]

# ---------------------------------------------------------------- the description, on tiny tensors


def test_non_finite_cause_names_the_first_bad_input_and_counts_its_rows():
    ok = torch.zeros(4, 3)
    old = torch.zeros(4, 3)
    old[1, 2] = old[3, 0] = math.nan  # two rows of four
    rew = torch.tensor([1.0, math.inf, -math.inf, math.nan])
    assert non_finite_cause({"a": ok, "b": None}) is None
    assert non_finite_cause({"a": ok, "the input table's old_logprobs": old, "r": rew}) == \
        "the input table's old_logprobs holds NaN in 2 of 4 rows"
    assert non_finite_cause({"the reward": rew}) == "the reward holds NaN and inf in 3 of 4 rows"
    assert non_finite_cause({"ids": torch.tensor([1, 2])}) is None  # integer tensors are never non-finite


def test_non_finite_cause_names_a_models_first_bad_weight():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert non_finite_cause({"the starting weights": model}) is None
    with torch.no_grad():
        model[1].weight[0, 0] = math.inf
        model[1].bias[1] = math.inf
    assert non_finite_cause({"the starting weights": model}) == \
        "the starting weights hold inf in 1.weight and 1 more tensors"


# ---------------------------------------------------------------- the trainer's failure path, in process


def _batch(sft_dir, rewards=(1.0, 0.0, 0.0, 1.0)):
    """Four sampled completions of one prompt with their own log-probs as pi_old and ref = pi_old - 0.05."""
    from rlkit.algorithms.inputs import RLBatch, recompute_logprobs
    from rlkit.io import checkpoints
    from rlkit.ops.logprobs import pack_sequences

    model, tok = checkpoints.load_policy(sft_dir)
    prompts = [tok.encode("12+7=", add_special_tokens=False)] * 4
    comps = [tok.encode(s, add_special_tokens=False) for s in ("19", "1", "190", "20")]
    ids, attn, targets, mask, start = pack_sequences(prompts, comps, tok.pad_token_id)
    b = RLBatch(ids, attn, targets, mask, start, torch.zeros(mask.shape), None,
                torch.tensor(rewards), torch.zeros(4, dtype=torch.long))
    old = recompute_logprobs(model, b, 1.0, 4)
    return model, tok, b._replace(old_logp=old, ref_logp=(old - 0.05) * mask)


def _train(model, batch, **cfg):
    from rlkit.algorithms.trainer import Trainer

    cfg = RLConfig(**{"minibatch_size": 2, "epochs": 1, "lr": 1e-4, "beta": 0.0, **cfg})
    with pytest.raises(RlkitError) as e:
        Trainer(model, cfg).train(batch)
    return str(e.value)


def test_nan_reference_logprobs_are_named_not_the_lr(sft_dir):
    model, _, b = _batch(sft_dir)
    ref = b.ref_logp.clone()
    ref[2, 0] = math.nan
    msg = _train(model, b._replace(ref_logp=ref), beta=0.1)
    assert msg.startswith("non-finite loss at optimizer step ") and msg.endswith(  # the step whose minibatch has row 2
        "; nothing was written: the input table's ref_logprobs holds NaN in 1 of 4 rows"), msg


def test_an_inf_combined_reward_is_named_not_the_lr(sft_dir):
    model, _, b = _batch(sft_dir, rewards=(1.0, math.inf, 0.0, 1.0))  # a batch built around build_batch's check
    msg = _train(model, b)
    assert "the reward (the input table's reward/* columns) holds inf in 1 of 4 rows" in msg and "--lr" not in msg


def test_nan_starting_weights_are_named_not_the_lr(sft_dir):
    """Past checkpoints.load_policy's own check at load time: a model poisoned in memory."""
    model, _, b = _batch(sft_dir)
    name, p = next((n, p) for n, p in model.named_parameters() if n.endswith("mlp.up_proj.weight"))
    with torch.no_grad():
        p[0, 0] = math.nan
    msg = _train(model, b)
    assert msg.endswith(f"nothing was written: the starting weights hold NaN in {name}"), msg


def test_finite_inputs_and_a_huge_lr_still_say_lower_the_lr(sft_dir):
    """The first step moves every weight by ~lr (Adam), so the second step's gradient is not finite: its
    inputs were, so the advice stands."""
    model, _, b = _batch(sft_dir)
    msg = _train(model, b, lr=1e30)
    assert msg == "non-finite gradient at optimizer step 1; nothing was written (lower --lr, now 1e+30)", msg


def test_ppo_names_nan_critic_weights(sft_dir):
    from rlkit.algorithms.trainer import Trainer

    model, tok, b = _batch(sft_dir)
    cfg = RLConfig(algo="ppo", beta=0.0, kl_in="reward", minibatch_size=2, epochs=1, lr=1e-4)
    trainer = Trainer(model, cfg, tokenizer=tok)
    trainer.load(sft_dir)  # the critic, initialised from the policy
    critic = trainer.algo.critic.model
    name, p = next((n, p) for n, p in critic.named_parameters() if n.endswith("mlp.down_proj.weight"))
    with torch.no_grad():
        p[0, 0] = math.nan
    with pytest.raises(RlkitError) as e:
        trainer.train(b)
    assert str(e.value).endswith(f"nothing was written: the critic's starting weights hold NaN in {name}"), e.value


# ---------------------------------------------------------------- `rlkit update` on an edited real table


def _edit(src, dst, column, fn):
    """Copy rlkit table `src` to `dst` with `column`'s per-row values passed through fn(row index, value)."""
    t, _ = streams.read_table(src, ["rollouts", "scored"])
    i = t.schema.get_field_index(column)
    vals = [fn(r, v) for r, v in enumerate(t.column(column).to_pylist())]
    t = t.set_column(i, t.schema.field(i), pa.array(vals, type=t.schema.field(i).type))
    with pa.ipc.new_stream(str(dst), t.schema) as w:
        w.write_table(t)
        empty = pa.record_batch([pa.array([], type=f.type) for f in t.schema], schema=t.schema)
        w.write_batch(empty, custom_metadata={schemas.END_KEY: str(t.num_rows)})
    return dst


@pytest.mark.slow
def test_update_names_the_non_finite_column_of_its_input(sft_dir, tmp_path):
    roll = tmp_path / "r.arrow"
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "4", "--n", "4", "--out", str(roll))
    out = tmp_path / "u"
    update = ("update", "--policy", str(sft_dir), "--out", str(out), "--beta", "0", "--old-logprobs", "engine")

    nan_old = _edit(roll, tmp_path / "nan-old.arrow", "old_logprobs",
                    lambda r, v: [math.nan, *v[1:]] if r in (1, 5) else v)
    line = _last_error_line(run_cli(*update, "--in", str(nan_old)))
    assert line.startswith("rlkit: error: non-finite loss at optimizer step 0; nothing was written") and \
        line.endswith("the input table's old_logprobs holds NaN in 2 of 16 rows"), line

    for bad, word in ((math.nan, "NaN"), (math.inf, "inf")):
        t = _edit(roll, tmp_path / f"{word}-reward.arrow", "reward/verifier", lambda r, v, bad=bad: bad if r == 3 else v)
        line = one_error_line(run_cli_inproc(*update, "--in", str(t)))
        assert line == f"rlkit: error: the input table's reward/verifier holds {word} in 1 of 16 rows", line
    assert not out.exists()


# ---------------------------------------------------------------- sft and train-rm on NaN starting weights


@pytest.fixture
def nan_checkpoint(sft_dir, tmp_path, monkeypatch):
    """A copy of the SFT checkpoint with one NaN weight, and load-time checks off (`--no-verify`, and
    checkpoints.check_finite a no-op) so that the training step meets it. -> (dir, the weight's name)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from rlkit.io import checkpoints

    d = tmp_path / "nan-ckpt"
    shutil.copytree(sft_dir, d)
    sd = load_file(str(d / "model.safetensors"))
    name = next(n for n in sd if n.endswith("layers.0.mlp.up_proj.weight"))
    sd[name][0, 0] = math.nan
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(checkpoints, "check_finite", lambda *a, **k: None, raising=False)
    return d, name


def test_sft_names_nan_starting_weights_not_the_lr(nan_checkpoint, tmp_path):
    from rlkit.stages.sft import SftConfig, run

    d, name = nan_checkpoint
    with pytest.raises(RlkitError) as e:
        run(SftConfig(out=tmp_path / "o", model=str(d), num_examples=64, eval_num=4, verify=False))
    msg = str(e.value)  # ours, or a load-time check's if one catches it first: either way NaN, not --lr
    assert "NaN" in msg and "--lr" not in msg, msg
    if msg.startswith("non-finite"):
        assert msg == f"non-finite loss at optimizer step 0; nothing was written: the starting weights hold NaN in {name}", msg
    assert not (tmp_path / "o").exists()


def test_train_rm_names_nan_starting_weights_not_the_lr(nan_checkpoint, tmp_path):
    from rlkit.stages.train_rm import TrainRmConfig, run

    d, name = nan_checkpoint
    prefs = tmp_path / "prefs.arrow"
    with streams.write_table("prefs", prefs, manifests.make_manifest("prefs", "build-prefs", {}, {})) as w:
        w.write({"prompt_id": ["a", "b", "c", "d"], "prompt": ["1+1=", "2+2=", "3+3=", "4+4="],
                 "chosen": ["2", "4", "6", "8"], "rejected": ["3", "5", "7", "9"],
                 "split": ["train", "train", "train", "heldout"]})
    with pytest.raises(RlkitError) as e:
        run(TrainRmConfig(base=d, prefs=str(prefs), out=tmp_path / "rm", epochs=1, verify=False))
    msg = str(e.value)  # ours, or a load-time check's if one catches it first: either way NaN, not --lr
    assert "NaN" in msg and "--lr" not in msg, msg
    if msg.startswith("non-finite"):  # the reward model's body is the policy's `model.` (its head is `score`)
        assert msg == f"non-finite loss at optimizer step 0; nothing was written: the starting weights hold NaN in {name}", msg
    assert not (tmp_path / "rm").exists()
