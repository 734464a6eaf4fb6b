"""`update --follow`'s resume snapshots: what a run needs to go on exactly where it was, kept apart from the steps the
workers load (`rlkit.io.follow`: weights only).

Every `--snapshot-every K` steps (and at a clean end) the update writes, before it publishes that step,
`DIR/snapshots/snapshot-NNNNNN/`::

    .metadata, __R_0.distcp   the policy's fp32 weights and AdamW state in torch's distributed checkpoint format
                              (`torch.distributed.checkpoint`): every rank writes its own shards at once, nothing is
                              gathered; read back at any world size
    rng-rankR.safetensors     each rank's torch RNG
    extra/                    the algorithm's own models (PPO's critic and its optimizer), as a checkpoint writes them
    resume.json               the step, the trainer's counters and loss scale, the step's manifest and metrics row,
                              the world size, the sha256 of every file above and a digest of itself; written last

It is written under a hidden name (`.snapshot-NNNNNN.tmp`) and renamed into place once resume.json is fsynced, so
a kill leaves either the whole snapshot or a hidden leftover (removed at the next start). Before a snapshot is used,
resume.json is checked against its digest and every file against its sha256 (`fingerprints.sha256_cached`: the
files a machine wrote are not read again there). No pickle: tensors in safetensors and DCP's tensor files, the rest
JSON.

A run resumes from its newest snapshot S: it loads the weights and the optimizer, publishes step S if it is not
(a kill between the two writes), and trains the steps after S again from the batch files each one's manifest names
(the spool keeps them in claimed/ until a snapshot covers them: `rlkit.follow.source`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlkit.errors import RlkitError

ROOT = "snapshots"
FORMAT = 1
NAME_RE = re.compile(r"^snapshot-(\d{6,})$")
STATE = "resume.json"
EXTRA = "extra"
# a snapshot every K steps when the input is a spool (whose batch files are read again on resume); a stream cannot
# be read again, so then every step
DEFAULT_EVERY = 10


def name(step: int) -> str:
    return f"snapshot-{step:06d}"


@dataclass(frozen=True)
class Snapshot:
    step: int
    path: Path
    state: dict


def scan(root: Path) -> list[tuple[int, Path]]:
    """The complete snapshots in DIR/snapshots (with resume.json), oldest first."""
    d = root / ROOT
    try:
        entries = list(os.scandir(d))
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        m = NAME_RE.match(e.name)
        if m and e.is_dir(follow_symlinks=False) and os.path.isfile(os.path.join(e.path, STATE)):
            out.append((int(m.group(1)), Path(e.path)))
    return sorted(out)


def clean_stale(root: Path) -> list[str]:
    """Remove the hidden leftovers of a killed save or prune (with DIR's lock held); their names."""
    d = root / ROOT
    gone = []
    for e in list(os.scandir(d)) if d.is_dir() else []:
        if e.name.startswith(".snapshot-"):
            shutil.rmtree(e.path, ignore_errors=True)
            gone.append(e.name)
    return gone


def _digest(state: dict) -> str:
    rest = {k: v for k, v in state.items() if k != "digest"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def verify(path: Path) -> dict:
    """resume.json of snapshot `path` once it and every file it lists check out; one line naming what does not."""
    from rlkit.io import fingerprints

    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, ValueError) as e:
        raise RlkitError(f"the snapshot {path} cannot be read ({getattr(e, 'strerror', None) or e}); remove it to "
                         "resume from the one before") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("digest") != _digest(state):
        raise RlkitError(f"the snapshot {path}: {STATE} is damaged (it does not match its digest); remove the "
                         "snapshot to resume from the one before")
    bad = []
    for rel, want in sorted(state["files"].items()):
        try:
            if fingerprints.sha256_cached(path / rel) != want:
                bad.append(rel)
        except OSError:
            bad.append(rel)
    on_disk = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - {STATE}
    if bad or on_disk != set(state["files"]):
        what = ", ".join(bad or sorted(on_disk ^ set(state["files"])))
        raise RlkitError(f"the snapshot {path} fails its hash check ({what}): changed or damaged after it was "
                         "written; remove it to resume from the one before")
    return state


def _root(model):
    from rlkit.training.distributed import fsdp_root

    return fsdp_root(model)


def _prefix(model) -> str:
    from rlkit.training.distributed import ROOT_PREFIX

    return ROOT_PREFIX if _root(model) is not model else ""


def _state_dicts(model, opt) -> dict:
    """{"model": ..., "optim": ...} of the policy, names without the FSDP function root's prefix: the same keys in one
    process and under torchrun (DTensor shards under FSDP2: each rank holds and writes its own)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    pre = _prefix(model)
    # frozen weights (a LoRA adapter's base) are --policy's, loaded with it: not in the snapshot
    msd, osd = get_state_dict(_root(model), opt, options=StateDictOptions(ignore_frozen_params=True))
    strip = lambda k: k.removeprefix(pre)  # noqa: E731
    osd = {"state": {strip(k): v for k, v in osd["state"].items()},
           "param_groups": [{**g, "params": [strip(k) for k in g["params"]]} for g in osd["param_groups"]]}
    return {"model": {strip(k): v for k, v in msd.items()}, "optim": osd}


def _gather_json(obj, dp) -> list:
    """[obj of rank 0, rank 1, ...] on every rank (JSON bytes in padded uint8 tensors; no pickle)."""
    if dp is None:
        return [obj]
    import torch
    import torch.distributed as dist

    data = json.dumps(obj).encode()
    n = torch.tensor([len(data)], device=dp.device)
    ns = [torch.zeros_like(n) for _ in range(dp.world)]
    dist.all_gather(ns, n)
    size = int(max(int(x) for x in ns))
    buf = torch.zeros(size, dtype=torch.uint8, device=dp.device)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dp.device)
    out = [torch.empty_like(buf) for _ in range(dp.world)]
    dist.all_gather(out, buf)
    return [json.loads(bytes(o[: int(k)].cpu().tolist())) for o, k in zip(out, ns, strict=True)]


@contextmanager
def _one_process(dp):
    """Quiet DCP's warning that, with no process group, it saves or loads in one process: what is meant then."""
    with warnings.catch_warnings():
        if dp is None:
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def save(t, root: Path, step: int, info: dict) -> tuple[Path, float, int]:
    """Snapshot trainer `t` after `step` into DIR/snapshots (every rank calls it: each writes its shards and RNG, rank 0
    the algorithm's extra models and resume.json, last). `info`: JSON the resume needs besides the trainer (the
    step's manifest and metrics row). -> (the snapshot, seconds, bytes written in all)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from rlkit.io import fingerprints
    from rlkit.io.atomic import fsync_dir, fsync_tree
    from rlkit.training import distributed

    dp = t.dp
    rank, main = (0, True) if dp is None else (dp.rank, dp.main)
    t0 = time.monotonic()
    d = root / ROOT
    final = d / name(step)
    tmp = d / f".{final.name}.tmp"
    if main:
        d.mkdir(exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    distributed.barrier(dp)
    with _one_process(dp):
        try:
            dcp.save(_state_dicts(t.model, t.opt), checkpoint_id=str(tmp))
        except dcp.api.CheckpointException as e:  # a rank's own failure (out of space: exit 74), not the wrapper
            shutil.rmtree(tmp, ignore_errors=True)
            if main:
                try:
                    d.rmdir()  # the snapshots folder this run made, when it holds no snapshot
                except OSError:
                    pass
            failure = next(iter(e.failures.values()), None)
            if isinstance(failure, tuple) and isinstance(failure[0], BaseException):
                raise failure[0] from None
            raise
    save_file({"rng": torch.get_rng_state()}, str(tmp / f"rng-rank{rank}.safetensors"))
    extra = t.algo.gather(t) if t.algo.trained() else None  # collectives under torchrun: every rank
    if main and t.algo.trained():
        t.algo.save(t, tmp / EXTRA, extra)
    distributed.barrier(dp)
    # each rank hashes the files it wrote (rank 0: the metadata and the extra models too); rank 0 records them all
    mine = sorted(p for p in tmp.rglob("*") if p.is_file()
                  and (p.name.startswith(f"__{rank}_") or p.name == f"rng-rank{rank}.safetensors"
                       or (main and not p.name.startswith("__") and not p.name.startswith("rng-rank"))))
    hashes = {}
    for h in _gather_json({str(p.relative_to(tmp)): fingerprints.sha256_cached(p) for p in mine}, dp):
        hashes.update(h)
    size = 0
    if main:
        t.state.precision = t.prec.state()
        state = {"format": FORMAT, "step": step, "world_size": 1 if dp is None else dp.world,
                 "trainer": {"optimizer_step": t.state.optimizer_step, "updates": t.state.updates,
                             "precision": t.state.precision, "skipped": t.prec.skipped},
                 **info, "files": hashes}
        state["digest"] = _digest(state)
        fsync_tree(tmp)
        with open(tmp / STATE, "w") as f:
            f.write(json.dumps(state, indent=1, sort_keys=True, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        fsync_dir(d)
        size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
    return final, time.monotonic() - t0, size


def load(t, snap: Snapshot) -> None:
    """Put snapshot `snap` (verified) into trainer `t`, whose model and optimizer are built and sharded as for training:
    weights, AdamW state, counters, loss scale, this rank's RNG (rank 0's at another world size) and the algorithm's
    extra models. Every rank calls it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from rlkit.training.engine import TrainerState

    dp = t.dp
    rank = 0 if dp is None else dp.rank
    sd = _state_dicts(t.model, t.opt)  # the templates DCP loads into (AdamW's state made by a zero-lr step)
    try:
        with _one_process(dp):
            dcp.load(sd, checkpoint_id=str(snap.path))
    except Exception as e:  # noqa: BLE001 - DCP's own errors name a missing or mis-shaped tensor
        raise RlkitError(f"the snapshot {snap.path} does not fit this run ({(str(e).splitlines() or [type(e).__name__])[0]}); "
                         "it was written for another model or algorithm") from None
    pre = _prefix(t.model)
    osd = sd["optim"]
    osd = {"state": {pre + k: v for k, v in osd["state"].items()},
           "param_groups": [{**g, "params": [pre + k for k in g["params"]]} for g in osd["param_groups"]]}
    set_state_dict(_root(t.model), t.opt, model_state_dict={pre + k: v for k, v in sd["model"].items()},
                   optim_state_dict=osd, options=StateDictOptions(ignore_frozen_params=True, strict=False))
    own = snap.path / f"rng-rank{rank}.safetensors"
    torch.set_rng_state(load_file(str(own if own.is_file() else snap.path / "rng-rank0.safetensors"))["rng"])
    tr = snap.state["trainer"]
    t.state = TrainerState(optimizer_step=tr["optimizer_step"], updates=tr["updates"], precision=tr["precision"])
    t.prec.load_state(tr["precision"])
    t.prec.skipped = int(tr.get("skipped", 0))
    if t.algo.trained() or (snap.path / EXTRA).is_dir():
        t.algo.load(t, snap.path / EXTRA)


def read_weights(path: Path) -> dict:
    """The policy's fp32 weights in snapshot `path`, whole, read in this process (no process group): the masters a
    resumed run trains on, where the steps published on a GPU are bf16."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path)).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
          if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with _one_process(None):
        dcp.load(sd, checkpoint_id=str(path))
    return {k.removeprefix("model."): v for k, v in sd.items()}


def prune(root: Path, keep: int = 1) -> list[int]:
    """Delete all but the newest `keep` (>= 1) snapshots, each renamed to a hidden name first; the steps removed."""
    import secrets

    snaps = scan(root)
    gone = []
    for step, p in snaps[: max(0, len(snaps) - max(1, keep))]:
        hidden = p.parent / f".{p.name}.del-{os.getpid()}-{secrets.token_hex(3)}"
        os.rename(p, hidden)
        shutil.rmtree(hidden, ignore_errors=True)
        gone.append(step)
    return gone
