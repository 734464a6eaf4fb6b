"""Experiment trackers: `--report-to trackio,wandb,mlflow,tensorboard` on sft, train-rm, update and eval.

A tracker gets exactly the rows `--metrics` gets, under the same step numbers: each row's finite numbers
as `<stage>/<key>` (`update/reward_mean`, `eval/accuracy`, `sft/train_loss`) at the row's `step` (the
policy step: 0 for sft and train-rm, N for the checkpoint `update` writes, the evaluated policy's step
for eval), and the stage's resolved configuration once, under the stage's name. Per-step training rows
(`sft --logging-steps`) go to the trackers under `<stage>/train/<key>` with their own step counter.

A pipeline is many processes (one `update` per round, `eval` between rounds), and a run is named, not
held open: every process that names the same `--run-name` in the same `--project` adds to one run
(wandb: a run id derived from the name, resumed; MLflow: the run of that name in the experiment
`--project`; trackio: `resume="allow"`; TensorBoard: one log directory). Without `--run-name`, `update`
and `eval` continue the run recorded in their `--policy`'s manifest (the run that trained it), and
`sft`/`train-rm` start a new one named `<stage>-<date>-<time>`. Each tracker's step axis is per stage
(`wandb.define_metric("update/*", step_metric="update/step")`), so rows of different stages and reruns
of a round never clash with wandb's rule that its own step only grows.

Trackers are optional extras (`pip install 'rlkit[track]'`, or one of `rlkit[trackio]`, `[wandb]`,
`[mlflow]`, `[tensorboard]`): asking for one that is not installed is one error line naming the extra,
before any work. A tracker that fails later (its store's disk full, its server gone) is warned about
once and dropped: a tracker never stops training. Nothing a tracker prints reaches stdout, which may be
carrying a table. Where they write is their own configuration: `WANDB_MODE=offline`/`WANDB_DIR`,
`MLFLOW_TRACKING_URI` (default `sqlite:///mlflow.db`), `TRACKIO_DIR`; TensorBoard writes to
`--tensorboard DIR`, default `runs/<project>/<run name>`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError

NAMES = ("trackio", "wandb", "mlflow", "tensorboard")
DEFAULT_PROJECT = "rlkit"
# what `import` must find for each tracker, and the extra that installs it
_NEEDS = {"trackio": ("trackio",), "wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy", "alembic"),
          "tensorboard": ("tensorboard",)}

REPORT_TO_HELP = ("Experiment trackers to log the metrics and the configuration to, comma-separated: "
                  f"{', '.join(NAMES)}, all (those installed) or none. Each is an extra: pip install 'rlkit[track]'. "
                  "See docs/monitoring.md.")
RUN_NAME_HELP = ("The tracker run to log to; processes naming the same run add to it (one run for a whole "
                 "pipeline). Default: update/eval continue the run that trained --policy; sft/train-rm start "
                 "a new '<stage>-<date>-<time>'.")
PROJECT_HELP = "Tracker project (wandb/trackio project, MLflow experiment, TensorBoard folder under runs/)."


@dataclass(frozen=True)
class TrackingConfig:
    report_to: tuple[str, ...] = ()
    project: str = DEFAULT_PROJECT
    run_name: str | None = None  # None: see resolve_name
    tensorboard: Path | None = None  # TensorBoard's log directory (implies tensorboard)

    @property
    def trackers(self) -> tuple[str, ...]:
        names = list(self.report_to)
        if self.tensorboard is not None and "tensorboard" not in names:
            names.append("tensorboard")
        return tuple(names)


def parse_report_to(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """'wandb,tensorboard' (or a list of such) -> ('wandb', 'tensorboard'); 'all' is every installed tracker,
    'none' (or nothing) none. Raises ValueError naming an unknown tracker."""
    if value is None:
        return ()
    parts = [value] if isinstance(value, str) else list(value)
    names: list[str] = []
    for part in parts:
        for name in (n.strip().lower() for n in str(part).split(",")):
            if name in ("", "none"):
                continue
            if name == "all":
                found = [n for n in NAMES if not missing(n)]
                if not found:
                    raise ValueError("all: no tracker is installed; pip install 'rlkit[track]' (or one of "
                                     f"{', '.join(f'rlkit[{n}]' for n in NAMES)})")
                names += found
            elif name not in NAMES:
                raise ValueError(f"unknown tracker {name!r}; expected a comma-separated list of {', '.join(NAMES)}, "
                                 "all or none")
            else:
                names.append(name)
    return tuple(dict.fromkeys(names))


def missing(name: str) -> list[str]:
    """The modules tracker `name` needs that are not installed."""
    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except (ImportError, ValueError):  # an import hook that refuses it, a broken install
            return True

    return [m for m in _NEEDS[name] if absent(m)]


# a run name and a project name folders (runs/PROJECT/RUN_NAME): names, never paths
_NOT_IN_NAME = re.compile(r"[/\\\x00-\x1f\x7f]")
_EVENTS = re.compile(r"^events\.out\.tfevents\.")


def name_problem(value: str) -> str | None:
    """Why `value` cannot be a run or project name (a path, empty, control characters), or None."""
    if not value.strip():
        return "it is empty"
    if value in (".", "..") or _NOT_IN_NAME.search(value):
        return "a name is expected, not a path: no '/' or '\\', not '.' or '..', no control characters"
    if len(value.encode()) > 255:
        return "it is longer than 255 bytes"
    return None


def check_names(cfg: TrackingConfig) -> None:
    """--run-name and --project are names (each tracker's run and project; TensorBoard's folder
    runs/PROJECT/RUN_NAME), never paths: one line, before any work."""
    for flag, value in (("--project", cfg.project), ("--run-name", cfg.run_name)):
        why = None if value is None else name_problem(value)
        if why:
            raise RlkitError(f"{flag} {value!r}: {why} (it names the tracker run and the TensorBoard folder "
                             "runs/PROJECT/RUN_NAME; --tensorboard DIR picks any log directory)")


def tensorboard_dir(cfg: TrackingConfig, run: str) -> Path:
    """TensorBoard's log directory: --tensorboard, else runs/PROJECT/RUN_NAME."""
    return cfg.tensorboard or Path("runs") / cfg.project / run


