"""A model made ready to train: gradient checkpointing and LoRA (`prepare_model`), and its AdamW
(`make_adamw`: the trainable parameters only, fused on a GPU).
"""

from __future__ import annotations

from rlkit.errors import RlkitError
from rlkit.training.options import TrainOptions


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
