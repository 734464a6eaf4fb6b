"""Nothing a user owns is lost: a stage never writes over its inputs, one writer per --out, every checkpoint is
verified before use (once per file version), a damaged or unwritable location is one line, and what a killed
writer left behind is cleaned up by the next one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from rlkit.errors import RlkitError
from rlkit.io import atomic, checkpoints, claims, fingerprints

from conftest import one_error_line, rlkit_cmd, run_cli, run_cli_inproc, stage


def _flip_last_byte(f: Path) -> None:
    with open(f, "r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([b[0] ^ 1]))


def _tree_sha(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): fingerprints.sha256_file(p) for p in sorted(d.rglob("*")) if p.is_file()}


def test_out_equal_to_an_input_is_refused_and_untouched(tmp_path, sft_dir):
    pol = tmp_path / "pol"
    shutil.copytree(sft_dir, pol)
    before = _tree_sha(pol)
    line = one_error_line(run_cli("freeze-ref", "--policy", str(pol), "--out", str(pol)))
    assert f"--out {pol} is one of this stage's inputs (--policy {pol})" in line
    # the same directory spelled differently, and through a symlink
    (tmp_path / "link").symlink_to(pol)
    r = run_cli_inproc("freeze-ref", "--policy", str(pol), "--out", str(tmp_path / "link"))
    assert "is one of this stage's inputs (--policy" in one_error_line(r) and r.returncode == 2
    r = run_cli_inproc("update", "--policy", str(pol), "--out", str(tmp_path / "." / "pol"), "--in", "nothing.arrow")
    assert "is one of this stage's inputs (--policy" in one_error_line(r)
    r = run_cli_inproc("update", "--policy", str(pol), "--out", str(pol / "next"), "--in", "nothing.arrow")
    assert "lies inside an input directory (--policy" in one_error_line(r)
    r = run_cli_inproc("update", "--policy", str(pol), "--out", str(tmp_path), "--in", "nothing.arrow")
    assert "contains one of this stage's inputs (--policy" in one_error_line(r)
    assert _tree_sha(pol) == before and sorted(os.listdir(tmp_path)) == ["link", "pol"]


def test_out_equal_to_the_input_table_or_a_lora_base(tmp_path, sft_dir):
    from conftest import make_lora_checkpoint

    table = tmp_path / "p.arrow"
    stage("prompts", "--num-prompts", "4", "--out", str(table))
    before = fingerprints.sha256_file(table)
    r = run_cli_inproc("cat", str(table), "--out", str(table))
    assert f"is one of this stage's inputs (TABLE {table})" in one_error_line(r)
    base = tmp_path / "base"
    shutil.copytree(sft_dir, base)
    lora = make_lora_checkpoint(base, tmp_path / "lora", seed=0)
    base_sha = _tree_sha(base)
    r = run_cli_inproc("freeze-ref", "--policy", str(lora), "--out", str(base))
    assert "(--policy's LoRA base" in one_error_line(r)
    assert _tree_sha(base) == base_sha and fingerprints.sha256_file(table) == before


def test_a_second_writer_of_the_same_out_is_refused_naming_the_first(tmp_path, ref_dir):
    out = tmp_path / "s.arrow"
    # the first score-ref claims --out, then waits for its input on a pipe we keep open
    first = subprocess.Popen([*rlkit_cmd(), "score-ref", "--ref", str(ref_dir), "--out", str(out)],
                             stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    lock = tmp_path / ".s.arrow.lock"
    deadline = time.time() + 60
    while time.time() < deadline and not (lock.exists() and lock.read_text().strip()):
        time.sleep(0.05)
    r = run_cli_inproc("score-ref", "--ref", str(ref_dir), "--in", "whatever.arrow", "--out", str(out))
    line = one_error_line(r)
    assert r.returncode == 75 and f"(pid {first.pid})" in line and "being written by another" in line
    first.communicate(input=b"", timeout=60)  # nothing arrives: the first fails in one line, lets go of --out
    assert first.returncode == 2 and os.listdir(tmp_path) == []


def test_the_lock_is_kernel_held_and_reentrant(tmp_path):
    out = tmp_path / "o"
    with claims.claim_out(out, "model"), claims.claim_out(out, "model"):  # one process: re-entrant
        assert (tmp_path / ".o.lock").read_text().strip() == str(os.getpid())
        code = ("import sys\nfrom pathlib import Path\nfrom rlkit.io import claims\nfrom rlkit.errors import RlkitError\n"
                f"try:\n    claims._lock(Path({str(out)!r}))\nexcept RlkitError as e:\n    print(e)\n")
        r = subprocess.run([rlkit_cmd()[0], "-c", code], capture_output=True, text=True, timeout=60)
        assert f"(pid {os.getpid()})" in r.stdout
    assert os.listdir(tmp_path) == []  # released and removed
    # a holder killed with SIGKILL leaves the file, never the lock
    p = subprocess.Popen([rlkit_cmd()[0], "-c", "from pathlib import Path\nfrom rlkit.io import claims\n"
                          f"claims._lock(Path({str(out)!r}))\nimport time\nprint('held', flush=True)\n"
                          "time.sleep(600)"], stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"held"
    p.kill()
    p.wait()
    with claims.claim_out(out, "model"):
        pass


def test_a_tampered_policy_or_reward_model_is_refused_unless_no_verify(tmp_path, sft_dir):
    pol = tmp_path / "pol"
    shutil.copytree(sft_dir, pol)
    _flip_last_byte(pol / "model.safetensors")
    line = one_error_line(run_cli_inproc("eval", "--policy", str(pol), "--num-prompts", "2"))
    assert f"policy {pol} fails its hash check (sha256 mismatch in model.safetensors)" in line
    r = run_cli_inproc("rollout", "--policy", str(pol), "--num-prompts", "2", "--n", "1", "--engine", "hf",
                       "--out", str(tmp_path / "r.arrow"))
    assert "fails its hash check" in one_error_line(r) and not (tmp_path / "r.arrow").exists()
    r = run_cli("eval", "--policy", str(pol), "--num-prompts", "2", "--no-verify")
    assert r.returncode == 0, r.stderr.decode()


def test_verification_reads_each_file_version_once(tmp_path, sft_dir, monkeypatch):
    monkeypatch.setenv("RLKIT_CACHE_DIR", str(tmp_path / "cache"))
    pol = tmp_path / "pol"
    shutil.copytree(sft_dir, pol)
    reads = []
    real = fingerprints.sha256_file
    monkeypatch.setattr(checkpoints, "sha256_file", lambda f: reads.append(f) or real(f))
    checkpoints.check_model_dir(pol, "policy")
    assert len(reads) == 1
    checkpoints.check_model_dir(pol, "policy")
    assert len(reads) == 1  # this process: memory
    fingerprints._FACTS.clear()
    checkpoints.check_model_dir(pol, "policy")
    assert len(reads) == 1  # another process: the cache directory
    entry = json.loads(next((tmp_path / "cache" / "files").iterdir()).read_text())
    assert entry["sha256"] == real(pol / "model.safetensors") and entry["nonfinite"] is None
    # rewriting the file (same bytes, restored mtime) is a new version: read again
    st = (pol / "model.safetensors").stat()
    data = (pol / "model.safetensors").read_bytes()
    (pol / "model.safetensors").write_bytes(data)
    os.utime(pol / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    checkpoints.check_model_dir(pol, "policy")
    assert len(reads) == 2
    _flip_last_byte(pol / "model.safetensors")
    with pytest.raises(RlkitError, match="fails its hash check"):
        checkpoints.check_model_dir(pol, "policy")


def _resave(d: Path, edit) -> None:
    """Edit a checkpoint's tensors and record the new hashes, as if rlkit had saved them."""
    from safetensors.torch import load_file, save_file

    f = d / "model.safetensors"
    sd = load_file(f)
    edit(sd)
    save_file(sd, f, metadata={"format": "pt"})
    m = json.loads((d / "rlkit.json").read_text())
    m["weights_sha256"], m["weights_digest"] = checkpoints.hash_weights(d)
    (d / "rlkit.json").write_text(json.dumps(m))


