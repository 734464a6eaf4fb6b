"""`update --follow`'s resume snapshots (rlkit.follow.snapshots) on the real tiny model and a real trainer: a step
trained after a snapshot is loaded is the step trained without the interruption, bit for bit; what a worker is
published holds no optimizer state; a damaged snapshot is refused in one line."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_engine import _rl_batch, policy  # noqa: F401 (a fixture)

from rlkit.algorithms.config import RLConfig
from rlkit.errors import RlkitError
from rlkit.follow import snapshots
from rlkit.follow.update import publish_dtype, served_weights

CFG = RLConfig(minibatch_size=4, epochs=2, beta=0.0, lr=1e-2)


def _trainer(model, tok):
    from rlkit.algorithms.trainer import Trainer

    return Trainer(copy.deepcopy(model), CFG, tokenizer=tok)


def test_a_step_after_a_snapshot_is_the_uninterrupted_step(policy, tmp_path):  # noqa: F811
    model, tok, _ = policy
    batch = _rl_batch(model, tok)
    t = _trainer(model, tok)
    t.train(batch, temperature=1.0, length_norm=16.0)
    path, secs, size = snapshots.save(t, tmp_path, 1, {"manifest": {"follow": {}}, "row": {}})
    assert path == tmp_path / "snapshots" / "snapshot-000001" and secs > 0
    assert size == sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    t.train(batch, temperature=1.0, length_norm=16.0)  # step 2 uninterrupted
    want = {k: v.clone() for k, v in t.model.state_dict().items()}

    r = _trainer(model, tok)  # a restarted update: the model as --policy gave it, a fresh AdamW
    assert [s for s, _ in snapshots.scan(tmp_path)] == [1]
    state = snapshots.verify(path)
    assert state["step"] == 1 and state["trainer"]["updates"] == 1
    snapshots.load(r, snapshots.Snapshot(1, path, state))
    assert r.state.updates == 1 and 2 * r.state.optimizer_step == t.state.optimizer_step  # the same steps each update
    r.train(batch, temperature=1.0, length_norm=16.0)
    got = r.model.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    w = snapshots.read_weights(path)  # the fp32 masters of step 1, whole
    assert w.keys() <= want.keys() and all(w[k].dtype == torch.float32 for k in w)


def test_a_damaged_snapshot_is_refused_in_one_line(policy, tmp_path):  # noqa: F811
    model, tok, _ = policy
    t = _trainer(model, tok)
    path, _, _ = snapshots.save(t, tmp_path, 3, {"manifest": {}, "row": {}})
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(RlkitError, match=r"snapshot-000003 fails its hash check \(__0_0\.distcp\)"):
        snapshots.verify(path)
    state = json.loads((path / "resume.json").read_text())
    state["step"] = 4
    (path / "resume.json").write_text(json.dumps(state))
    with pytest.raises(RlkitError, match="resume.json is damaged"):
        snapshots.verify(path)


def test_the_published_weights_are_in_the_served_dtype(policy):  # noqa: F811
    model, _, _ = policy
    assert publish_dtype(torch.device("cuda", 0), "fp32") == "bf16" and publish_dtype(torch.device("cpu"), "fp32") == "fp32"
    assert publish_dtype(torch.device("cuda", 0), "fp16") == "fp16"
    assert served_weights(model, None, "fp32") is None  # one process, fp32: saved as the model saves itself
    sd = served_weights(model, None, "bf16")
    assert {v.dtype for v in sd.values() if v.is_floating_point()} == {torch.bfloat16}
    assert sum(v.numel() * v.element_size() for v in sd.values()) * 2 == pytest.approx(
        sum(p.numel() * p.element_size() for p in model.parameters()), rel=0.01)


def test_a_bf16_step_is_what_a_worker_loads_and_reloads(policy, tmp_path):  # noqa: F811
    """The step a GPU trainer publishes (bf16): weights, config naming the dtype, tokenizer, hashes; no optimizer. A
    worker's HF engine reloads it in place (its model keeps its own dtype), bit for bit the bf16 weights."""
    from types import SimpleNamespace

    from safetensors import safe_open

    from rlkit.engines.hf import HFEngine
    from rlkit.follow.update import _write_step
    from rlkit.io import follow, manifests

    model, tok, _ = policy
    t = SimpleNamespace(model=model, tokenizer=tok, device=torch.device("cpu"))
    man = manifests.make_manifest("model", "update", {}, {}, step=1)
    path = follow.publish(tmp_path, 1, lambda tmp: _write_step(t, tmp, man, None, "bf16"))
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert not (path / "trainer").exists() and follow.verify_step(path)["weights_dtype"] == "bf16"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert {v.dtype for v in stored.values()} == {torch.bfloat16}
    params = sum(p.numel() for p in model.parameters())
    assert (path / "model.safetensors").stat().st_size < 2 * params + 16_384  # 2 bytes a parameter, and a header
    live = HFEngine.__new__(HFEngine)  # the live engine's model (fp32) and its reload, without a start
    live.model = copy.deepcopy(model)
    live.reload(path)
    sd = live.model.state_dict()
    for k, v in stored.items():
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], v.float()), k
