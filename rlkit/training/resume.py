"""Resume snapshots for `sft` and `train-rm` (`--save-steps N`), so a killed run picks up where it was.

Every N optimizer steps the stage saves a snapshot in `.NAME.resume/` beside its `--out NAME` (outside
the directory written atomically at the end, and not a name `claims.clean_leftovers(out)` removes):

    model.safetensors       the trainable parameters by name (LoRA: the adapter and the head)
    optimizer.safetensors   AdamW moments and step per parameter name, the torch CPU RNG, and the
                            CUDA RNG on a GPU (`rlkit.training.engine.trainer_tensors`)
    state.json              optimizer step and loss-scale state (`trainer.save_trainer`)
    resume.json             command, comparable config, input fingerprints, step of total, data
                            position (epoch, batch), LR scheduler, param-group LRs, running figures,
                            the sha256 of each file above, and a digest of itself; written last

No pickle: tensors in safetensors, the rest JSON (floats round-trip exactly). Each save goes to a
temporary sibling swapped in whole (`atomic.atomic_dir`), so a kill during a save leaves the previous
snapshot. On start (`find`), before any weights are read from it, a snapshot is checked: resume.json
against its digest, then its settings, then every file against its sha256 (`fingerprints.sha256_cached`: a
snapshot this machine wrote and nobody touched is not read again). `--resume` says what happens:

    auto    resume an intact snapshot of the same command, settings and inputs; a damaged or unreadable
            one is named in one warning line and deleted, one of other settings named in one warning line
            and replaced at the first save; either way the run starts from step 0
    must    resume one, or stop with one error line (exit 2) leaving everything as it is
    never   start from step 0; a snapshot there is replaced at the first save

Whatever the mode, something at `.NAME.resume` that rlkit did not make (a file, a symbolic link, a
directory holding other files) is refused in one line and never deleted. The snapshot goes once --out is
written. With N = 0 nothing is saved and nothing resumed. Under torchrun rank 0 checks the snapshot and
broadcasts its decision (every rank resumes, or none, or all stop with rank 0's line); every rank calls
`save` (the FSDP shards, AdamW state and each rank's RNG are gathered: collectives) and rank 0 writes;
every rank loads the full weights before sharding (`restore_weights`) and its own RNG (`restore`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError
from rlkit.io import atomic, claims, fingerprints, manifests

FORMAT = 2  # 2: resume.json holds the sha256 of every file and a digest of itself
MODES = ("auto", "must", "never")  # --resume
FILES = ("model.safetensors", "optimizer.safetensors", "state.json")  # hashed in resume.json, written last
ALL_FILES = (*FILES, "resume.json")
# Config fields that do not change the weights (a rerun's, and the metrics file): a snapshot made with other
# values of these is resumed.
NOT_COMPARED = (*manifests.NOT_COMPARED, "metrics")


def snapshot_dir(out: Path) -> Path:
    """`.NAME.resume` beside `--out NAME`."""
    return out.parent / f".{out.name}.resume"


def check(save_steps: int, mode: str = "auto", out: Path | None = None) -> None:
    """One error line for a --save-steps or --resume this run cannot honour, or (given `out`) something at
    the snapshot path that rlkit did not make: before any work."""
    if save_steps < 0:
        raise RlkitError(f"--save-steps {save_steps}: must be >= 0 (0: no resume snapshots)")
    if mode not in MODES:
        raise RlkitError(f"--resume {mode}: expected one of {', '.join(MODES)}")
    if mode == "must" and save_steps == 0:
        raise RlkitError("--resume must needs --save-steps N > 0 (with --save-steps 0 nothing is saved or resumed): "
                         "give the --save-steps of the run to resume")
    if out is not None and save_steps > 0:
        refuse_stray(snapshot_dir(out), out)


def not_ours(d: Path) -> str | None:
    """Why what is at snapshot path `d` is not something rlkit made there (a file, a symbolic link, a directory
    holding other files or unreadable); None when there is nothing or a snapshot directory, intact or not."""
    if d.is_symlink():
        return f"is a symbolic link (to {os.readlink(d)})"
    if not d.exists():
        return None
    if not d.is_dir():
        return "is a file, not a snapshot directory"
    try:
        entries = list(os.scandir(d))
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    other = sorted(e.name for e in entries if e.name not in ALL_FILES or not e.is_file(follow_symlinks=False))
    if other:
        return f"holds {', '.join(other[:3])}{', ...' if len(other) > 3 else ''}, which rlkit does not write there"
    return None


def refuse_stray(d: Path, out: Path) -> None:
    """One error line when what is at snapshot path `d` is not rlkit's: it is never used, replaced or deleted."""
    why = not_ours(d)
    if why:
        raise RlkitError(f"{d} is where the resume snapshot of --out {out} goes, but it {why}; rlkit deletes only "
                         "what it made: move it away or delete it (or pass --save-steps 0)")


