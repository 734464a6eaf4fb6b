"""Checkpoints and the frozen reference, on the real tiny model."""

import json
import shutil
import subprocess
import sys

import pytest

from rlkit.errors import RlkitError
from rlkit.io import checkpoints

from conftest import run_cli, run_cli_inproc


def test_sft_checkpoint_is_a_plain_hugging_face_directory(sft_dir):
    names = {p.name for p in sft_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "rlkit.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)
    m = json.loads((sft_dir / "rlkit.json").read_text())
    assert m["kind"] == "model" and m["command"] == "sft" and m["step"] == 0
    assert m["config"]["task"].startswith("arithmetic:") and m["metrics"]["steps"] > 0
    assert m["weights_sha256"]["model.safetensors"] and m["weights_digest"]
    # loads with transformers alone: no rlkit import in that process
    code = (
        "import sys; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(sft_dir)!r}); t = AutoTokenizer.from_pretrained({str(sft_dir)!r})\n"
        "assert 'rlkit' not in sys.modules\n"
        "ids = t('<1+2>=', return_tensors='pt').input_ids\n"
        "print(t.decode(m.generate(ids, max_new_tokens=3, do_sample=False)[0, ids.shape[1]:], skip_special_tokens=True))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_reference_is_bf16_half_the_bytes_and_hash_checked(sft_dir, ref_dir):
    pol, ref = checkpoints.safetensors_summary(sft_dir), checkpoints.safetensors_summary(ref_dir)
    assert pol["parameters"] == ref["parameters"] > 0
    assert ref["dtypes"] == ["BF16"] and pol["dtypes"] == ["F32"]
    assert ref["bytes"] * 2 == pol["bytes"]
    model, _, m = checkpoints.load_reference(ref_dir)
    assert m["kind"] == "reference" and not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype.__str__() == "torch.bfloat16"


def test_a_modified_reference_is_refused(ref_dir, tmp_path):
    bad = tmp_path / "ref"
    shutil.copytree(ref_dir, bad)
    w = bad / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-3] ^= 0xFF  # flip bits inside the last tensor
    w.write_bytes(bytes(data))
    with pytest.raises(RlkitError, match="modified after freezing: sha256 mismatch in model.safetensors"):
        checkpoints.load_reference(bad)
    with pytest.raises(RlkitError, match="not a frozen reference"):
        checkpoints.verify_reference(_policy_copy(ref_dir, tmp_path))


def _policy_copy(ref_dir, tmp_path):
    d = tmp_path / "notref"
    shutil.copytree(ref_dir, d)
    m = json.loads((d / "rlkit.json").read_text())
    m["kind"] = "model"
    (d / "rlkit.json").write_text(json.dumps(m))
    return d


def test_rerun_is_skipped_when_up_to_date_and_redone_when_inputs_change(sft_dir, tmp_path):
    pol = tmp_path / "pol"
    shutil.copytree(sft_dir, pol)
    out = tmp_path / "ref"
    r = run_cli("freeze-ref", "--policy", str(pol), "--out", str(out), "--dtype", "fp16")
    assert r.returncode == 0, r.stderr
    assert b"parameters" in r.stderr and b"as fp16" in r.stderr
    first = json.loads((out / "rlkit.json").read_text())
    # the reruns in this process (the CLI's entry point and stderr; the up-to-date check reads the disk and the
    # file-version cache that every process shares)
    r = run_cli_inproc("freeze-ref", "--policy", str(pol), "--out", str(out), "--dtype", "fp16")
    assert r.returncode == 0 and b"up to date" in r.stderr
    assert json.loads((out / "rlkit.json").read_text())["created"] == first["created"]
    # a changed setting reruns
    r = run_cli_inproc("freeze-ref", "--policy", str(pol), "--out", str(out), "--dtype", "bf16")
    assert r.returncode == 0 and b"up to date" not in r.stderr
    assert json.loads((out / "rlkit.json").read_text())["config"]["dtype"] == "bf16"
    # a new policy checkpoint (edited input) reruns
    tok = json.loads((pol / "tokenizer_config.json").read_text())
    tok["model_max_length"] = 4096
    (pol / "tokenizer_config.json").write_text(json.dumps(tok))
    r = run_cli_inproc("freeze-ref", "--policy", str(pol), "--out", str(out), "--dtype", "bf16")
    assert r.returncode == 0 and b"up to date" not in r.stderr
    # --force reruns an up-to-date stage
    r = run_cli_inproc("freeze-ref", "--policy", str(pol), "--out", str(out), "--dtype", "bf16", "--force")
    assert r.returncode == 0 and b"up to date" not in r.stderr


def test_safetensors_summary_reads_headers_only(sft_dir):
    s = checkpoints.safetensors_summary(sft_dir)
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(sft_dir, dtype=torch.float32)
    # tied embeddings are stored once
    assert s["parameters"] == sum(p.numel() for p in m.parameters())
