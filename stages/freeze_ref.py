"""`rlkit freeze-ref`: freeze a policy as the KL reference (pi_ref).

Reads a policy checkpoint; writes its weights in the chosen dtype (bf16 halves fp32's bytes) with a
manifest recording every weights file's sha256. Whatever later loads the reference (`score-ref`)
verifies those hashes first and refuses a reference whose weights changed, so the reference is
provably the one frozen here. pi_ref is not pi_old: the sampling policy's log-probs are logged at
rollout time, the reference's are added by `score-ref`.

`--link` writes no second copy of the weights: the policy's *.safetensors are hard-linked into the
reference directory (same filesystem; the dtype is the stored one), which is how a LoRA run takes its
base as the reference at no disk cost. The hash check is the same, so a base changed in place later is
refused; a base deleted or replaced by a new file leaves the reference's link, and its weights, intact.
A LoRA checkpoint freezes merged into its base (a reference is a plain model), never linked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlkit import stage_options
from rlkit.options import Force, NoVerify, OutDir, PolicyDir, TrustRemoteCode
from rlkit.stage_options import option


@dataclass(frozen=True)
class FreezeRefConfig:
    policy: Path = option(..., PolicyDir)
    out: Path = option(..., OutDir)
    # None: bf16, or with `link` the stored dtype
    dtype: Literal["fp32", "bf16", "fp16"] | None = option(None, panel="Precision & memory", help="Reference dtype: fp32, bf16 or fp16 (default bf16; with --link the stored one).")
    link: bool = option(False, "--link", panel="Output & tracking", help="Hard-link the policy's weights instead of writing a copy (no extra disk: the reference of a LoRA run is its base); same filesystem, stored dtype, still hash-checked. Not for a LoRA checkpoint, which freezes merged.")
    trust_remote_code: bool = option(False, TrustRemoteCode)
    verify: bool = option(True, NoVerify, invert=True)  # --no-verify: no hash check of the policy (never for a reference)
    force: bool = option(False, Force)


def run(cfg: FreezeRefConfig) -> Path:
    """Claims --out (see `claims.claim_out`: never over an input, one writer) and runs the stage."""
    from rlkit.io import checkpoints, claims

    with claims.claim_out(cfg.out, "model", {"--policy": cfg.policy}), checkpoints.verifying(cfg.verify):
        return _run(cfg)


def _run(cfg: FreezeRefConfig) -> Path:
    from dataclasses import replace

    from rlkit import console
    from rlkit.errors import RlkitError
    from rlkit.io import adapters, atomic, checkpoints, claims, fingerprints, manifests

    if cfg.dtype is not None and cfg.dtype not in checkpoints.DTYPES:
        raise RlkitError(f"--dtype {cfg.dtype!r} is not one of {', '.join(checkpoints.DTYPES)}")
    checkpoints.check_model_dir(cfg.policy, "policy")
    claims.check_out(cfg.out, "model")
    if cfg.link:
        cfg = replace(cfg, dtype=_link_dtype(cfg))
    cfg = replace(cfg, dtype=cfg.dtype or "bf16")
    inputs = {"policy": fingerprints.fingerprint(cfg.policy)}
    if manifests.skip_if_current(cfg.out, "freeze-ref", cfg, inputs):
        return cfg.out
    parent = checkpoints.load_manifest(cfg.policy) or {}
    manifest = manifests.make_manifest(
        "reference", "freeze-ref", cfg, inputs, step=parent.get("step", 0), frozen_from=str(cfg.policy),
        **({"frozen_from_lora": parent.get("lora")} if adapters.is_adapter_dir(cfg.policy) else {}),
    )
    with atomic.atomic_dir(cfg.out) as tmp:
        if cfg.link:
            manifest = _link(cfg, tmp, manifest)
        else:  # a LoRA checkpoint: merged into its (hash-verified) base
            model, tokenizer = checkpoints.load_policy(cfg.policy, cfg.dtype, cfg.trust_remote_code, merged=True)
            manifest = checkpoints.save_model(model, tokenizer, tmp, manifest)
    s = checkpoints.safetensors_summary(cfg.out)
    src = checkpoints.safetensors_summary(cfg.policy)
    how = (f"hard-linked from {cfg.policy}, no copy" if cfg.link else
           f"policy: {src['bytes']:,} bytes as {'/'.join(src['dtypes'])}" + (" (LoRA adapter, merged)"
                                                                             if adapters.is_adapter_dir(cfg.policy) else ""))
    console.info(
        f"freeze-ref: {s['parameters']:,} parameters, {s['bytes']:,} bytes as {cfg.dtype} ({how}); "
        f"sha256 {manifest['weights_digest'][:16]}… -> {cfg.out}"
    )
    return cfg.out


def _link_dtype(cfg: FreezeRefConfig) -> str:
    """The dtype --link freezes in: the policy's stored one (--dtype, when given, must be it)."""
    from rlkit.errors import RlkitError
    from rlkit.io import adapters, checkpoints

    if adapters.is_adapter_dir(cfg.policy):
        raise RlkitError(f"freeze-ref --link: {cfg.policy} is a LoRA checkpoint, whose weights exist only merged "
                         "into its base: link the base itself (the reference of a LoRA run), or leave out --link for "
                         "a merged copy")
    names = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
    stored = {names.get(t, t) for t in checkpoints.safetensors_summary(cfg.policy)["dtypes"]}
    if len(stored) != 1 or not stored <= set(checkpoints.DTYPES):
        raise RlkitError(f"freeze-ref --link: {cfg.policy} stores its weights as {'+'.join(sorted(stored))}, not one "
                         "of fp32, bf16, fp16; leave out --link for a converted copy")
    (have,) = stored
    if cfg.dtype not in (None, have):
        raise RlkitError(f"freeze-ref --link links the weights as stored ({have}); --dtype {cfg.dtype} needs a "
                         "converted copy: leave out --link (or --dtype)")
    return have


def _link(cfg: FreezeRefConfig, tmp: Path, manifest: dict) -> dict:
    """Hard-link the policy's weights into `tmp`, copy its other top-level files; hash; the manifest."""
    import json
    import os
    import shutil

    from rlkit.errors import RlkitError
    from rlkit.io import checkpoints, manifests

    for f in sorted(cfg.policy.iterdir()):
        if f.is_dir() or f.name == manifests.MODEL_MANIFEST:
            continue  # trainer/, critic/: not the policy's weights
        if f.suffix != ".safetensors":
            shutil.copy2(f, tmp / f.name)
            continue
        try:
            os.link(f, tmp / f.name)
        except OSError as e:
            raise RlkitError(f"freeze-ref --link: cannot hard-link {f} into {cfg.out.parent} ({e.strerror}): a hard "
                             "link needs both on one filesystem; put --out beside the policy or leave out --link "
                             "for a copy") from e
    per_file, digest = checkpoints.hash_weights(tmp)
    manifest = {**manifest, "weights_sha256": per_file, "weights_digest": digest, "weights_dtype": cfg.dtype,
                "linked_from": str(cfg.policy.absolute())}
    (tmp / manifests.MODEL_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


command = stage_options.command(
    FreezeRefConfig, "Freeze a policy as the hash-checked KL reference, in fp32, bf16 or fp16 (a LoRA checkpoint: merged).")
