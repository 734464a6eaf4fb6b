"""A stage process's start-up: how its OpenMP threads wait, and Python's cyclic garbage collector paused until the
libraries are imported.

OpenMP (torch's CPU threads) makes an idle worker thread spin for a moment before it sleeps, so that the next
parallel operation starts at once. A stage whose compute runs while another stage of its pipe computes on the same
cores sets `OMP_WAIT_POLICY=PASSIVE` (`threads`): its idle threads sleep at once and leave the cores to the other.
That is every stage but `update` without --follow or with `--follow --max-lag 0`: it trains once its input has
ended (or, synchronously, while rollout waits for its step), alone on the cores, where threads that spin briefly
start its many small operations in a row sooner (on a busy 2-core machine, up to a fifth of a recipe round's two
epochs). A value the user set is kept. How threads wait changes no result.

Importing torch and transformers makes about 350,000 Python objects the collector tracks, and with it running the
imports trigger several full collections that each walk all of them again (a few tenths of a second to a second of
a stage's start, more on a busy machine). A model-loading stage therefore starts with the collector paused
(`pause`, from `rlkit.cli` before the stage imports anything heavy) and, once its libraries are imported and its
models loaded (`done`, called where the stage announces its device, `rlkit.devices.announce`, or loads its model
without announcing), moves every object made so far into the collector's permanent generation (`gc.freeze`: module objects that live as
long as the process) and turns it back on: the run's own garbage is collected as always, and later full
collections skip the frozen objects. Reference counting frees everything non-cyclic meanwhile; what the paused
collector leaves is the few cycles import machinery makes. Nothing computed changes. When the stage has finished
(`finish`, from `rlkit.cli`) the objects are unfrozen, so that a teardown collects them as it always did (extension
modules check at exit that their objects went); a stage process that loaded torch skips the teardown altogether
(`rlkit.cli._exit_without_teardown`).
"""

from __future__ import annotations

import gc
import os

# stages that import torch and transformers and load a model: the others start in well under a second
MODEL_STAGES = frozenset({"sft", "train-rm", "freeze-ref", "rollout", "score-ref", "update", "eval", "build-prefs"})

_paused = False
_frozen = False


def threads(alone: bool = False) -> None:
    """OpenMP's wait policy of this process's stage, set before torch loads: PASSIVE unless the stage computes
    `alone` (`update` says so itself, from its options; `rlkit.cli` calls this for every other command)."""
    if not alone:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pause(command: str | None) -> None:
    """Pause the collector for the start-up of `command` (a stage name) when it is a model-loading stage."""
    global _paused
    if command in MODEL_STAGES and gc.isenabled():
        gc.disable()
        _paused = True


def done() -> None:
    """Start-up is over: freeze what it made and turn the collector back on (once; a no-op when not paused)."""
    global _paused, _frozen
    if _paused:
        _paused = False
        _frozen = True
        gc.freeze()
        gc.enable()


def finish() -> None:
    """The stage has finished: back to the collector as it was before `pause` (the frozen objects unfrozen)."""
    global _frozen
    done()
    if _frozen:
        _frozen = False
        gc.unfreeze()
