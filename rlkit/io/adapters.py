"""The LoRA checkpoint on disk (PEFT's layout plus rlkit's manifest entry): save, verify its base, load, merge.

Training with adapters (wrapping a model, checking --lora-* flags) is `rlkit.training.lora`.

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


def attach(pm, st: LoraState):
    inner = pm.get_base_model()
    object.__setattr__(inner, "_rlkit_lora", st)  # not a submodule: no module cycle, not in state_dict
    return inner


def peft_config(opts: LoraOptions, kind: str):
    from peft import LoraConfig

    return LoraConfig(r=opts.rank, lora_alpha=opts.scale_alpha, lora_dropout=opts.dropout,
                      target_modules=list(opts.targets) or "all-linear", task_type=_TASK_TYPES[kind],
                      modules_to_save=["score"] if kind == "seq-cls" else None)


def base_hashes(base: Path) -> tuple[dict[str, str], str]:
    """`checkpoints.hash_weights(base)`: each file read once per version of it (`fingerprints.file_facts`)."""
    from rlkit.io.model_files import hash_weights

    return hash_weights(base)


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
    from rlkit.io.model_files import load_manifest

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
    from rlkit.io.model_files import weight_files

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

    from rlkit.io.model_files import quiet_transformers

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

    from rlkit.devices import TORCH_DTYPES as DTYPES

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
        cfg = peft_config(opts, kind)
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
    return attach(pm, LoraState(pm, base, per_file, digest, opts, kind, source=d))


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


def adapter_rank(d: Path) -> int:
    return int(_entry(d)[1]["r"])


def write_merged(d: Path, out: Path, trust_remote_code: bool = False) -> Path:
    """LoRA checkpoint `d` merged into its base, written as a plain Hugging Face directory `out`."""
    from rlkit.io.model_files import load_tokenizer, quiet_transformers

    model = load(d, "causal-lm", merged=True, trust_remote_code=trust_remote_code)
    quiet_transformers()
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(d, trust_remote_code).save_pretrained(out)
    return out
