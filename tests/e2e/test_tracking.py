"""Experiment trackers (--report-to), for real and offline: trackio's local store, wandb in offline mode
(read back from its run files), MLflow on a local sqlite store, TensorBoard event files. Each must hold
the rows `--metrics` holds, under the same step numbers, across the processes of a pipeline."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import pytest

from conftest import one_error_line, run_cli, stage

TRACKERS = "trackio,wandb,mlflow,tensorboard"


def _env(root: Path) -> dict:
    """Every tracker's store under `root`, offline."""
    (root / "wandb").mkdir(parents=True, exist_ok=True)
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(root / "wandb"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "TRACKIO_DIR": str(root / "trackio")}


def _tb_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_records(path: Path):
    """The protobuf records of a wandb run file (`run-ID.wandb`): W&B's header, then LevelDB-log blocks of
    32 KiB whose records carry a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and n == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            r = wandb_internal_pb2.Record()
            r.ParseFromString(buf)
            yield r
            buf = b""


def _wandb_history(root: Path) -> tuple[set[str], list[dict], list[dict]]:
    """(run ids, history rows, config updates) of every offline run under `root`."""
    ids, rows, configs = set(), [], []
    for f in sorted(root.glob("wandb/offline-run-*/run-*.wandb")):
        for r in _wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                ids.add(r.run.run_id)
                configs.append({i.key: json.loads(i.value_json) for i in r.run.config.update})
            elif kind == "history":
                # a key with a slash comes back as its parts (nested_key)
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
            elif kind == "config":
                configs.append({i.key: json.loads(i.value_json) for i in r.config.update})
    return ids, rows, configs


def _same(got, want) -> bool:
    """Two (step, value) series: the same steps, the same values to float precision."""
    got = sorted(got)
    return [st for st, _ in got] == [st for st, _ in want] and [v for _, v in got] == pytest.approx([v for _, v in want])


def _series(rows: list[dict], stage: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of `stage`'s `key` in a metrics file's rows."""
    return [(r["step"], float(r[key])) for r in rows if r["stage"] == stage and key in r]


