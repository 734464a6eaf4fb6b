"""LoRA training (peft) for `sft`, `train-rm` and `update --lora-rank R`: the --lora-* options, wrapping a model in a
fresh adapter, checking a continued adapter's settings, the merged weights for the drift figure.

The checkpoint format (save, load, base verification) is `rlkit.io.adapters`.
"""

from __future__ import annotations

from pathlib import Path

from rlkit.errors import RlkitError
from rlkit.io.adapters import (
    INIT_SEED,
    KINDS,
    LoraOptions,
    LoraState,
    attach,
    base_hashes,
    is_adapter_dir,
    peft_config,
    state,
)


def lora_options(rank: int | None, alpha: float | None, dropout: float, targets: str | None) -> LoraOptions | None:
    """The CLI's four LoRA flags -> LoraOptions (None without --lora-rank); checked by TrainOptions.check."""
    if rank is None:
        if alpha is not None or dropout or targets:
            raise RlkitError("--lora-alpha/--lora-dropout/--lora-targets need --lora-rank R")
        return None
    names = tuple(t.strip() for t in (targets or "").split(",") if t.strip())
    return LoraOptions(rank=rank, alpha=alpha, dropout=dropout, targets=names)


def _check_targets(model, targets: tuple[str, ...]) -> None:
    """Every --lora-targets name must name a module (peft's rule: the full name or its last parts);
    peft itself ignores a name that matches nothing as long as another one matches."""
    import torch

    names = [n for n, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise RlkitError(f"--lora-targets {','.join(missing)}: no module of {type(model).__name__} is named so "
                         f"(its linear layers: {', '.join(linear)})")


def wrap(model, opts: LoraOptions, kind: str, base: str | Path | None):
    """A fresh LoRA adapter (B = 0: the model computes what it did) on `model`, whose weights were loaded
    from directory `base`; only the adapter (and a seq-cls model's `score` head) stays trainable."""
    import torch
    from peft import get_peft_model

    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {KINDS}")
    if base is None or not Path(base).is_dir():
        raise RlkitError("--lora-rank: a LoRA base must be a saved model directory (the adapter records its path "
                         "and weight hashes), not a model built in memory (`--model tiny`) or a hub id: save or "
                         "download it to a directory first (e.g. `rlkit sft --out BASE`) and start from that")
    base = Path(base).absolute()
    if is_adapter_dir(base):
        raise RlkitError(f"{base} is a LoRA checkpoint; load it with checkpoints.load_policy to keep training it")
    _check_targets(model, opts.targets)
    per_file, digest = base_hashes(base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        try:
            pm = get_peft_model(model, peft_config(opts, kind))
        except ValueError as e:  # peft's NoMatchingPeftModuleError and friends
            raise RlkitError(f"--lora-targets: {str(e).splitlines()[0]}") from e
    pm.peft_config["default"].base_model_name_or_path = str(base)
    return attach(pm, LoraState(pm, base, per_file, digest, opts, kind))


def hold_base(model, dtype: str, device) -> int:
    """LoRA training in bf16 on a GPU (`dtype` the concrete --dtype, `device` where the model trains): the frozen
    base's linear layers (their weights and biases: nearly every weight of a transformer, the output head included)
    held in bf16, cast on the host before the move, so the base takes half the memory and autocast no longer copies
    it to bf16 at every forward. The adapter, any trained head and their AdamW state stay fp32, and so do the
    embeddings and norms (a bf16 embedding would put the residual stream in bf16, where autocast keeps it fp32; an
    output head tied to the embedding stays with it). Anywhere else (the CPU, fp32, fp16, no LoRA) nothing changes.
    Returns the number of tensors cast. Before FSDP2 shards a model this is not called: its mixed-precision policy
    gathers the weights in bf16 itself."""
    if state(model) is None or dtype != "bf16" or getattr(device, "type", str(device)) != "cuda":
        return 0
    import torch

    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    n = 0
    for m in model.modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        for p in m.parameters(recurse=False):
            if not p.requires_grad and p.is_floating_point() and p.dtype != torch.bfloat16 and id(p) not in embeddings:
                p.data = p.data.to(torch.bfloat16)
                n += 1
    return n


def options_of(model) -> LoraOptions | None:
    st = state(model)
    return st.opts if st is not None else None


def check_same(model, opts: LoraOptions) -> None:
    """Continuing a LoRA checkpoint with --lora-* flags: they must be the checkpoint's own settings."""
    st = state(model)
    have = st.opts
    if (opts.rank, opts.scale_alpha, opts.dropout) != (have.rank, have.scale_alpha, have.dropout) or (
            opts.targets and sorted(opts.targets) != sorted(have.targets)):
        where = st.source or st.base
        raise RlkitError(
            f"LoRA checkpoint {where} has rank {have.rank}, alpha {have.scale_alpha:g}, dropout {have.dropout:g}, "
            f"targets {','.join(have.targets) or 'all-linear'}; --lora-* asks for rank {opts.rank}, alpha "
            f"{opts.scale_alpha:g}, dropout {opts.dropout:g}, targets {','.join(opts.targets) or 'all-linear'}: a "
            "LoRA checkpoint keeps training its own adapter (leave out the --lora-* flags, or start a new adapter "
            "from a full model)")


def plain_state_dict(model, sd: dict | None = None) -> dict:
    """The weights a merged copy of `model` would have, under the plain model's names, without merging the
    live model (for the drift figure). `sd`: a gathered (FSDP) full state dict keyed like `model`'s.
    A model without LoRA: its state dict as it is."""
    sd = dict(model.state_dict()) if sd is None else sd
    if state(model) is None:
        return sd
    scaling = {n: m.scaling["default"] for n, m in model.named_modules()
               if isinstance(getattr(m, "scaling", None), dict) and "default" in m.scaling}
    out = {}
    for k, v in sd.items():
        if ".lora_" in k or ".original_module." in k:
            continue
        if ".base_layer." in k:
            mod, _, leaf = k.partition(".base_layer.")
            if leaf == "weight" and mod in scaling:
                a, b = sd.get(f"{mod}.lora_A.default.weight"), sd.get(f"{mod}.lora_B.default.weight")
                if a is not None:  # Linear: W + s * B A
                    v = v + (scaling[mod] * (b.float() @ a.float())).to(v.dtype)
                else:  # Embedding: W + s * (B A)^T
                    a, b = sd[f"{mod}.lora_embedding_A.default"], sd[f"{mod}.lora_embedding_B.default"]
                    v = v + (scaling[mod] * (b.float() @ a.float()).T).to(v.dtype)
            out[f"{mod}.{leaf}"] = v
        else:
            out[k.replace(".modules_to_save.default.", ".")] = v
    return out
