"""LoRA adapters (peft) for `sft`, `train-rm` and `update --lora-rank R`: wrap, save, load, merge.

A LoRA checkpoint is PEFT's own layout plus rlkit's manifest::

    adapter_config.json          PEFT: r, lora_alpha, target_modules, base_model_name_or_path (absolute)
    adapter_model.safetensors    PEFT: the adapter (and a reward model's or critic's `score` head)
    tokenizer.json ...           the tokenizer
    rlkit.json                   manifest; `lora`: the base's absolute path, its per-file weight sha256
                                 and digest, the LoRA settings; `weights_sha256` covers the adapter file
    trainer/                     (update) AdamW state of the adapter parameters only

so `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), dir)` loads it without rlkit.
Loading one through rlkit verifies the base's hashes first: an adapter only means something on the
exact weights it was trained on, and the base lives outside the checkpoint.

In memory a LoRA model is the transformers model peft injected its layers into
(`PeftModel.get_base_model()`), not the `PeftModel` wrapper: rlkit's forward helpers call
`model.base_model(...)` for the transformer trunk (FSDP sharding too), which on a `PeftModel` is peft's
`LoraModel` instead. The `PeftModel` (which saves the adapter) and the base's record ride along as
`model._rlkit_lora` (a `LoraState`); `training.is_peft(model)` is true for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KINDS = ("causal-lm", "seq-cls")
_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "seq-cls": "SEQ_CLS"}
# adapters start from the same random A in every process (peft draws it from the global RNG)
INIT_SEED = 0
# the ranks vLLM's LoRA kernels take (vllm.config.lora.MaxLoRARanks); an adapter's rank is rounded up
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoraOptions:
    """peft LoRA settings. `alpha` None: 2 x rank. `targets` empty: every linear layer of the
    transformer blocks (peft's "all-linear", never the output head)."""

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = ()

    @property
    def scale_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank


def lora_options(rank: int | None, alpha: float | None, dropout: float, targets: str | None) -> LoraOptions | None:
    """The CLI's four LoRA flags -> LoraOptions (None without --lora-rank); checked by TrainOptions.check."""
    if rank is None:
        if alpha is not None or dropout or targets:
            raise RlkitError("--lora-alpha/--lora-dropout/--lora-targets need --lora-rank R")
        return None
    names = tuple(t.strip() for t in (targets or "").split(",") if t.strip())
    return LoraOptions(rank=rank, alpha=alpha, dropout=dropout, targets=names)


@dataclass
class LoraState:
    """What a LoRA model carries for saving: its PeftModel, the base it sits on and how it was wrapped."""

    peft: Any  # peft.PeftModel over the model
    base: Path  # absolute
    base_sha256: dict[str, str]
    base_digest: str
    opts: LoraOptions
    kind: str  # causal-lm | seq-cls
    source: Path | None = None  # the LoRA checkpoint it was loaded from; None: a fresh adapter


def state(model) -> LoraState | None:
    return getattr(model, "_rlkit_lora", None)


def is_adapter_dir(d: str | Path) -> bool:
    return (Path(d) / ADAPTER_CONFIG).is_file()


def _attach(pm, st: LoraState):
    inner = pm.get_base_model()
    object.__setattr__(inner, "_rlkit_lora", st)  # not a submodule: no module cycle, not in state_dict
    return inner


def _peft_config(opts: LoraOptions, kind: str):
    from peft import LoraConfig

    return LoraConfig(r=opts.rank, lora_alpha=opts.scale_alpha, lora_dropout=opts.dropout,
                      target_modules=list(opts.targets) or "all-linear", task_type=_TASK_TYPES[kind],
                      modules_to_save=["score"] if kind == "seq-cls" else None)


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


def base_hashes(base: Path) -> tuple[dict[str, str], str]:
    """`checkpoints.hash_weights(base)`: each file read once per version of it (`artifacts.file_facts`)."""
    from rlkit.io.checkpoints import hash_weights

    return hash_weights(base)


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
            pm = get_peft_model(model, _peft_config(opts, kind))
        except ValueError as e:  # peft's NoMatchingPeftModuleError and friends
            raise RlkitError(f"--lora-targets: {str(e).splitlines()[0]}") from e
    pm.peft_config["default"].base_model_name_or_path = str(base)
    return _attach(pm, LoraState(pm, base, per_file, digest, opts, kind))


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


def save(model, tmp: Path, state_dict: dict | None = None) -> dict[str, Any]:
    """Write the adapter in PEFT's layout into `tmp`; returns the manifest's `lora` entry. `state_dict`:
    the gathered full weights of a sharded (FSDP) model, keyed as `model.state_dict()` is."""
    import peft

    st = state(model)
    sd = {"base_model.model." + k: v for k, v in state_dict.items()} if state_dict is not None else None
    st.peft.save_pretrained(tmp, safe_serialization=True, **({"state_dict": sd} if sd is not None else {}))
    cfg = st.peft.peft_config["default"]
    return {"base": str(st.base), "base_weights_sha256": st.base_sha256, "base_weights_digest": st.base_digest,
            "kind": st.kind, "rank": st.opts.rank, "alpha": st.opts.scale_alpha, "dropout": st.opts.dropout,
            "targets": list(st.opts.targets), "target_modules": sorted(cfg.target_modules or []),
            "peft_version": peft.__version__}


def _entry(d: Path) -> tuple[dict, dict]:
    """(the manifest's lora entry or {}, adapter_config.json)."""
    from rlkit.io.checkpoints import load_manifest

    try:
        acfg = json.loads((d / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise RlkitError(f"{d / ADAPTER_CONFIG} is unreadable ({e})") from e
    if acfg.get("peft_type", "LORA") != "LORA":
        raise RlkitError(f"{d} holds a {acfg.get('peft_type')} adapter; rlkit loads LoRA adapters only")
    return (load_manifest(d) or {}).get("lora") or {}, acfg


def verify_base(d: Path) -> tuple[Path, dict]:
    """(the base directory of LoRA checkpoint `d`, its lora entry) once the base's weights hash as
    recorded; one clear line naming both directories otherwise."""
    from rlkit import console
    from rlkit.io.checkpoints import weight_files

    entry, acfg = _entry(d)
    base = Path(entry.get("base") or acfg.get("base_model_name_or_path") or "")
    if not str(base) or str(base) == ".":
        raise RlkitError(f"LoRA checkpoint {d} names no base model (neither rlkit.json nor adapter_config.json)")
    if not base.is_dir() or not weight_files(base):
        raise RlkitError(f"LoRA checkpoint {d}: its base model {base} is missing (a LoRA checkpoint holds only the "
                         "adapter; put the base back at that path)")
    if is_adapter_dir(base):
        raise RlkitError(f"LoRA checkpoint {d}: its base {base} is itself a LoRA adapter; rlkit stacks no adapters")
    per_file, _ = base_hashes(base)
    want = entry.get("base_weights_sha256")
    if want is None:
        console.warn(f"LoRA checkpoint {d} records no hashes of its base {base} (not written by rlkit): using the "
                     "base unverified")
    elif per_file != want:
        names = sorted({n for n, _ in set(per_file.items()) ^ set(want.items())})
        raise RlkitError(f"LoRA checkpoint {d}: its base model {base} was changed since (sha256 mismatch in "
                         f"{', '.join(names)}); the adapter only fits the weights it was trained on: restore them "
                         "or train a new adapter")
    return base, entry


def kind_of(d: Path) -> str:
    """causal-lm (a policy's adapter) or seq-cls (a reward model's or critic's)."""
    entry, acfg = _entry(Path(d))
    return entry.get("kind") or {v: k for k, v in _TASK_TYPES.items()}.get(acfg.get("task_type"), "causal-lm")


def _opts_from(acfg: dict, entry: dict) -> LoraOptions:
    targets = entry.get("targets")
    if targets is None:  # a foreign adapter: the names peft resolved
        t = acfg.get("target_modules")
        targets = [t] if isinstance(t, str) else sorted(t or [])
    return LoraOptions(rank=int(acfg["r"]), alpha=float(acfg.get("lora_alpha") or 2 * acfg["r"]),
                       dropout=float(acfg.get("lora_dropout") or 0.0), targets=tuple(targets))


def _base_model(base: Path, kind: str, trust_remote_code: bool):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from rlkit.io.checkpoints import quiet_transformers

    quiet_transformers()
    if kind == "causal-lm":
        return AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, trust_remote_code=trust_remote_code,
                                                    use_safetensors=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a causal LM base has no `score`: the adapter file carries it
    try:
        return AutoModelForSequenceClassification.from_pretrained(
            str(base), num_labels=1, dtype=torch.float32, trust_remote_code=trust_remote_code, use_safetensors=True)
    finally:
        hf_logging.set_verbosity(verbosity)


def load(d: str | Path, kind: str = "causal-lm", *, merged: bool = False, dtype: str = "fp32",
         trust_remote_code: bool = False):
    """LoRA checkpoint `d` on its hash-verified base: a trainable LoRA model (its adapter keeps training), or
    with `merged` the plain model with the adapter merged into its weights (inference, freezing a reference).

    `kind` seq-cls from a causal-lm adapter (a reward model or critic started from a LoRA policy): the
    policy's adapter on the base's sequence-classification model, plus a new `score` head (trainable)."""
    import torch
    from peft import PeftModel, get_peft_model

    from rlkit.io.checkpoints import DTYPES

    d = Path(d).absolute()
    base, _ = verify_base(d)
    entry, acfg = _entry(d)
    have = kind_of(d)
    if have == "seq-cls" and kind == "causal-lm":
        raise RlkitError(f"{d} is a LoRA reward model (sequence classification), not a policy")
    model = _base_model(base, kind, trust_remote_code)
    opts = _opts_from(acfg, entry)
    if have == kind:
        pm = PeftModel.from_pretrained(model, str(d), is_trainable=not merged)
    else:
        cfg = _peft_config(opts, kind)
        cfg.target_modules = acfg.get("target_modules") or cfg.target_modules
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            pm = get_peft_model(model, cfg)
        _load_lora_weights(pm, d)
    if merged:
        plain = pm.merge_and_unload()
        plain.eval()
        return plain.to(getattr(torch, DTYPES[dtype]))
    pm.peft_config["default"].base_model_name_or_path = str(base)
    per_file, digest = base_hashes(base)
    return _attach(pm, LoraState(pm, base, per_file, digest, opts, kind, source=d))


def _load_lora_weights(pm, d: Path) -> None:
    """The lora_A/lora_B weights of adapter `d` into PeftModel `pm` (which may differ in its other trained
    modules: a policy's adapter on a reward model)."""
    import re

    from peft.utils import load_peft_weights

    sd = {re.sub(r"\.(lora_(?:embedding_)?[AB])(\.weight)?$", lambda m: f".{m[1]}.default{m[2] or ''}", k): v
          for k, v in load_peft_weights(str(d)).items() if ".lora_" in k}
    _, unexpected = pm.load_state_dict(sd, strict=False)
    if unexpected or not sd:
        raise RlkitError(f"{d}: its adapter weights do not fit the model ({', '.join(unexpected[:3]) or 'none'})")


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


def vllm_rank(rank: int) -> int | None:
    """The smallest max_lora_rank vLLM accepts for an adapter of `rank`; None above its largest."""
    return next((r for r in VLLM_RANKS if r >= rank), None)


def adapter_rank(d: Path) -> int:
    return int(_entry(d)[1]["r"])


def write_merged(d: Path, out: Path, trust_remote_code: bool = False) -> Path:
    """LoRA checkpoint `d` merged into its base, written as a plain Hugging Face directory `out`."""
    from rlkit.io.checkpoints import load_tokenizer, quiet_transformers

    model = load(d, "causal-lm", merged=True, trust_remote_code=trust_remote_code)
    quiet_transformers()
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(d, trust_remote_code).save_pretrained(out)
    return out