def check_log_dir(label: str, path: Path) -> None:
    """Refuse a TensorBoard log directory that exists and is not one: a file, a checkpoint, a folder holding
    anything but event files (events.out.tfevents.*). New or empty: fine."""
    if not path.exists():
        return
    if not path.is_dir():
        raise RlkitError(f"{label} {path} exists and is not a directory; expected a TensorBoard log directory (new, "
                         "empty, or holding only event files)")
    if (path / "rlkit.json").is_file():
        raise RlkitError(f"{label} {path} is an rlkit checkpoint, not a TensorBoard log directory; choose another")
    for folder, _, files in os.walk(path):
        for f in files:
            if not _EVENTS.match(f):
                held = Path(folder, f).relative_to(path)
                raise RlkitError(f"{label} {path} holds {held}, which is not a TensorBoard event file; a log directory "
                                 "is new, empty or holds only event files (events.out.tfevents.*): choose another")


def _mlflow_store() -> Path | None:
    """The local file or folder MLflow's tracking URI names (sqlite:///PATH, file:PATH, PATH), else None."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    for scheme in ("sqlite:///", "file://", "file:"):
        if uri.startswith(scheme):
            return Path(uri[len(scheme):]) if uri[len(scheme):] else None
    return None if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", uri) else Path(uri)


def outputs(cfg: TrackingConfig, stage: str, policy: Path | None = None) -> dict[str, tuple[Path, str]]:
    """Where the trackers `cfg` asks for write, for `claims.claim_out(..., side=...)` (flag -> (path, form)):
    TensorBoard's log directory, and the local stores of wandb ($WANDB_DIR/wandb), MLflow (its tracking URI's
    file) and trackio ($TRACKIO_DIR). Checks --run-name and --project first (`check_names`)."""
    check_names(cfg)
    found: dict[str, tuple[Path, str]] = {}
    if "tensorboard" in cfg.trackers:
        found["--tensorboard"] = (tensorboard_dir(cfg, resolve_name(cfg, stage, policy)[0]), "events")
    if "wandb" in cfg.trackers:
        found["WANDB_DIR"] = (Path(os.environ.get("WANDB_DIR") or ".") / "wandb", "store")
    if "mlflow" in cfg.trackers and (store := _mlflow_store()) is not None:
        found["MLFLOW_TRACKING_URI"] = (store, "store")
    if "trackio" in cfg.trackers and os.environ.get("TRACKIO_DIR"):
        found["TRACKIO_DIR"] = (Path(os.environ["TRACKIO_DIR"]), "store")
    return found


def check(cfg: TrackingConfig) -> None:
    """Before any work: every tracker asked for is installed and its output place is usable."""
    check_names(cfg)
    for name in cfg.trackers:
        gone = missing(name)
        if gone:
            raise RlkitError(f"--report-to {name}: {', '.join(gone)} not installed; pip install 'rlkit[{name}]' "
                             f"(or 'rlkit[track]' for every tracker), or leave {name} out")
    if cfg.tensorboard is not None and cfg.tensorboard.exists() and not cfg.tensorboard.is_dir():
        raise RlkitError(f"--tensorboard {cfg.tensorboard}: exists and is not a directory; expected a log directory")


def resolve_name(cfg: TrackingConfig, stage: str, policy: Path | None = None) -> tuple[str, str | None]:
    """(run name, the checkpoint whose run it continues or None): --run-name; else the run recorded in
    `policy`'s manifest (update, eval) when it is in the same project; else a new '<stage>-<date>-<time>'."""
    if cfg.run_name:
        return cfg.run_name, None
    if policy is not None:
        from rlkit.io.checkpoints import load_manifest

        rec = (load_manifest(policy) or {}).get("tracking")
        if (isinstance(rec, dict) and isinstance(rec.get("run_name"), str) and not name_problem(rec["run_name"])
                and rec.get("project") == cfg.project):
            return str(rec["run_name"]), str(policy)
    return f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}", None


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (booleans, strings and the step left out)."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step"}


