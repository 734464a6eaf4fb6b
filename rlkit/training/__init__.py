"""Training numerics shared by `sft`, `train-rm` and `update`: precision, gradient checkpointing, LoRA.

Precision (`--dtype`). rlkit keeps **fp32 master weights and fp32 AdamW state** and runs the forward
and backward passes in bf16/fp16 under `torch.autocast` (verl's choice: FSDP `param_dtype=bf16`
over fp32 parameters). Why not bf16 weights with an fp32 optimizer state:
- the update is the fp32 AdamW step whatever the compute dtype, so an RL step of lr 1e-6 is not
  rounded away (bf16 has an 8-bit mantissa: 1.0 + 1e-6 == 1.0);
- the saved checkpoint is the fp32 master, so `update` resumes bit-exactly across processes, and
  `freeze-ref --dtype bf16` still makes a half-size reference from it;
- weights + gradients + AdamW cost 16 bytes per parameter either way once bf16 weights carry an
  fp32 master copy, so what bf16 saves is activation memory (the larger share in RL, where
  prompt + response batches are long), and that autocast saves.
Under torchrun on GPUs, bf16 is FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`
instead of autocast (`fsdp_param_dtype`): each layer's fp32 shards are all-gathered as bf16 (half the
bytes) and gradients reduced in fp32 onto the fp32 shards; on the CPU (gloo) autocast stays.
fp16 runs with a dynamic loss scale (`torch.amp.GradScaler`, CPU and CUDA); a step whose gradients
overflow is skipped and counted, as with any scaler. Under torchrun fp16 is refused (FSDP2 would need
a sharded scaler): use bf16 there.

Gradient checkpointing (`--gradient-checkpointing`): transformers' `gradient_checkpointing_enable`
with `use_reentrant=False` (works with FSDP2 and with frozen LoRA bases), enabled before sharding.

LoRA (`--lora-rank R`): `rlkit.training.lora` (peft); the optimizer then holds the adapter only.
Importable without torch: the option dataclasses are plain.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from rlkit.devices import TORCH_DTYPES  # noqa: F401 (fp32/bf16/fp16 -> torch's names)
from rlkit.errors import RlkitError
from rlkit.training.lora import LoraOptions, lora_options  # noqa: F401 (the options every trainer takes)

# micro-batch tokens on a GPU when neither --micro-batch-size nor --micro-batch-tokens is given (verl's
# ppo_max_token_len_per_gpu is 16k): one micro-batch's logits are then at most 16k x the vocabulary
GPU_MICRO_BATCH_TOKENS = 16_384
# minutes a collective waits for the other ranks under torchrun (--dist-timeout) before the process group gives up
# (NCCL's own default is 10). Where rank 0 works alone (a piped input, the checkpoint) the others wait outside any
# collective: rlkit.training.distributed.wait_for_main
DEFAULT_DIST_TIMEOUT = 60.0
# the longest --dist-timeout, in minutes (about 19 years): torch adds the timeout to steady-clock times held in
# int64 nanoseconds (292 years in all) and gloo's store counts it in microseconds, where 1e12 minutes overflow
MAX_DIST_TIMEOUT = 1e7
DTYPES = ("auto", "fp32", "bf16", "fp16")  # auto: bf16 on a GPU with bf16 kernels, fp32 on the CPU (rlkit.devices)


@dataclass(frozen=True)
class Optim:
    """AdamW's settings: rlkit's one set of optimizer defaults, for every training stage. A stage that wants
    another value says so in its config (sft: betas (0.9, 0.95), weight decay 0.01; train-rm: weight decay
    0.01), so the difference is visible there and in its manifest."""

    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # max gradient norm (None: no clipping)


@dataclass(frozen=True)
class TrainOptions:
    """How a stage trains: compute dtype, gradient checkpointing, LoRA (None: full fine-tuning), micro-batches
    (rows or tokens per forward/backward, gradients accumulating to one optimizer step) and packing."""

    dtype: str = "auto"
    gradient_checkpointing: bool = False
    lora: LoraOptions | None = None
    micro_batch_size: int | None = None  # rows per forward/backward; None: the whole step (or the token budget)
    micro_batch_tokens: int | None = None  # rows packed up to this many tokens per forward/backward
    packing: bool = True  # sequences concatenated without padding (rlkit.ops.packing); False: right-padded rows
    dist_timeout: float = DEFAULT_DIST_TIMEOUT  # minutes a torchrun collective may wait (not compared on rerun)

    def on(self, device) -> TrainOptions:
        """These options with --dtype auto made concrete for `device` (bf16 on a GPU with bf16, else fp32)."""
        from dataclasses import replace

        from rlkit import devices

        return replace(self, dtype=devices.auto_dtype(device, self.dtype))

    def micro_limits(self, device) -> tuple[int | None, int | None]:
        """(rows, tokens) per forward/backward pass on `device`: the flags, or on a GPU with neither given
        GPU_MICRO_BATCH_TOKENS tokens (a row longer than that default runs alone); (None, None): one pass."""
        if self.micro_batch_size is None and self.micro_batch_tokens is None and \
                getattr(device, "type", str(device)) == "cuda":
            return None, GPU_MICRO_BATCH_TOKENS
        return self.micro_batch_size, self.micro_batch_tokens

    def check(self, distributed: bool = False, step_rows: int | None = None, step_flag: str = "--minibatch-size") -> None:
        """Refuse bad settings with the flag's name; `step_rows`: the rows of one optimizer step (a
        --micro-batch-size above it is refused, naming `step_flag`)."""
        if self.dtype not in DTYPES:
            raise RlkitError(f"--dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        import math

        if not (math.isfinite(self.dist_timeout) and 0 < self.dist_timeout <= MAX_DIST_TIMEOUT):
            raise RlkitError(f"--dist-timeout {self.dist_timeout:g}: expected a number of minutes > 0 and "
                             f"<= {MAX_DIST_TIMEOUT:g}")
        for flag, v in (("--micro-batch-size", self.micro_batch_size), ("--micro-batch-tokens", self.micro_batch_tokens)):
            if v is not None and v < 1:
                raise RlkitError(f"{flag} {v}: expected an integer >= 1, or leave it out for the default: the whole "
                                 f"step in one forward pass on a CPU, micro-batches of {GPU_MICRO_BATCH_TOKENS} tokens "
                                 "on a GPU")
        if self.micro_batch_size is not None and self.micro_batch_tokens is not None:
            raise RlkitError("--micro-batch-size and --micro-batch-tokens both cut the optimizer step into micro-batches; "
                             "give one of them")
        if step_rows is not None and self.micro_batch_size is not None and self.micro_batch_size > step_rows:
            raise RlkitError(f"--micro-batch-size {self.micro_batch_size} is larger than {step_flag} {step_rows}, "
                             f"the rows of one optimizer step; expected at most {step_rows}")
        if self.dtype == "fp16" and distributed:
            raise RlkitError("--dtype fp16 under torchrun would need a sharded loss scaler, which rlkit does not run; "
                             "use --dtype bf16 (no scaler needed)")
        if self.lora is not None:
            lo = self.lora
            if lo.rank < 1:
                raise RlkitError(f"--lora-rank {lo.rank}: must be >= 1 (leave it out for full fine-tuning)")
            if lo.alpha is not None and lo.alpha <= 0:
                raise RlkitError(f"--lora-alpha {lo.alpha}: must be > 0")
            if not 0 <= lo.dropout < 1:
                raise RlkitError(f"--lora-dropout {lo.dropout}: must be in [0, 1)")


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


def enable_gradient_checkpointing(model) -> None:
    """transformers' non-reentrant gradient checkpointing. rlkit's training forwards pass
    use_cache=False themselves (a KV cache would hold every layer's keys and values); the saved
    config keeps use_cache for generation."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise RlkitError(f"{type(model).__name__} does not support gradient checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def prepare_model(model, opts: TrainOptions, kind: str = "causal-lm", base=None):
    """Gradient checkpointing, then LoRA: a fresh adapter on `model`, whose weights were loaded from
    directory `base` (None: built in memory, which LoRA refuses); a model already wrapped by peft (a
    LoRA checkpoint resumed) is kept as it is, and --lora-* flags must then be its own settings. Call
    before sharding (FSDP2) and before making the optimizer. `kind`: causal-lm | seq-cls."""
    if opts.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if opts.lora is not None:
        from rlkit.training import lora

        if not is_peft(model):
            model = lora.wrap(model, opts.lora, kind, base)
        else:
            lora.check_same(model, opts.lora)
    return model


def is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def make_adamw(model, lr: float, weight_decay: float, betas=(0.9, 0.99), eps: float = 1e-8):
    """AdamW over the trainable parameters only (LoRA: the adapter), weight decay off for norms and
    biases. Parameter order is `named_parameters` order, so optimizer state is saved by name."""
    import torch

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    fused = fused_adamw([p.device.type for p in decay + no_decay])
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=betas, eps=eps, **({"fused": True} if fused else {}),
    )


def fused_adamw(device_types: list[str]) -> bool:
    """Whether AdamW runs fused (one kernel for every parameter's update, no per-tensor launches): when every
    trained parameter is on a GPU (FSDP2's DTensor shards included). Elsewhere torch's default (foreach or a
    loop), so the CPU computes what it always has."""
    return bool(device_types) and all(t == "cuda" for t in device_types)


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
