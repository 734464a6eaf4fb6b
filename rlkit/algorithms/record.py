"""What an `update` checks, records and shows around its training, the same for one update and for each step
of `update --follow` (`rlkit.follow.update`): the frozen reference the input was scored against
(`check_reference`) and the one the checkpoint records (`reference_entry`), the policy's drift from it (`drift`,
`rlkit.training.drift`), the reward weights (`reward_weights`), and the metrics table on stderr (`show`).

`cfg` is the stage's `UpdateConfig` (`stages/update.py`); these read its `policy`, `ref` and `max_drift`.
Imports nothing heavy at the top (`rlkit --help` stays instant).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlkit.io.manifests import Manifest


def reference_entry(upstream: Manifest, cfg) -> dict:
    """{'reference': {'path', 'fingerprint'}}: the frozen reference this checkpoint was trained against, so
    that `score-ref` without --ref can find it: --ref (`check_reference` made sure the input was scored by
    it, or a copy), else the input's (score-ref's --ref), else the one --policy records. The path is
    absolute: a later stage may run in another directory."""
    from rlkit.io import checkpoints, fingerprints

    if cfg.ref is not None:
        return {"reference": {"path": str(cfg.ref.resolve()), "fingerprint": fingerprints.fingerprint(cfg.ref)}}
    ref, fp = upstream.path("reference"), upstream.inputs.get("ref")
    if ref:
        return {"reference": {"path": str(Path(ref).absolute()), "fingerprint": fp or fingerprints.fingerprint(ref)}}
    recorded = (checkpoints.load_manifest(cfg.policy) or {}).get("reference")
    return {"reference": recorded} if isinstance(recorded, dict) else {}


def check_reference(ref: Path | None, upstream: Manifest, kind: str, label: str) -> None:
    """Refuse --ref when the input's reference log-probs (a scored table's ref_logprobs, a scored prefs
    table's ref_*_logp) came from another reference: the KL or DPO term would pull towards that one while the
    checkpoint records --ref. Same weights count as the same reference (a copy, a moved directory): the
    weights' digest score-ref recorded, else (tables made before it did) the input fingerprint, else the
    recorded path's weights. A table that records no reference is taken as scored by --ref, with a warning."""
    from rlkit import console
    from rlkit.errors import RlkitError
    from rlkit.io import checkpoints, fingerprints

    if ref is None or kind not in ("scored", "prefs"):
        return
    m = upstream
    have = checkpoints.verify_reference(ref).get("weights_digest")
    recorded = m.path("reference")
    if m.get("reference_digest"):
        same = m.get("reference_digest") == have
    elif m.inputs.get("ref") and m.command == "score-ref" and m.inputs["ref"] == fingerprints.fingerprint(ref):
        same = True
    elif recorded and Path(recorded).is_dir():
        same = (checkpoints.load_manifest(Path(recorded)) or {}).get("weights_digest") == have
    else:
        if kind == "scored" or m.get("reference"):
            console.warn(f"update: cannot check that --ref {ref} is the reference {label} was scored against (its "
                         "manifest records no reference to compare with); taking it that it is")
        return
    if not same:
        raise RlkitError(f"--ref {ref} is not the reference {label} was scored against ({recorded or 'another'}): "
                         "its reference log-probs come from that one, and the checkpoint would record --ref; pass "
                         f"--ref {recorded or 'REF'} (same weights), or rescore with `rlkit score-ref --ref {ref}`")


def reward_weights(loaded) -> dict:
    """The manifest's {'reward_weights': ...} of a loaded input (`Loaded.reward_weights`), {} without any."""
    return {} if loaded.reward_weights is None else {"reward_weights": loaded.reward_weights}


def drift(cfg, params: dict, upstream_ref: str | None, cache: dict | None = None) -> dict:
    """{'drift': ...} of the policy's weights from --ref or the reference score-ref used; warns above --max-drift.
    `cache` (kept by the caller across steps) holds the hash-checked reference weights after the first call."""
    from rlkit import console
    from rlkit.io.checkpoints import load_weights, verify_reference
    from rlkit.training.drift import relative_drift

    ref = cfg.ref or (Path(upstream_ref) if upstream_ref else None)
    if ref is None:
        return {}
    if cache is None or ref not in cache:
        if cfg.ref is None and not ref.is_dir():
            console.warn(f"update: no drift figure: the reference score-ref used ({ref}) is not there any more; "
                         "pass --ref")
            return {}
        verify_reference(ref)
        weights = load_weights(ref)
        if cache is not None:
            cache[ref] = weights
    else:
        weights = cache[ref]
    d = relative_drift(params, weights)
    if d > cfg.max_drift:
        console.warn(f"POLICY DRIFT: the weights are {d:.4f} (relative L2) away from the reference {ref}, above "
                     f"--max-drift {cfg.max_drift:g}; check KL, held-out accuracy and response length for reward hacking")
    return {"drift": d}


# shown after every update, around the input's and the algorithm's own metrics
_SHOWN_FOLLOW = ("lag_mean", "lag_max", "rows_dropped")
_SHOWN_TRAINER = ("grad_norm", "loss_scale", "skipped_steps", "drift", "optimizer_steps", "tokens_per_s",
                  "train_seconds", "gpu_mem_peak_gib")


def show(metrics: dict, inp, algo, follow: bool = False) -> None:
    """The step's metrics as a table on stderr: rewards, then the input's and the algorithm's own (`shown`; a
    multi-turn batch's `mean_turns` and `environment_token_fraction` among them), the lag under --follow, and the
    trainer's. Under --follow (`follow`) its caption says that the figures are the step's batch's, not running
    means over the steps so far."""
    from rich.table import Table

    from rlkit import console

    t = Table(title=f"update step {metrics['step']}", show_header=False,
              caption="figures of this step's batch, not running means" if follow else None)
    keys = (*[k for k in metrics if k.startswith(("reward/", "verdict/"))], *inp.shown, *algo.shown, *_SHOWN_FOLLOW, *_SHOWN_TRAINER)
    for k in dict.fromkeys(keys):
        v = metrics.get(k)
        if v is not None:
            t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    console.err.print(t)