@pytest.mark.slow
def test_drift_grows_and_every_tracker_holds_the_metrics_rows_of_a_pipeline(sft_dir, ref_dir, tmp_path):
    """update -> update -> eval, three processes: the drift from the reference grows and warns once past
    --max-drift; one run 'exp' in each tracker (the later two continue the run their --policy records), the
    --metrics rows under the same keys and steps, the configuration once, and stdout untouched (eval --json
    still parses)."""
    from rlkit.io import checkpoints
    from rlkit.training.drift import model_drift

    assert model_drift(checkpoints.load_policy(sft_dir)[0], ref_dir) == 0.0  # its own bf16 reference: no drift
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "8", "--n", "4", "--out", str(tmp_path / "r.arrow"))
    stage("score-ref", "--ref", str(ref_dir), "--in", str(tmp_path / "r.arrow"), "--out", str(tmp_path / "s.arrow"))
    env, metrics = _env(tmp_path), tmp_path / "m.jsonl"
    common = ["--metrics", str(metrics), "--report-to", TRACKERS, "--project", "proj"]
    up = ["--in", str(tmp_path / "s.arrow"), "--lr", "1e-3"]
    r = run_cli("update", "--policy", str(sft_dir), *up, "--out", str(tmp_path / "u1"), "--run-name", "exp", *common,
                cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert b"POLICY DRIFT" not in r.stderr
    assert "tracking run 'exp' in project 'proj' (trackio, wandb, mlflow, tensorboard)" in r.stderr.decode()
    # the same batch again, off-policy, with a threshold the drift must cross: one loud warning line
    r = run_cli("update", "--policy", str(tmp_path / "u1"), *up, "--out", str(tmp_path / "u2"), "--max-drift", "1e-6",
                *common, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(b"POLICY DRIFT") == 1
    assert f"continuing the run of {tmp_path / 'u1'}" in r.stderr.decode()
    r = run_cli("eval", "--policy", str(tmp_path / "u2"), "--num-prompts", "10", "--json", *common, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step"] == 2  # nothing a tracker printed reached stdout
    assert json.loads((tmp_path / "u2" / "rlkit.json").read_text())["tracking"] == {
        "project": "proj", "run_name": "exp", "report_to": TRACKERS.split(",")}
    r = run_cli("inspect", str(tmp_path / "u2"))
    assert "run 'exp' in project 'proj'" in r.stdout.decode() + r.stderr.decode()

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(x["stage"], x["step"]) for x in rows] == [("update", 1), ("update", 2), ("eval", 2)]
    d1, d2 = rows[0]["drift"], rows[1]["drift"]
    assert 0 < d1 < d2 < 1
    # the figure is what rlkit.training.drift computes from the saved checkpoint (the reference came from score-ref)
    assert d2 == pytest.approx(model_drift(checkpoints.load_policy(tmp_path / "u2")[0], ref_dir), rel=1e-6)
    assert json.loads((tmp_path / "u2" / "rlkit.json").read_text())["metrics"]["drift"] == d2
    want = {"update/reward_mean": _series(rows, "update", "reward_mean"), "update/kl_per_seq": _series(rows, "update", "kl_per_seq"),
            "update/drift": _series(rows, "update", "drift"), "eval/accuracy": _series(rows, "eval", "accuracy")}
    assert all(len(v) == (1 if k.startswith("eval") else 2) for k, v in want.items()), want

    # TensorBoard: runs/<project>/<run name> under the working directory, one event file per process
    tb = _tb_scalars(tmp_path / "runs" / "proj" / "exp")
    for key, series in want.items():
        assert _same(tb[key], series), (key, tb[key], series)

    # MLflow: one run named 'exp' in the experiment 'proj'; metric histories by step; the params once
    import mlflow

    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    runs = mlflow.search_runs(experiment_names=["proj"], output_format="list")
    assert [x.info.run_name for x in runs] == ["exp"]
    client = mlflow.MlflowClient()
    for key, series in want.items():
        hist = [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, key)]
        assert _same(hist, series), (key, hist, series)
    assert runs[0].data.params["update.rl.algo"] == "grpo" and runs[0].data.params["eval.num"] == "10"
    assert runs[0].info.status == "FINISHED"

    # wandb (offline): three processes, one run id; each stage's rows on its own step axis
    ids, hist, configs = _wandb_history(tmp_path / "wandb")
    assert len(ids) == 1 and next(iter(ids)).startswith("exp-")
    for key, series in want.items():
        axis = key.split("/")[0] + "/step"
        assert _same([(h[axis], h[key]) for h in hist if key in h], series), key
    assert any(c.get("update", {}).get("rl", {}).get("algo") == "grpo" for c in configs)

    # trackio: the local store's run 'exp' of project 'proj'
    code = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; "
            "print(json.dumps([S.get_runs('proj'), S.get_logs('proj', 'exp')]))")
    out = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    runs_t, logs = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs_t == ["exp"]
    for key, series in want.items():
        assert _same([(x["step"], x[key]) for x in logs if key in x], series), key


