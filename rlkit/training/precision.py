"""Precision (`--dtype`) for one training loop: autocast and the fp16 loss scale (`Precision`), and the dtype
FSDP2 gathers a sharded model's weights in (`fsdp_param_dtype`, `fsdp_mp_policy`). Why fp32 master weights
under bf16/fp16 compute: the `rlkit.training` docstring.
"""

from __future__ import annotations

import contextlib

from rlkit.devices import TORCH_DTYPES


class Precision:
    """Autocast and (fp16) loss scaling for one training loop.

    Usage: `with prec.autocast(): loss = ...`, then `prec.backward(loss)` and
    `prec.step([(params, opt, clip)])` instead of `loss.backward(); clip; opt.step()`."""

    def __init__(self, dtype: str = "fp32", device_type: str = "cpu", sharded: bool = False) -> None:
        import torch

        if dtype == "auto":
            raise ValueError("Precision takes a concrete dtype: resolve --dtype auto first (TrainOptions.on(device))")
        self.dtype, self.device_type = dtype, device_type
        # FSDP2 under a mixed-precision policy (`fsdp_param_dtype`: bf16 on a GPU) gathers the weights in the
        # compute dtype itself: no autocast over it (its casts and cached copies would be waste)
        self.autocasts = dtype != "fp32" and not (sharded and fsdp_param_dtype(dtype, device_type) is not None)
        self.torch_dtype = getattr(torch, TORCH_DTYPES[dtype])
        self.scaler = torch.amp.GradScaler(device_type) if dtype == "fp16" else None
        self.skipped = 0  # fp16: optimizer steps skipped for overflowing gradients
        if device_type == "cpu" and dtype != "fp32" and not _fast_cpu_half(dtype):
            from rlkit import console

            console.warn(f"--dtype {dtype} on a CPU without {dtype} matmul kernels (AVX512-BF16/AMX): it saves "
                         "activation memory but trains many times slower than fp32 (docs/precision-lora.md)")

    def autocast(self):
        if not self.autocasts:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(self.device_type, dtype=self.torch_dtype)

    def backward(self, loss) -> None:
        """loss.backward(), scaled under fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip(self, groups) -> list:
        """After `backward`: per (parameters, optimizer, clip) group unscale (fp16) and clip the gradients;
        -> each group's gradient norm before clipping, as a () tensor on the device (no host sync)."""
        import torch

        norms = []
        for params, opt, clip in groups:
            if self.scaler is not None:
                self.scaler.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_([p for p in params if p.requires_grad], clip or float("inf"))
            norms.append(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)  # a DTensor under FSDP2
        return norms

    def apply(self, groups, finite: bool) -> bool:
        """Step every group's optimizer after `clip`; `finite`: every norm `clip` gave is finite (read on the
        host by the caller, with its other figures, in one sync). Without a scaler a non-finite norm steps
        nothing (-> False: the caller aborts); under fp16 the scaler skips the step on overflow and lowers
        the scale (-> False, counted in `skipped`)."""
        if self.scaler is None:
            if not finite:
                return False
            for _, opt, _ in groups:
                opt.step()
            return True
        before = self.scaler.get_scale()
        for _, opt, _ in groups:
            self.scaler.step(opt)  # skipped when its unscaled gradients hold inf/nan
        self.scaler.update()
        stepped = self.scaler.get_scale() >= before
        self.skipped += not stepped
        return stepped

    def step(self, groups) -> tuple[list, bool]:
        """`clip` then `apply`: (each group's gradient norm before clipping, stepped)."""
        import math

        from rlkit import devices

        norms = self.clip(groups)
        return norms, self.apply(groups, all(math.isfinite(v) for v in devices.host(norms)))

    def state(self) -> dict:
        """JSON-able state to resume with (the fp16 loss scale and its growth counter)."""
        if self.scaler is None:
            return {"dtype": self.dtype}
        sd = self.scaler.state_dict()
        return {"dtype": self.dtype, "scale": float(sd["scale"]), "growth_tracker": int(sd["_growth_tracker"])}

    def load_state(self, s: dict | None) -> None:
        if self.scaler is None or not s or "scale" not in s:
            return
        sd = self.scaler.state_dict()
        sd.update(scale=s["scale"], _growth_tracker=s["growth_tracker"])
        self.scaler.load_state_dict(sd)


def _fast_cpu_half(dtype: str) -> bool:
    import torch

    try:
        fn = torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == "bf16" else torch.ops.mkldnn._is_mkldnn_fp16_supported
        return bool(fn())
    except (AttributeError, RuntimeError):
        return False


def fsdp_param_dtype(dtype: str, device_type: str) -> str | None:
    """The dtype FSDP2 gathers a sharded model's weights in (`MixedPrecisionPolicy(param_dtype=...)`, gradients
    reduced in fp32), or None: no policy, fp32 weights gathered and the compute dtype left to autocast.
    bf16 on a GPU: each layer is all-gathered in bf16 (half the bytes of fp32 between GPUs and nodes) and runs
    in bf16 without autocast's cached copies; the fp32 master shards and AdamW's state stay fp32 (verl's
    `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`). Anything else (fp32; the CPU, gloo): None."""
    return "bf16" if dtype == "bf16" and device_type == "cuda" else None


def fsdp_mp_policy(dtype: str, device_type: str):
    """`torch.distributed.fsdp.MixedPrecisionPolicy` for `fsdp_param_dtype`, or None."""
    param = fsdp_param_dtype(dtype, device_type)
    if param is None:
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=getattr(torch, TORCH_DTYPES[param]), reduce_dtype=torch.float32)