def test_damaged_checkpoints_are_one_line_each(tmp_path, sft_dir):
    def copy(name: str) -> Path:
        shutil.copytree(sft_dir, tmp_path / name)
        return tmp_path / name

    nan = copy("nan")
    _resave(nan, lambda sd: sd[sorted(sd)[2]].view(-1).__setitem__(0, float("nan")))
    line = one_error_line(run_cli_inproc("eval", "--policy", str(nan), "--num-prompts", "2"))
    assert "holds NaN or inf values" in line and "model.safetensors" in line
    line = one_error_line(run_cli_inproc("eval", "--policy", str(nan), "--num-prompts", "2", "--no-verify"))
    assert "holds NaN or inf values" in line  # found once loaded, before any sampling
    notok = copy("notok")
    for f in notok.glob("tokenizer*"):
        f.unlink()
    assert "has no tokenizer files" in one_error_line(run_cli_inproc("eval", "--policy", str(notok), "--num-prompts", "2"))
    hdr = copy("hdr")
    with open(hdr / "model.safetensors", "r+b") as fh:
        fh.seek(9)
        fh.write(b"\xff\xfe")
    line = one_error_line(run_cli_inproc("eval", "--policy", str(hdr), "--num-prompts", "2", "--no-verify"))
    assert "is not a valid safetensors file" in line and str(hdr / "model.safetensors") in line
    cut = copy("cut")
    with open(cut / "model.safetensors", "r+b") as fh:
        fh.truncate(cut.joinpath("model.safetensors").stat().st_size - 100)
    line = one_error_line(run_cli_inproc("eval", "--policy", str(cut), "--num-prompts", "2", "--no-verify"))
    assert "truncated" in line
    manifest = copy("manifest")
    (manifest / "rlkit.json").write_text("{not json")
    assert "rlkit.json is not valid JSON" in one_error_line(run_cli_inproc("eval", "--policy", str(manifest), "--num-prompts", "2"))