def flat_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """{'rl': {'lr': 1e-5}} -> {'rl.lr': 1e-5}: a nested configuration as flat keys (MLflow's params)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "."))
        else:
            out[key] = v
    return out


class _Backend:
    """One tracker's calls. `start` once, `log` per row (keys `<axis>/<key>` at `step`), `finish` at the end
    (ok False: the stage failed)."""

    def __init__(self, cfg: TrackingConfig) -> None:
        self.cfg = cfg

    def start(self, project: str, run: str, stage: str, config: dict) -> None: ...
    def log(self, values: dict[str, float], step: int, axis: str) -> None: ...
    def finish(self, ok: bool) -> None: ...


class _Wandb(_Backend):
    def start(self, project, run, stage, config):
        import wandb

        # one id per (project, name): the processes of a pipeline resume the same run
        rid = os.environ.get("WANDB_RUN_ID") or (
            re.sub(r"[^A-Za-z0-9_-]", "-", run)[:48] + "-" + hashlib.sha1(f"{project}/{run}".encode()).hexdigest()[:8])
        self.run = wandb.init(project=project, name=run, id=rid, resume="allow", reinit="finish_previous")
        self.run.config.update({stage: config}, allow_val_change=True)
        self.axes: set[str] = set()

    def log(self, values, step, axis):
        if axis not in self.axes:  # each stage's rows on its own step axis (wandb's own _step only grows)
            self.run.define_metric(f"{axis}/*", step_metric=f"{axis}/step")
            self.axes.add(axis)
        self.run.log({**{f"{axis}/{k}": v for k, v in values.items()}, f"{axis}/step": step})

    def finish(self, ok):
        self.run.finish(exit_code=0 if ok else 1)


class _Mlflow(_Backend):
    def start(self, project, run, stage, config):
        import mlflow

        exp = mlflow.set_experiment(project)
        q = '"' if "'" in run else "'"  # MLflow's filter strings take either quote and no escapes
        found = [] if q in run else mlflow.search_runs(
            [exp.experiment_id], filter_string=f"tags.`mlflow.runName` = {q}{run}{q}", max_results=1,
            order_by=["attributes.start_time DESC"], output_format="list")
        if q in run:  # both quotes in the name: look through the experiment's runs
            found = [r for r in mlflow.search_runs([exp.experiment_id], output_format="list") if r.info.run_name == run]
        active = mlflow.start_run(run_id=found[0].info.run_id) if found else mlflow.start_run(run_name=run)
        have = active.data.params
        # MLflow refuses to change a logged param: a stage's configuration is logged by its first process
        params = {k: str(v)[:6000] for k, v in flat_config({stage: config}).items() if k not in have}
        items = list(params.items())
        for i in range(0, len(items), 100):
            mlflow.log_params(dict(items[i:i + 100]))
        self.mlflow = mlflow

    def log(self, values, step, axis):
        self.mlflow.log_metrics({f"{axis}/{k}": v for k, v in values.items()}, step=step)

    def finish(self, ok):
        self.mlflow.end_run(status="FINISHED" if ok else "FAILED")


class _Trackio(_Backend):
    def start(self, project, run, stage, config):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=project, name=run, config={stage: config}, resume="allow",
                                auto_log_gpu=False, auto_log_cpu=False)

    def log(self, values, step, axis):
        self.trackio.log({**{f"{axis}/{k}": v for k, v in values.items()}, f"{axis}/step": step}, step=step)

    def finish(self, ok):
        self.trackio.finish()


class _TensorBoard(_Backend):
    def start(self, project, run, stage, config):
        import json

        from torch.utils.tensorboard import SummaryWriter

        _quiet_tensorboard_thread()
        if self.cfg.tensorboard is None and (name_problem(project) or name_problem(run)):
            raise ValueError(f"run {run!r} in project {project!r}: not a name, no folder under runs/ is made for it")
        self.logdir = tensorboard_dir(self.cfg, run)
        self.writer = SummaryWriter(log_dir=str(self.logdir))
        self.writer.add_text(f"{stage}/config", "```\n" + json.dumps(config, indent=2) + "\n```")
        self.writer.flush()

    def log(self, values, step, axis):
        for k, v in values.items():
            self.writer.add_scalar(f"{axis}/{k}", v, global_step=step)
        self.writer.flush()

    def finish(self, ok):
        self.writer.close()


# --report-to NAME -> its calls
BACKENDS: dict[str, type[_Backend]] = {"trackio": _Trackio, "wandb": _Wandb, "mlflow": _Mlflow, "tensorboard": _TensorBoard}


def _quiet_tensorboard_thread() -> None:
    """TensorBoard writes events on a thread of its own, which dies on a write error (ENOSPC) and hands the
    error to the next flush; keep `threading` from also printing that thread's traceback."""
    import threading

    hook = threading.excepthook
    if getattr(hook, "rlkit_tensorboard", False):
        return

    def quiet(args):
        if type(args.thread).__name__ != "_AsyncWriterThread":
            hook(args)

    quiet.rlkit_tensorboard = True
    threading.excepthook = quiet


