"""Step directories of a `--follow` run: how `update --follow` publishes checkpoints and how
`rollout --follow` (or anything else, e.g. a held-out eval) picks them up while both keep running.

Layout of DIR::

    step-000001/  step-000002/ ...   complete steps: what a worker loads (weights in the dtype the
                                     engines serve, config, tokenizer, rlkit.json); no optimizer state
    latest -> step-000002            symlink to the newest complete step, replaced atomically
    snapshots/snapshot-000010/       update's resume snapshots (`rlkit.follow.snapshots`)
    .lock                            flock'ed by the one `update --follow` writing DIR (the kernel
                                     drops the lock when that process dies, so it never goes stale)
    .step-000003.tmp-PID-XXXXXX      a step being written: hidden, never read

A step is written under a hidden name, every file fsynced, `rlkit.json` last, then renamed into
place and the directory fsynced; so whatever kills the writer (SIGINT, SIGTERM, SIGKILL, power) a
visible `step-NNNNNN` is complete. Readers still treat a `step-NNNNNN` without `rlkit.json` as not
there (another tool may be copying one in) and verify the weights' sha256 before loading.
Pruning renames a step to a hidden name before deleting it, so no reader sees it half-deleted.

Pure filesystem code: no torch.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlkit.errors import RlkitError
from rlkit.io.manifests import MODEL_MANIFEST

STEP_RE = re.compile(r"^step-(\d{6,})$")
LATEST = "latest"
LOCK = ".lock"
SNAPSHOTS = "snapshots"  # update's resume snapshots (`rlkit.follow.snapshots`); never loaded by a worker
POLL_SECONDS = 0.05


def step_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass(frozen=True)
class Step:
    step: int
    path: Path


def _foreign(root: Path, name: str) -> RlkitError:
    return RlkitError(f"--follow {root}: '{name}' is not an rlkit step directory; a follow directory holds only "
                      "step-NNNNNN/ checkpoints and 'latest', written by `rlkit update --follow` (choose an empty "
                      "or new directory)")


def check_root(root: Path) -> None:
    """Refuse a DIR that exists but is not a follow directory (a file, a model directory, other files)."""
    if not root.exists():
        return
    if not root.is_dir():
        raise RlkitError(f"--follow {root} is a file, expected a directory of step-NNNNNN/ checkpoints")
    if (root / MODEL_MANIFEST).exists() or (root / "config.json").exists():
        raise RlkitError(f"--follow {root} is a model directory, expected a directory of step-NNNNNN/ checkpoints "
                         "(pass the model as --policy and a new directory to --follow)")
    scan(root)


def scan(root: Path) -> tuple[list[Step], list[Path]]:
    """(complete steps, oldest first; step directories without rlkit.json). Raises on anything foreign."""
    steps, partial = [], []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return [], []
    for e in entries:
        if e.name.startswith("."):
            continue
        if e.name == LATEST and e.is_symlink():
            continue
        if e.name == SNAPSHOTS and e.is_dir(follow_symlinks=False):
            continue
        m = STEP_RE.match(e.name)
        if m is None or not e.is_dir(follow_symlinks=False):
            raise _foreign(root, e.name)
        p = Path(e.path)
        if (p / MODEL_MANIFEST).is_file():
            steps.append(Step(int(m.group(1)), p))
        else:
            partial.append(p)
    steps.sort(key=lambda s: s.step)
    return steps, partial


def newest(root: Path) -> Step | None:
    """The newest complete step in `root`, or None."""
    steps, _ = scan(root)
    return steps[-1] if steps else None


def wait_for(root: Path, min_step: int, stop: Callable[[], bool] | None = None,
             poll: float = POLL_SECONDS) -> Step | None:
    """Block until a complete step >= `min_step` exists; None when `stop()` turns true first."""
    while True:
        s = newest(root)
        if s is not None and s.step >= min_step:
            return s
        if stop is not None and stop():
            return None
        time.sleep(poll)


@contextmanager
def writer_lock(root: Path) -> Iterator[None]:
    """Hold DIR/.lock for the lifetime of one `update --follow`; a second one is refused (exit 75, naming
    the holder's pid). A run that ends having published no step leaves DIR as it found it: the lock file
    goes, and DIR too if this run made it."""
    from rlkit.io.atomic import OutputUnwritable, _out_of_space, _remove_empty
    from rlkit.io.claims import OutputBusy, flock_file

    made = [p for p in (root, *root.parents) if not p.exists()]
    lock = root / LOCK
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = flock_file(lock, lambda holder: OutputBusy(
            f"--follow {root} is being written by another `rlkit update --follow` (pid {holder}); refusing to start "
            "a second writer on the same directory: wait for it to end or choose another --out"))
    except OSError as e:
        _remove_empty(made)
        raise OutputUnwritable(f"cannot write --follow {root}: {e.strerror or e} ({e.filename or root}); choose a "
                               "writable location") from None
    except BaseException:
        _remove_empty(made)
        raise
    try:
        yield
    except Exception as e:
        full = None if isinstance(e, RlkitError) else _out_of_space(e)
        if full is None:
            raise
        raise OutputUnwritable(f"writing --follow {root} failed: {full}; the steps published before are complete "
                               "and the unfinished one was removed (free space, or choose another location)") from e
    finally:
        try:
            if not scan(root)[0]:  # no step published: DIR as it was
                lock.unlink(missing_ok=True)  # while still holding it: see the inode check in flock_file
        except (OSError, RlkitError):
            pass
        os.close(fd)  # releases the flock
        _remove_empty(made)


def clean_stale(root: Path) -> list[str]:
    """Remove hidden leftovers of a killed writer (call with the lock held). Returns their names."""
    gone = []
    for e in list(os.scandir(root)):
        if e.name.startswith(".step-") or e.name.startswith(f".{LATEST}."):
            (shutil.rmtree if e.is_dir(follow_symlinks=False) else os.unlink)(e.path)
            gone.append(e.name)
    return gone


def publish(root: Path, step: int, write: Callable[[Path], dict]) -> Path:
    """Write step `step` into DIR atomically and point `latest` at it.

    `write(tmp)` saves everything except `rlkit.json` into the hidden directory `tmp` and returns
    the manifest, which is written last, after every other file is fsynced.
    """
    from rlkit.io.atomic import fsync_dir, fsync_tree, signals_deferred

    final = root / step_name(step)
    if final.exists():
        raise RlkitError(f"{final} already exists; a step directory is never overwritten")
    tmp = root / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        tmp.mkdir()
        manifest = write(tmp)
        fsync_tree(tmp)
        with open(tmp / MODEL_MANIFEST, "w") as f:
            f.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with signals_deferred():
        try:
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        link = root / f".{LATEST}.tmp-{os.getpid()}"
        try:
            link.unlink(missing_ok=True)
            os.symlink(final.name, link)
            os.replace(link, root / LATEST)
        except BaseException:  # the step is published (readers scan for it); `latest` lags until the next one
            link.unlink(missing_ok=True)
            raise
    fsync_dir(root)
    return final


def prune(root: Path, keep: int, newest: int | None = None) -> list[int]:
    """Delete all but the newest `keep` (>= 1) complete steps, and none after step `newest` (`update --follow`: its
    newest snapshot, after which a restart trains the steps again from the batch files their manifests name);
    returns the steps removed. Each is renamed to a hidden name first, so no reader sees a step half-deleted."""
    steps, _ = scan(root)
    gone = []
    for s in steps[: max(0, len(steps) - max(1, keep))]:
        if newest is not None and s.step > newest:
            continue
        hidden = root / f".{s.path.name}.del-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            os.rename(s.path, hidden)
        except FileNotFoundError:
            continue
        shutil.rmtree(hidden, ignore_errors=True)
        gone.append(s.step)
    return gone


def verify_step(d: Path) -> dict:
    """The manifest of a complete step whose weights still hash as recorded; one clear line otherwise."""
    from rlkit.io.checkpoints import check_model_dir, load_manifest

    m = load_manifest(d) if (d / MODEL_MANIFEST).is_file() else None
    if not m or m.get("kind") != "model" or "weights_sha256" not in m:
        raise RlkitError(f"{d} is not a checkpoint written by `rlkit update` (its {MODEL_MANIFEST} lacks the "
                         "weights' sha256)")
    check_model_dir(d, "step", verify=True)
    return m
