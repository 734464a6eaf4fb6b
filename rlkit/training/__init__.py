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

The code: `rlkit.training.options` (the settings), `rlkit.training.precision`, `rlkit.training.model` (checkpointing,
LoRA, AdamW); the engine, supervised losses, data parallelism and resume in modules of their own.
"""

from rlkit.devices import TORCH_DTYPES
from rlkit.training.lora import LoraOptions, lora_options
from rlkit.training.model import (
    enable_gradient_checkpointing,
    fused_adamw,
    is_peft,
    make_adamw,
    prepare_model,
)
from rlkit.training.options import (
    DEFAULT_DIST_TIMEOUT,
    DTYPES,
    GPU_MICRO_BATCH_TOKENS,
    MAX_DIST_TIMEOUT,
    Optim,
    TrainOptions,
)
from rlkit.training.precision import Precision, fsdp_mp_policy, fsdp_param_dtype

__all__ = [
    "DEFAULT_DIST_TIMEOUT",
    "DTYPES",
    "GPU_MICRO_BATCH_TOKENS",
    "MAX_DIST_TIMEOUT",
    "TORCH_DTYPES",
    "LoraOptions",
    "Optim",
    "Precision",
    "TrainOptions",
    "enable_gradient_checkpointing",
    "fsdp_mp_policy",
    "fsdp_param_dtype",
    "fused_adamw",
    "is_peft",
    "lora_options",
    "make_adamw",
    "prepare_model",
]
