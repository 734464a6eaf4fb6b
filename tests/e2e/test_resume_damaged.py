"""A resume snapshot (`--save-steps`) that is damaged, unreadable or not rlkit's is never used; the kill-and-
resume runs are in tests/e2e/test_resume_training.py. Under `--resume auto` a damaged snapshot is named in one
warning line and deleted, and the run starts from step 0: its weights are the uninterrupted run's, byte for
byte. Under `--resume must` the run stops with one error line (exit 2), nothing at --out, the snapshot as it
was. What rlkit did not make at the snapshot path (a file, a link, a folder of other files) is refused in one
line in every mode and never deleted.

Each case is one in-process run of the real CLI on a 1-layer tiny model and 14 rows (a fraction of a second);
the snapshot they damage is a real one, made once by a run whose last snapshot is kept."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from rlkit.io import fingerprints

SFT = ["sft", "--data", "{w}/d.jsonl", "--batch-tokens", "32", "--layers", "1", "--hidden", "32", "--save-steps", "3"]
RM = ["train-rm", "--model", "{w}/full", "--prefs", "{w}/prefs.jsonl", "--batch-size", "2", "--epochs", "2",
      "--max-length", "16", "--save-steps", "3"]


def _main(w: Path, argv: list[str], capfd) -> tuple[int, list[str]]:
    from rlkit.cli import _main as main

    capfd.readouterr()
    rc = main([a.format(w=w) for a in argv])
    err = capfd.readouterr().err
    assert "Traceback" not in err and "unexpected" not in err, err
    return rc, err.strip().splitlines()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """d.jsonl, prefs.jsonl; full/ and rm-full/ (uninterrupted runs); snap/ and rm-snap/ (the last snapshot of
    the same runs, step 3 of 4 and of 6, kept as a kill right after it would leave it)."""
    from rlkit.cli import _main as main
    from rlkit.training import resume

    w = tmp_path_factory.mktemp("resume-damaged")
    with open(w / "d.jsonl", "w") as f:
        for i in range(14):
            f.write(json.dumps({"prompt": f"{i}+{i}=", "completion": str(2 * i)}) + "\n")
    with open(w / "prefs.jsonl", "w") as f:
        for i in range(10):
            f.write(json.dumps({"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2),
                                "split": "heldout" if i < 2 else "train"}) + "\n")
    for argv, full, kept, snap in ((SFT, "full", "kept", "snap"), (RM, "rm-full", "rm-kept", "rm-snap")):
        argv = [a.format(w=w) for a in argv]
        assert main([*argv, "--out", str(w / full)]) == 0
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(resume.Snapshots, "remove", lambda self: None)  # what a kill after the last save leaves
            assert main([*argv, "--out", str(w / kept)]) == 0
        os.rename(w / f".{kept}.resume", w / snap)
        shutil.rmtree(w / kept)
    assert json.loads((w / "snap" / "resume.json").read_text())["step"] == 3
    return w


def _flip(name: str):
    def damage(s: Path) -> None:
        b = bytearray((s / name).read_bytes())
        b[len(b) * 3 // 4] ^= 0x10
        (s / name).write_bytes(bytes(b))
    return damage


def _truncate(name: str, keep: float):
    def damage(s: Path) -> None:
        b = (s / name).read_bytes()
        (s / name).write_bytes(b[: int(len(b) * keep)])
    return damage


def _edit_step(s: Path) -> None:  # still valid JSON: only the digest tells
    p = s / "resume.json"
    p.write_text(p.read_text().replace('"step": 3', '"step": 2'))


def _unlink(name: str):
    return lambda s: (s / name).unlink()


DAMAGED = [
    pytest.param(_flip("model.safetensors"), "sha256 mismatch in model.safetensors", id="model-byte"),
    pytest.param(_flip("optimizer.safetensors"), "sha256 mismatch in optimizer.safetensors", id="optimizer-byte"),
    pytest.param(_flip("state.json"), "sha256 mismatch in state.json", id="state-byte"),
    pytest.param(_truncate("model.safetensors", 0.5), "sha256 mismatch in model.safetensors", id="model-truncated"),
    pytest.param(_truncate("optimizer.safetensors", 0), "sha256 mismatch in optimizer.safetensors", id="optimizer-empty"),
    pytest.param(_edit_step, "resume.json does not match its digest", id="resume-json-edited"),
    pytest.param(lambda s: (s / "resume.json").write_bytes(os.urandom(64)), "resume.json cannot be read",
                 id="resume-json-garbage"),
    pytest.param(_unlink("resume.json"), "resume.json is missing", id="no-resume-json"),
    pytest.param(_unlink("model.safetensors"), "model.safetensors is missing", id="no-model"),
]


def _case(work: Path, tmp_path: Path, damage, snap: str = "snap") -> tuple[Path, Path]:
    """tmp_path/.out.resume: a copy of the kept snapshot, damaged -> (out, the snapshot path)."""
    out, d = tmp_path / "out", tmp_path / ".out.resume"
    shutil.copytree(work / snap, d)
    damage(d)
    return out, d


def _tree(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): fingerprints.sha256_file(p) if p.is_file() else "dir" for p in sorted(d.rglob("*"))}


def _same_weights(a: Path, b: Path, name: str = "model.safetensors") -> None:
    assert fingerprints.sha256_file(a / name) == fingerprints.sha256_file(b / name), f"{name} differs from {a}"


def _refused(work: Path, tmp_path: Path, argv: list[str], capfd, expect: str) -> str:
    """One `rlkit: error:` line holding `expect`, exit 2, nothing in tmp_path changed (no --out, no leftovers)."""
    before = _tree(tmp_path)
    rc, lines = _main(work, argv, capfd)
    errors = [ln for ln in lines if ln.startswith("rlkit: error:")]
    assert rc == 2 and len(errors) == 1 and expect in errors[0], lines
    assert not any(ln.startswith("warning:") for ln in lines), lines
    assert _tree(tmp_path) == before, "something was written, changed or deleted"
    return errors[0]


@pytest.mark.parametrize("damage,why", DAMAGED)
def test_a_damaged_snapshot_is_discarded_under_auto_and_refused_under_must(work, tmp_path, damage, why, capfd):
    out, d = _case(work, tmp_path, damage)
    line = _refused(work, tmp_path, [*SFT, "--out", str(out), "--resume", "must"], capfd, why)
    assert str(d) in line and "--resume must" in line

    rc, lines = _main(work, [*SFT, "--out", str(out)], capfd)  # --resume auto, the default
    warnings = [ln for ln in lines if ln.startswith("warning:")]
    assert rc == 0 and len(warnings) == 1 and str(d) in warnings[0] and why in warnings[0], lines
    assert "starting from step 0" in warnings[0] and not any("resuming" in ln for ln in lines), lines
    _same_weights(out, work / "full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the snapshot deleted, nothing else left


def test_train_rm_checks_its_snapshot_too(work, tmp_path, capfd):
    out, d = _case(work, tmp_path, _flip("model.safetensors"), "rm-snap")
    _refused(work, tmp_path, [*RM, "--out", str(out), "--resume", "must"], capfd, "sha256 mismatch in model.safetensors")
    rc, lines = _main(work, [*RM, "--out", str(out)], capfd)
    assert rc == 0 and len([ln for ln in lines if ln.startswith("warning:") and str(d) in ln]) == 1, lines
    _same_weights(out, work / "rm-full")
    assert not d.exists()


@pytest.mark.parametrize("mode", ["auto", "must"])
def test_an_intact_snapshot_is_resumed_with_the_uninterrupted_weights(work, tmp_path, mode, capfd):
    out, d = _case(work, tmp_path, lambda s: None)
    rc, lines = _main(work, [*SFT, "--out", str(out), "--resume", mode], capfd)
    assert rc == 0 and f"sft: resuming from step 3 of 4 ({d})" in lines, lines
    assert not any(ln.startswith("warning:") for ln in lines), lines
    _same_weights(out, work / "full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_resume_never_starts_over_and_must_needs_a_snapshot(work, tmp_path, capfd):
    out, d = _case(work, tmp_path, lambda s: None)
    rc, lines = _main(work, [*SFT, "--out", str(out), "--resume", "never"], capfd)
    assert rc == 0 and any("not resuming" in ln and "--resume never" in ln for ln in lines), lines
    _same_weights(out, work / "full")
    assert not d.exists()
    other = tmp_path / "other"
    _refused(work, tmp_path, [*SFT, "--out", str(other), "--resume", "must"], capfd, "there is no resume snapshot")
    _refused(work, tmp_path, [*SFT, "--out", str(other), "--resume", "must", "--save-steps", "0"], capfd,
             "--resume must needs --save-steps")


def _file(s: Path) -> None:
    shutil.rmtree(s)
    s.write_text("my notes\n")


def _link(s: Path) -> None:  # to an intact snapshot: still not something rlkit made here
    real = s.with_name("real-snapshot")
    os.rename(s, real)
    s.symlink_to(real)


STRAY = [
    pytest.param(_file, "is a file", id="regular-file"),
    pytest.param(_link, "is a symbolic link", id="symlink"),
    pytest.param(lambda s: (s / "notes.txt").write_text("mine\n"), "holds notes.txt", id="foreign-file-inside"),
    pytest.param(lambda s: (s / "sub").mkdir(), "holds sub", id="folder-inside"),
]


@pytest.mark.parametrize("stray,why", STRAY)
def test_what_rlkit_did_not_make_at_the_snapshot_path_is_refused_and_kept(work, tmp_path, stray, why, capfd):
    out, d = _case(work, tmp_path, stray)
    for mode in ("auto", "must", "never"):
        line = _refused(work, tmp_path, [*SFT, "--out", str(out), "--resume", mode], capfd, why)
        assert str(d) in line
    # --save-steps 0 does not use the path: the run goes on and leaves it as it is
    before = _tree(tmp_path)
    rc, lines = _main(work, [*SFT, "--out", str(out), "--save-steps", "0"], capfd)
    assert rc == 0, lines
    _same_weights(out, work / "full")
    assert {k: v for k, v in _tree(tmp_path).items() if not k.startswith("out")} == before
