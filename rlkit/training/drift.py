"""Weight-space drift of the policy from the frozen reference: how far training has moved the weights.

    drift = sum_t ||theta_t - ref_t||_2 / sum_t ||ref_t||_2      over the tensors both hold

A policy that has not moved has drift 0; a few RL rounds on the tiny model move it by about 1e-3
(see docs/monitoring.md). The reference may be bf16/fp16: the policy is rounded to the reference's dtype
before the difference, so the rounding done by `freeze-ref` is not counted as drift (and changes
smaller than that dtype's resolution are not either).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

from rlkit.errors import RlkitError


def relative_drift(params: Mapping[str, Tensor], ref: Mapping[str, Tensor]) -> float:
    """sum ||p - r|| / sum ||r|| over the names in both, p rounded to r's dtype first. -> float >= 0."""
    import torch

    names = [n for n in ref if n in params]
    if not names:
        raise RlkitError("the policy and the reference share no weight names; is the reference for this model?")
    norms = []  # per tensor: ||p - r||, ||r||, () on the policy's device, read back in one sync
    for n in names:
        if params[n].shape != ref[n].shape:
            raise RlkitError(f"weight {n}: policy shape {tuple(params[n].shape)} vs reference {tuple(ref[n].shape)}")
        p = params[n].detach()
        r = ref[n].detach().to(p.device, non_blocking=True).float()  # a GPU policy: the reference goes to it
        p = p.to(dtype=ref[n].dtype).float()
        norms += [torch.linalg.vector_norm(p - r), torch.linalg.vector_norm(r)]
    got = torch.stack(norms).cpu().tolist()
    num = den = 0.0
    for k in range(0, len(got), 2):  # summed in float64 in name order
        num += got[k]
        den += got[k + 1]
    return num / den if den > 0 else 0.0


def model_drift(model, ref_dir: Path) -> float:
    """Drift of a loaded model's weights from a hash-checked reference directory."""
    from rlkit.io.checkpoints import load_weights, verify_reference

    verify_reference(ref_dir)
    return relative_drift(dict(model.state_dict()), load_weights(ref_dir))
