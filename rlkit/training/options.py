"""How a stage trains: the flags' settings (`Optim`, AdamW's; `TrainOptions`: --dtype, gradient checkpointing,
LoRA, micro-batches, packing) and the defaults they fall back on. Importable without torch: the option
dataclasses are plain.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlkit.errors import RlkitError
from rlkit.io.adapters import LoraOptions

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