@pytest.mark.slow
def test_sft_and_train_rm_report_their_rows_and_training_curves(tmp_path):
    """sft: the --metrics row at step 0 and a training row every --logging-steps; train-rm the same, in-process."""
    env = _env(tmp_path)
    r = run_cli("sft", "--out", str(tmp_path / "sft"), "--num-examples", "300", "--eval-num", "10", "--report-to",
                "tensorboard,mlflow", "--logging-steps", "2", "--metrics", str(tmp_path / "m.jsonl"), cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    row = json.loads((tmp_path / "m.jsonl").read_text())
    name = json.loads((tmp_path / "sft" / "rlkit.json").read_text())["tracking"]["run_name"]
    assert name.startswith("sft-")  # a new run, named by stage and time
    tb = _tb_scalars(tmp_path / "runs" / "rlkit" / name)
    assert _same(tb["sft/train_loss"], [(0, row["train_loss"])])
    assert _same(tb["sft/heldout_accuracy"], [(0, row["heldout_accuracy"])])
    assert [s for s, _ in tb["sft/train/loss"]] == list(range(2, row["steps"] + 1, 2))
    assert all(v > 0 for _, v in tb["sft/train/lr"])

    stage("build-prefs", "--bias", "length", "--num-prompts", "40", "--eval-fraction", "0.25", "--out",
          str(tmp_path / "p.arrow"))
    stage("train-rm", "--model", str(tmp_path / "sft"), "--prefs", str(tmp_path / "p.arrow"), "--out",
          str(tmp_path / "rm"), "--epochs", "1", "--batch-size", "8", "--tensorboard", str(tmp_path / "tb-rm"),
          "--logging-steps", "1")
    m = json.loads((tmp_path / "rm" / "rlkit.json").read_text())
    tb = _tb_scalars(tmp_path / "tb-rm")
    assert _same(tb["train-rm/heldout_pair_accuracy"], [(0, m["metrics"]["heldout_pair_accuracy"])])
    assert [s for s, _ in tb["train-rm/train/loss"]] == list(range(1, m["metrics"]["optimizer_steps"] + 1))


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 KiB file system (tmpfs), to fill up; skipped where this process may not mount one."""
    from conftest import tmpfs

    with tmpfs(tmp_path / "small", "4k") as d:
        yield d

@pytest.mark.slow
def test_a_tracker_whose_disk_fills_mid_run_warns_once_and_training_finishes(small_disk, tmp_path):
    """TensorBoard's store fills up after some rows: one warning line, the other tracker gets every row,
    the checkpoint and the --metrics row are written, exit 0."""
    env = _env(tmp_path)
    r = run_cli("sft", "--out", str(tmp_path / "sft"), "--num-examples", "1200", "--eval-num", "10", "--report-to",
                "tensorboard,mlflow", "--tensorboard", str(small_disk / "tb"), "--logging-steps", "1", "--run-name",
                "full", "--metrics", str(tmp_path / "m.jsonl"), cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    err = r.stderr.decode()
    warned = [line for line in err.splitlines() if "tracker tensorboard failed" in line]
    assert len(warned) == 1 and "No space left on device" in warned[0], err
    assert "Traceback" not in err
    steps = json.loads((tmp_path / "m.jsonl").read_text())["steps"]
    assert (tmp_path / "sft" / "model.safetensors").is_file()
    written = _tb_scalars(small_disk / "tb").get("sft/train/loss", [])
    assert 0 < len(written) < steps  # it failed mid-run: some rows reached the full disk's file, not all

    import mlflow

    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    run = mlflow.search_runs(experiment_names=["rlkit"], output_format="list")[0]
    hist = mlflow.MlflowClient().get_metric_history(run.info.run_id, "sft/train/loss")
    assert sorted(m.step for m in hist) == list(range(1, steps + 1))


def test_asking_for_a_tracker_that_is_not_installed_is_one_line(tmp_path):
    """wandb hidden from the import system, as where it was never installed: one line naming the extra, exit 1,
    nothing written. An unknown tracker name is a usage error naming --report-to."""
    code = ("import sys, importlib.abc\n"
            "class Gone(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'wandb': raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Gone())\n"
            "from rlkit.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    out = tmp_path / "sft"
    r = subprocess.run([os.sys.executable, "-c", code, "sft", "--out", str(out), "--report-to", "tensorboard,wandb"],
                       capture_output=True, env={**os.environ, "RLKIT_DEBUG": "0"}, cwd=tmp_path)
    line = one_error_line(r)
    assert "--report-to wandb" in line and "pip install 'rlkit[wandb]'" in line
    assert not out.exists()
    r = run_cli("update", "--policy", str(tmp_path), "--out", str(tmp_path / "u"), "--report-to", "wandb,neptune")
    assert r.returncode == 2
    assert "--report-to" in r.stderr.decode() and "unknown tracker 'neptune'" in r.stderr.decode()


def test_report_to_names(monkeypatch):
    from rlkit.io import tracking

    assert set(tracking.BACKENDS) == set(tracking.NAMES)
    assert tracking.parse_report_to(None) == tracking.parse_report_to("none") == ()
    assert tracking.parse_report_to(["wandb", " TensorBoard,wandb "]) == ("wandb", "tensorboard")
    assert tracking.parse_report_to("all") == tracking.NAMES  # the test environment has all four
    with pytest.raises(ValueError, match="unknown tracker 'comet'"):
        tracking.parse_report_to("wandb,comet")
    monkeypatch.setattr(tracking, "missing", lambda name: [name])  # as where none is installed
    with pytest.raises(ValueError, match=r"all: no tracker is installed; pip install 'rlkit\[track\]'"):
        tracking.parse_report_to("all")