class Tracking:
    """The trackers of one stage run: `start(...)` them once the stage's inputs are known good, `log(row)`
    sends a --metrics row to each, and leaving the `with` block ends them (failed, on an exception). A
    tracker that raises is warned about once and dropped; the stage goes on."""

    def __init__(self) -> None:
        self.stage = ""
        self.cfg = TrackingConfig()
        self.backends: dict[str, _Backend] = {}
        self.run_name: str | None = None

    def start(self, cfg: TrackingConfig, stage: str, config: Any, policy: Path | None = None) -> Tracking:
        """Start the trackers `cfg` names (none: nothing happens), logging `config` (a stage config) once.
        `policy`: the checkpoint whose recorded run update/eval continue (see resolve_name)."""
        from rlkit import console
        from rlkit.io.manifests import jsonable

        self.stage, self.cfg = stage, cfg
        if not cfg.trackers:
            return self
        self.run_name, continued = resolve_name(cfg, stage, policy)
        if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 alone reports
            return self
        if not console.shows_info():  # -q: the trackers' own banners and summaries too
            os.environ.setdefault("WANDB_SILENT", "true")
        conf = jsonable(config)
        conf = {k: v for k, v in conf.items() if k != "tracking"} if isinstance(conf, dict) else {"config": conf}
        for name in cfg.trackers:
            b = BACKENDS[name](cfg)
            if self._call(name, b.start, cfg.project, self.run_name, stage, conf, backend=b):
                self.backends[name] = b
        if self.backends:
            where = f", continuing the run of {continued}" if continued else ""
            console.info(f"{stage}: tracking run {self.run_name!r} in project {cfg.project!r} "
                         f"({', '.join(self.backends)}{where})")
        return self

    def manifest_entry(self) -> dict:
        """{'tracking': {...}} for the output's manifest, so later stages continue the run."""
        if not self.cfg.trackers:
            return {}
        return {"tracking": {"project": self.cfg.project, "run_name": self.run_name, "report_to": list(self.cfg.trackers)}}

    def log(self, row: dict[str, Any], axis: str | None = None) -> None:
        """Send one metrics row (with 'step') to every tracker: keys `<axis>/<key>`, axis = the stage."""
        if not self.backends:
            return
        values = scalars(row)
        step = int(row.get("step", 0))
        for name, b in list(self.backends.items()):
            self._call(name, b.log, values, step, axis or self.stage)

    def close(self, ok: bool = True) -> None:
        for name, b in list(self.backends.items()):
            self._call(name, b.finish, ok)
        self.backends.clear()

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)

    def _call(self, name: str, fn, *args, backend: _Backend | None = None) -> bool:
        """fn(*args) with the tracker's prints kept off stdout; on an error (any exception but an interrupt:
        a tracker's sys.exit() too), one warning and the tracker is dropped."""
        from rlkit import console

        try:
            with open(os.devnull, "w") as null, contextlib.redirect_stdout(sys.stderr if console.shows_info() else null):
                fn(*args)
            return True
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the stage's, not the tracker's
            raise
        except BaseException as e:  # noqa: BLE001 (a tracker never stops training: its SystemExit neither)
            if self.backends.pop(name, None) is not None or backend is not None:
                reason = " ".join(str(e).split())[:300]
                console.warn(f"{self.stage}: tracker {name} failed ({type(e).__name__}: {reason}); "
                             f"the {self.stage} goes on without it")
            return False


def open_tracking(cfg: TrackingConfig, stage: str, config: Any, policy: Path | None = None) -> Tracking:
    """`Tracking().start(...)`: the stage's trackers, started (nothing happens when none is asked for)."""
    return Tracking().start(cfg, stage, config, policy)