def test_random_bytes_as_a_table_name_the_file(tmp_path, sft_dir):
    bad = tmp_path / "rand.arrow"
    bad.write_bytes(os.urandom(5000))
    line = one_error_line(run_cli_inproc("update", "--policy", str(sft_dir), "--in", str(bad), "--out", str(tmp_path / "u")))
    assert f"{bad} is not an Arrow IPC stream table" in line
    assert sorted(os.listdir(tmp_path)) == ["rand.arrow"]


def test_inspect_verify_fails_on_a_mismatch_whatever_the_other_flags(tmp_path, sft_dir):
    pol = tmp_path / "pol"
    shutil.copytree(sft_dir, pol)
    assert run_cli_inproc("inspect", str(pol), "--verify").returncode == 0
    assert run_cli_inproc("inspect", str(pol), "--verify", "--check").returncode == 0
    _flip_last_byte(pol / "model.safetensors")
    for extra in ([], ["--json"], ["--check"]):
        r = run_cli_inproc("inspect", str(pol), "--verify", *extra)
        assert r.returncode == 2, (extra, r.stderr.decode())
        assert "fails its hash check: sha256 mismatch in model.safetensors" in r.stderr.decode().splitlines()[-1]


def _immutable(d: Path) -> bool:
    """Make `d` immutable (`chattr +i`: even root cannot create entries in it); False where unsupported."""
    r = subprocess.run(["chattr", "+i", str(d)], capture_output=True)
    return r.returncode == 0


def test_an_unwritable_out_is_found_before_any_work(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
    elif not _immutable(ro):
        pytest.skip("running as root on a file system without chattr +i: no way to make a read-only folder here")
    try:
        t0 = time.time()
        for out in (ro / "ckpt", ro / "a" / "b" / "ckpt"):
            r = run_cli_inproc("sft", "--out", str(out), "--num-examples", "100000")
            line = one_error_line(r)
            assert r.returncode == 74 and f"cannot write --out {out}" in line
        assert time.time() - t0 < 60  # refused at start, not after 100k examples of training
        assert os.listdir(ro) == []
        # under a file instead of a folder
        (tmp_path / "f").write_text("x")
        r = run_cli_inproc("prompts", "--num-prompts", "3", "--out", str(tmp_path / "f" / "p.arrow"))
        assert r.returncode == 74 and "cannot write --out" in one_error_line(r)
    finally:
        subprocess.run(["chattr", "-i", str(ro)], capture_output=True)
        ro.chmod(0o755)


def test_a_write_past_the_file_size_limit_is_one_line_and_leaves_nothing(tmp_path, sft_dir):
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # ulimit -f: the weights do not fit

    out = tmp_path / "ref"
    p = subprocess.run([*rlkit_cmd(), "freeze-ref", "--policy", str(sft_dir), "--out", str(out)],
                       capture_output=True, preexec_fn=limit, timeout=300)
    line = one_error_line(p)
    assert p.returncode == 74 and "file too large" in line and f"--out {out}" in line
    assert os.listdir(tmp_path) == []
    t = tmp_path / "p.arrow"
    p = subprocess.run([*rlkit_cmd(), "prompts", "--num-prompts", "50000", "--out", str(t)],
                       capture_output=True, preexec_fn=limit, timeout=300)
    assert p.returncode == 74 and "file too large" in one_error_line(p) and os.listdir(tmp_path) == []


def test_leftovers_of_killed_writers_are_cleaned_and_a_half_swap_restored(tmp_path, sft_dir):
    out = tmp_path / "ref"
    dead = 2**22 + 12345  # above pid_max's default: no such process
    (tmp_path / f".ref.tmp-{dead}-abcdef").mkdir()
    (tmp_path / f".ref.tmp-{dead}-abcdef" / "model.safetensors").write_bytes(b"half")
    (tmp_path / f".other.tmp-{dead}-abcdef").write_bytes(b"not ours")  # another --out's: left alone
    (tmp_path / f".ref.tmp-{os.getpid()}-abcdef").write_bytes(b"a live writer's")  # pid alive: left alone
    r = run_cli("freeze-ref", "--policy", str(sft_dir), "--out", str(out))
    assert r.returncode == 0, r.stderr.decode()
    assert sorted(os.listdir(tmp_path)) == [f".other.tmp-{dead}-abcdef", f".ref.tmp-{os.getpid()}-abcdef", "ref"]
    # killed between the two renames of a swap (where no atomic exchange exists): the old directory is
    # hidden and --out is missing; the next run puts it back before anything else
    before = _tree_sha(out)
    os.rename(out, tmp_path / f".ref.old-{dead}-0a0b0c")
    with claims.claim_out(out, "model"):
        assert _tree_sha(out) == before
    assert not (tmp_path / f".ref.old-{dead}-0a0b0c").exists()


def test_a_directory_swap_is_one_atomic_exchange(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("new")
    (b / "x").write_text("old")
    if not atomic._exchange(a, b):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this file system: the two-rename fallback is used")
    assert (b / "x").read_text() == "new" and (a / "x").read_text() == "old"
    with atomic.atomic_dir(b) as tmp:
        (tmp / "x").write_text("newer")
    assert (b / "x").read_text() == "newer" and sorted(os.listdir(tmp_path)) == ["a", "b"]