def _digest(state: dict) -> str:
    """A digest of resume.json's content less its own `digest` entry (a changed byte that still parses shows)."""
    rest = {k: v for k, v in state.items() if k != "digest"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def seal(state: dict, d: Path) -> dict:
    """`state` (resume.json's content) with the sha256 of the snapshot files in `d` and its own digest: what
    `find` checks. The hashes are cached by file version (`fingerprints.sha256_cached`), and a file keeps its
    version through the rename of its directory, so `find` reads again only what was touched (or copied)."""
    state = {**state, "files": {name: fingerprints.sha256_cached(d / name) for name in FILES}}
    return {**state, "digest": _digest(state)}


def _read(d: Path) -> tuple[dict | None, str | None]:
    """(resume.json's content, why the snapshot is damaged or None). A snapshot of another format is not
    called damaged here (`_mismatch` names it)."""
    try:
        state = json.loads((d / "resume.json").read_text())
    except FileNotFoundError:
        return None, "resume.json is missing"
    except (OSError, ValueError) as e:
        return None, f"resume.json cannot be read: {getattr(e, 'strerror', None) or e}"
    if not isinstance(state, dict):
        return None, "resume.json is not a JSON object"
    if state.get("format") == FORMAT and state.get("digest") != _digest(state):
        return state, "resume.json does not match its digest"
    return state, None


def _verify(d: Path, state: dict) -> str | None:
    """Why the snapshot's files are not the ones resume.json records (sha256), or None."""
    want = state.get("files")
    if not isinstance(want, dict) or sorted(want) != sorted(FILES):
        return "resume.json does not list the sha256 of its files"
    bad = []
    for name in FILES:
        try:
            if fingerprints.sha256_cached(d / name) != want[name]:
                bad.append(name)
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} cannot be read: {e.strerror or e}"
    return f"sha256 mismatch in {', '.join(bad)}" if bad else None


def comparable(config: Any) -> dict:
    """The resolved config as JSON, less the fields that do not change the result."""
    from rlkit.io.manifests import jsonable

    cfg = jsonable(config)
    return {k: v for k, v in cfg.items() if k not in NOT_COMPARED} if isinstance(cfg, dict) else cfg


