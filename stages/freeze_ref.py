"""`rlkit freeze-ref`: freeze a policy as the KL reference (pi_ref).

Reads a policy checkpoint; writes its weights in the chosen dtype (bf16 halves fp32's bytes) with a
manifest recording every weights file's sha256. Whatever later loads the reference (`score-ref`)
verifies those hashes first and refuses a reference whose weights changed, so the reference is
provably the one frozen here. pi_ref is not pi_old: the sampling policy's log-probs are logged at
rollout time, the reference's are added by `score-ref`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from rlkit.options import Force, OutDir, PolicyDir, TrustRemoteCode


@dataclass(frozen=True)
class FreezeRefConfig:
    policy: Path
    out: Path
    dtype: str = "bf16"
    trust_remote_code: bool = False
    force: bool = False


def run(cfg: FreezeRefConfig) -> Path:
    from rlkit import artifacts, checkpoints, console
    from rlkit.errors import RlkitError

    if cfg.dtype not in checkpoints.DTYPES:
        raise RlkitError(f"--dtype {cfg.dtype!r} is not one of {', '.join(checkpoints.DTYPES)}")
    checkpoints.check_model_dir(cfg.policy, "policy")
    artifacts.check_out(cfg.out, "model")
    inputs = {"policy": artifacts.fingerprint(cfg.policy)}
    if artifacts.skip_if_current(cfg.out, "freeze-ref", cfg, inputs):
        return cfg.out
    model, tokenizer = checkpoints.load_policy(cfg.policy, cfg.dtype, cfg.trust_remote_code)
    parent = checkpoints.load_manifest(cfg.policy) or {}
    manifest = artifacts.make_manifest(
        "reference", "freeze-ref", cfg, inputs, step=parent.get("step", 0), frozen_from=str(cfg.policy),
    )
    with artifacts.atomic_dir(cfg.out) as tmp:
        manifest = checkpoints.save_model(model, tokenizer, tmp, manifest)
    s = checkpoints.safetensors_summary(cfg.out)
    src = checkpoints.safetensors_summary(cfg.policy)
    console.info(
        f"freeze-ref: {s['parameters']:,} parameters, {s['bytes']:,} bytes as {cfg.dtype} "
        f"(policy: {src['bytes']:,} bytes as {'/'.join(src['dtypes'])}); "
        f"sha256 {manifest['weights_digest'][:16]}… -> {cfg.out}"
    )
    return cfg.out


def command(
    policy: PolicyDir,
    out: OutDir,
    dtype: Annotated[str, typer.Option(help="Reference dtype: fp32, bf16 or fp16.")] = "bf16",
    trust_remote_code: TrustRemoteCode = False,
    force: Force = False,
) -> None:
    """Freeze a policy as the hash-checked KL reference, in fp32, bf16 or fp16."""
    run(FreezeRefConfig(policy=policy, out=out, dtype=dtype, trust_remote_code=trust_remote_code, force=force))