def rng_to_json(state: tuple) -> list:
    """A `random.Random.getstate()` as JSON."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def rng_from_json(j: list) -> tuple:
    """What `rng_to_json` wrote, for `random.Random.setstate`."""
    return j[0], tuple(j[1]), j[2]


@dataclass(frozen=True)
class Snapshot:
    """A snapshot found on disk that matches this run: its directory and its resume.json."""

    dir: Path
    state: dict

    @property
    def step(self) -> int:
        return int(self.state["step"])


def gather(t, dp) -> list:
    """[t of rank 0, t of rank 1, ...] on the host (a tensor of one shape on every rank; an all-gather under
    torchrun, no pickle); [t] in one process."""
    if dp is None:
        return [t.cpu()]
    import torch
    import torch.distributed as dist

    t = t.to(dp.device)
    out = [torch.empty_like(t) for _ in range(dp.world)]
    dist.all_gather(out, t)
    return [x.cpu() for x in out]


def tracking_of(tracking, snap: Snapshot | None):
    """The stage's TrackingConfig, with the tracker run of the run it resumes when no --run-name is given
    (a resumed run goes on logging into the run it started)."""
    from dataclasses import replace

    name = (snap.state.get("figures") or {}).get("run_name") if snap is not None else None
    return replace(tracking, run_name=name) if name and not tracking.run_name else tracking


@dataclass(frozen=True)
class Snapshots:
    """The resume snapshots of one stage's run: `find` on start, `save` every `every` steps, `remove` at the end.

        snaps = Snapshots("sft", cfg.out, cfg, inputs, cfg.save_steps)
        snap = snaps.find(total)                        # one info line when a snapshot exists
        if snap: got = snaps.restore(snap, model, opt, prec, sched=sched, device=dev)
        ...  if snaps.due(step): snaps.save(step, total, model, opt, prec, position={...}, figures={...})
        snaps.remove()                                  # once --out is written
    """

    stage: str
    out: Path
    config: Any
    inputs: Mapping[str, str]
    every: int = 0
    dp: Any = None  # rlkit.training.distributed.DataParallel under torchrun: saves gather, rank 0 writes
    mode: str = "auto"  # --resume: auto, must or never (see the module's docstring)

    @property
    def dir(self) -> Path:
        return snapshot_dir(self.out)

    def find(self, total: int) -> Snapshot | None:
        """The snapshot to resume from (saying so in one line), else None, after checking it (see the module's
        docstring): none there, --save-steps 0, --resume never, or under --resume auto one that is damaged (said
        in one warning line; deleted) or made with other settings or inputs (said in one warning line; replaced
        at the first save). Raises one error line for a --resume must it cannot honour and for a path that is
        not rlkit's. Under torchrun rank 0 decides and every rank gets its decision (or its error)."""
        if self.dp is None:
            return self._decide(total)
        from rlkit.training import distributed

        if not self.dp.main:
            msg = json.loads(distributed.broadcast_bytes(None, self.dp))
            if "error" in msg:
                e = RlkitError(msg["error"])
                e.exit_code = msg["exit_code"]
                raise e
            return Snapshot(self.dir, msg["state"]) if msg["state"] is not None else None
        try:
            snap = self._decide(total)
        except Exception as e:  # the other ranks wait for a decision: they stop with the same line and code
            line = str(e) if isinstance(e, RlkitError) else f"checking the snapshot in {self.dir} failed on rank 0"
            distributed.broadcast_bytes(json.dumps({"error": line, "exit_code": getattr(e, "exit_code", 1)}).encode(),
                                        self.dp)
            raise
        distributed.broadcast_bytes(json.dumps({"state": snap.state if snap else None}).encode(), self.dp)
        return snap

    def _decide(self, total: int) -> Snapshot | None:
        from rlkit import console

        d, name = self.dir, self.stage
        claims.clean_leftovers(d)  # the temporary directory of a save that was killed
        if self.every <= 0:
            if d.is_dir() and not_ours(d) is None:
                console.info(f"{name}: not resuming from {d} (--save-steps 0); it is removed once --out is written")
            return None
        refuse_stray(d, self.out)
        if not d.exists():
            if self.mode == "must":
                raise RlkitError(f"--resume must: there is no resume snapshot {d} of --out {self.out} (a run with "
                                 "--save-steps leaves one when it is stopped after a save); rerun without --resume "
                                 "must to start from step 0")
            return None
        if self.mode == "never":
            console.info(f"{name}: not resuming from {d} (--resume never); it is replaced at the first save")
            return None
        state, damage = _read(d)
        why = self._mismatch(state, total) if damage is None else None
        if damage is None and why is None:
            damage = _verify(d, state)  # the expensive check last: only a snapshot that would be used is read
        if damage is None and why is None:
            console.info(f"{name}: resuming from step {state['step']} of {total} ({d})")
            return Snapshot(d, state)
        what = f"is damaged ({damage})" if damage else f"was made with other {why}"
        if self.mode == "must":
            raise RlkitError(f"--resume must: the snapshot in {d} {what}; it is left as it is (rerun with --resume "
                             "auto to discard it and start from step 0)")
        if damage:
            shutil.rmtree(d, ignore_errors=True)
            console.warn(f"{name}: the snapshot in {d} {what}: deleted, starting from step 0")
        else:
            console.warn(f"{name}: the snapshot in {d} {what}; starting from step 0 (it is replaced at the first save)")
        return None

    def _mismatch(self, state: dict, total: int) -> str | None:
        if state.get("format") != FORMAT or state.get("command") != self.stage:
            return f"command or format ({state.get('command')!r}, format {state.get('format')!r})"
        have, want = state.get("config") or {}, comparable(self.config)
        differ = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
        if differ:
            return f"settings ({', '.join(differ)})"
        ours = dict(self.inputs)
        differ = sorted(k for k in set(state.get("inputs") or {}) | set(ours) if (state.get("inputs") or {}).get(k) != ours.get(k))
        if differ:
            return f"inputs ({', '.join(differ)})"
        if state.get("total") != total or not 0 < int(state.get("step", 0)) <= total:
            return f"plan (step {state.get('step')} of {state.get('total')}, this run has {total} steps)"
        return None

    def due(self, step: int) -> bool:
        """True when a snapshot is to be saved after optimizer step `step` (counted from 1)."""
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, total: int, model, opt, prec, *, position: dict, figures: dict, per_rank: dict | None = None,
             sched=None, device=None) -> None:
        """Snapshot after `step` of `total` optimizer steps. `position`: where the data is (epoch, batch: the
        next one to train, ...); `figures`: the running numbers the stage goes on from (JSON; rank 0's under
        torchrun, where they must be the same on every rank); `per_rank`: running numbers that differ by rank
        (a rank's token count), kept for each. `sched`: a torch LR scheduler whose position is saved;
        `device`: the CUDA RNG is saved on a GPU. Under torchrun every rank calls it (the weights, AdamW state
        and RNGs are gathered: collectives) and rank 0 writes."""
        import torch
        from safetensors.torch import save_file

        from rlkit.training.engine import TrainerState, save_trainer, trainer_tensors

        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        if self.dp is None:
            weights = {name: p.detach().cpu().contiguous() for name, p in model.named_parameters() if p.requires_grad}
        else:  # the full tensors, gathered from the shards (on rank 0)
            from rlkit.training.distributed import full_model_state

            full = full_model_state(model)
            weights = {name: full[name].contiguous() for name in trainable if name in full}
        tensors = trainer_tensors(model, opt, self.dp)
        cuda = device is not None and getattr(device, "type", str(device)) == "cuda"
        rngs = {"rng/rank{}": torch.get_rng_state(), **({"rng/cuda/rank{}": torch.cuda.get_rng_state(device)} if cuda else {})}
        ranks = {k: gather(v, self.dp) for k, v in rngs.items()}
        per = {k: [float(x) for x in gather(torch.tensor([float(v)], dtype=torch.float64), self.dp)]
               for k, v in (per_rank or {}).items()}
        if self.dp is not None and not self.dp.main:
            from rlkit.training import distributed

            distributed.barrier(self.dp)
            return
        for k, ts in ranks.items():
            tensors.update({k.format(r): t for r, t in enumerate(ts)})
        state = {
            "format": FORMAT, "command": self.stage, "config": comparable(self.config), "inputs": dict(self.inputs),
            "step": step, "total": total, "position": position, "figures": figures, "per_rank": per,
            "world_size": 1 if self.dp is None else self.dp.world,
            "lr": [g["lr"] for g in opt.param_groups],
            "scheduler": {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"} if sched is not None else None,
            "skipped_steps": prec.skipped,
        }
        json.dumps(state, allow_nan=False)  # before any write: a value JSON cannot hold fails here
        with atomic.atomic_dir(self.dir) as tmp:
            save_file(weights, str(tmp / "model.safetensors"))
            save_trainer(model, opt, TrainerState(optimizer_step=step, precision=prec.state()), tmp, tensors)
            sealed = seal(state, tmp)
            (tmp / "resume.json").write_text(json.dumps(sealed, allow_nan=False) + "\n")  # last: it vouches for the rest
        if self.dp is not None:
            from rlkit.training import distributed

            distributed.barrier(self.dp)

    def restore_weights(self, snap: Snapshot, model) -> None:
        """The snapshot's trainable weights into `model`, before it is sharded or moved (every rank loads them)."""
        import torch
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            weights = load_file(str(snap.dir / "model.safetensors"))
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.requires_grad:
                        p.copy_(weights.pop(name))
            if weights:
                raise KeyError(f"{len(weights)} tensors the model does not train, e.g. {next(iter(weights))}")
        except (OSError, KeyError, RuntimeError, ValueError, SafetensorError) as e:
            raise RlkitError(f"the snapshot in {snap.dir} does not fit this run ({e}); delete it to start from "
                             "step 0") from None

    def restore(self, snap: Snapshot, model, opt, prec, *, sched=None, device=None) -> dict:
        """Put the snapshot's AdamW state, torch (and CUDA) RNG of this rank, loss scale, param-group LRs and
        scheduler position into this run's freshly built objects (the weights: `restore_weights`, first);
        -> {"step", **position, **figures, **this rank's per-rank figures}. A run resumed at another world size
        gives rank 0 the sum of the per-rank figures and the others 0 (their total stays right)."""
        import torch
        from safetensors import SafetensorError, safe_open

        from rlkit.training.engine import load_trainer

        rank, world = (0, 1) if self.dp is None else (self.dp.rank, self.dp.world)
        cuda = device is not None and getattr(device, "type", str(device)) == "cuda"
        try:
            ts = load_trainer(model, opt, snap.dir, self.dp)
            with safe_open(str(snap.dir / "optimizer.safetensors"), framework="pt") as f:
                keys = set(f.keys())  # this rank's RNG where the snapshot has one (load_trainer set rank 0's)
                if f"rng/rank{rank}" in keys:
                    torch.set_rng_state(f.get_tensor(f"rng/rank{rank}"))
                if cuda and f"rng/cuda/rank{rank}" in keys:
                    torch.cuda.set_rng_state(f.get_tensor(f"rng/cuda/rank{rank}"), device)
        except (OSError, KeyError, RuntimeError, ValueError, SafetensorError) as e:
            raise RlkitError(f"the snapshot in {snap.dir} does not fit this run ({e}); delete it to start from "
                             "step 0") from None
        prec.load_state(ts.precision)
        prec.skipped = int(snap.state.get("skipped_steps", 0))
        for g, lr in zip(opt.param_groups, snap.state["lr"], strict=True):
            g["lr"] = lr
        if sched is not None:
            sched.load_state_dict({**snap.state["scheduler"], "lr_lambdas": [None] * len(opt.param_groups)})
        per = snap.state.get("per_rank") or {}
        if snap.state.get("world_size", 1) == world:
            mine = {k: v[rank] for k, v in per.items()}
        else:
            mine = {k: (sum(v) if rank == 0 else 0) for k, v in per.items()}
        return {"step": snap.step, **snap.state["position"], **snap.state["figures"], **mine}

    def remove(self) -> None:
        """Drop the snapshot (the run's --out is written); what rlkit did not make there stays."""
        if self.dir.is_dir() and not_ours(self.dir) is None:
            shutil.rmtree(self.dir, ignore_errors=True)
