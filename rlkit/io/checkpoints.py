"""Model directories: Hugging Face `save_pretrained` layouts plus an `rlkit.json` manifest.

`AutoModelForCausalLM.from_pretrained(dir)` loads them without rlkit. The manifest records the
producing command, config, input fingerprints, training step and the sha256 of every weights file,
which is how a frozen reference proves it is unchanged.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlkit.devices import TORCH_DTYPES as DTYPES  # fp32/bf16/fp16 -> torch's names
from rlkit.errors import RlkitError
from rlkit.io.fingerprints import file_facts, sha256_file
from rlkit.io.manifests import MODEL_MANIFEST
from rlkit.io.model_files import (  # noqa: F401 (checkpoints.X is their public name)
    TOKENIZER_FILES,
    hash_weights,
    load_manifest,
    load_tokenizer,
    quiet_transformers,
    weight_files,
)

TINY = "tiny"

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}




# Every rlkit checkpoint a stage loads is checked against the sha256 its rlkit.json records (references
# always; policies, reward models and critics unless the stage runs with --no-verify).
_VERIFY: contextvars.ContextVar[bool] = contextvars.ContextVar("rlkit_verify_checkpoints", default=True)


@contextmanager
def verifying(enabled: bool = True) -> Iterator[None]:
    """Within the block, checkpoints are hash-checked on load (`enabled`) or not (`--no-verify`)."""
    token = _VERIFY.set(enabled)
    try:
        yield
    finally:
        _VERIFY.reset(token)


def check_model_dir(d: Path, what: str = "model", lora_base: bool = True, verify: bool | None = None) -> None:
    """A loadable model directory, or one clear line: config, tokenizer files and readable safetensors
    headers present; an rlkit checkpoint's weights match its rlkit.json and are finite (`verify`, default:
    unless --no-verify). A LoRA checkpoint: its base is verified too (hashed once per file version;
    `lora_base=False` skips that), so a stage refuses it before doing anything."""
    if not d.exists():
        raise RlkitError(f"{what} directory {d} not found")
    if not d.is_dir():
        raise RlkitError(f"{what} {d} is a file, expected a Hugging Face model directory")
    adapter = (d / "adapter_config.json").is_file()
    if adapter:  # a LoRA checkpoint (rlkit.io.adapters): the adapter, its base elsewhere
        if not (d / "adapter_model.safetensors").is_file():
            raise RlkitError(f"LoRA {what} {d} has no adapter_model.safetensors (rlkit loads safetensors only, never pickles)")
    else:
        if not (d / "config.json").is_file():
            raise RlkitError(f"{d} is not a model directory (no config.json); expected the --out of `rlkit sft` or a Hugging Face model")
        if not weight_files(d):
            raise RlkitError(f"{d} has no *.safetensors weights (rlkit loads safetensors only, never pickles)")
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise RlkitError(f"{what} {d} has no tokenizer files ({' or '.join(TOKENIZER_FILES[:2])}); every rlkit "
                         "checkpoint saves its tokenizer: copy the files of the model it came from")
    for f in weight_files(d):
        check_safetensors_header(f)
    if _VERIFY.get() if verify is None else verify:
        verify_weights(d, what)
    if adapter and lora_base:
        from rlkit.io import adapters

        adapters.verify_base(d.absolute())


def check_safetensors_header(f: Path) -> dict:
    """The parsed header of a safetensors file, or one line saying what is wrong with it (cheap: no
    tensor is read)."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise ValueError(f"{size} bytes, shorter than a header")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file's {size} bytes")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end != size:
            raise ValueError(f"tensors end at byte {8 + n + end} but the file has {size}: truncated or padded")
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        raise RlkitError(f"{f} is not a valid safetensors file ({e}); the checkpoint is damaged: "
                         "restore it or save it again") from None
    return header


def _nonfinite_tensor(f: Path) -> str | None:
    """The name of the first floating-point tensor in `f` holding NaN or inf, or None (reads every tensor)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as st:
        for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
            t = st.get_tensor(name)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return name
    return None


def verify_weights(d: Path, what: str = "model", manifest: dict | None = None) -> dict | None:
    """Check that every weights file of rlkit checkpoint `d` still has the sha256 its rlkit.json records
    and holds finite numbers; one line naming the file otherwise. A directory without recorded hashes (a
    plain Hugging Face model) passes. Each file version is read once, whatever the process
    (`fingerprints.file_facts`). Returns the manifest."""
    m = manifest if manifest is not None else load_manifest(d)
    want = (m or {}).get("weights_sha256")
    if not want:
        return m
    have = {f.name for f in weight_files(d)}
    missing = sorted(set(want) - have)
    if missing:
        raise RlkitError(f"{what} {d} lacks weights files its rlkit.json records ({', '.join(missing)}); "
                         "the checkpoint is incomplete: restore it")
    facts = {name: file_facts(d / name, {"sha256": sha256_file}) for name in sorted(have)}
    bad = sorted(n for n in have if want.get(n) != facts[n]["sha256"])
    if bad:
        if what == "reference":
            raise RlkitError(f"reference {d} was modified after freezing: sha256 mismatch in {', '.join(bad)}; "
                             "refusing to use it (re-run `rlkit freeze-ref`)")
        raise RlkitError(f"{what} {d} fails its hash check (sha256 mismatch in {', '.join(bad)}): the checkpoint was "
                         "changed or damaged after it was written; refusing to load it (restore it, or pass "
                         "--no-verify to load it anyway)")
    for name in sorted(have):
        t = file_facts(d / name, {"sha256": sha256_file, "nonfinite": _nonfinite_tensor})["nonfinite"]
        if t:
            raise RlkitError(f"{what} {d}: {name} holds NaN or inf values (tensor {t}); the checkpoint is unusable "
                             "(saved from a diverged run?)")
    return m


def check_finite(model, src: str | Path, what: str = "model") -> None:
    """One line naming the first parameter or buffer of a loaded model that holds NaN or inf."""
    import torch

    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise RlkitError(f"{what} {src}: weight {name} holds NaN or inf values; the checkpoint is "
                                 "unusable (saved from a diverged run?)")


def safetensors_summary(d: Path) -> dict[str, Any]:
    """Parameter count, bytes and dtypes from the safetensors headers alone (no torch needed)."""
    params, nbytes, dtypes = 0, 0, set()
    for f in weight_files(d):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for s in t["shape"]:
                count *= s
            params += count
            nbytes += count * _DTYPE_BYTES.get(t["dtype"], 0)
            dtypes.add(t["dtype"])
    return {"parameters": params, "bytes": nbytes, "dtypes": sorted(dtypes)}


def save_model(model, tokenizer, tmp: Path, manifest: dict[str, Any], state_dict: dict | None = None,
               write_manifest: bool = True) -> dict[str, Any]:
    """Save into `tmp` (an `atomic_dir`), hash the weights and write the manifest; returns it.
    `state_dict`: the gathered full weights of a sharded (FSDP) model. `write_manifest=False` leaves
    writing it to the caller (`rlkit.io.follow.publish` writes it last). A LoRA model (`rlkit.io.adapters`) saves
    its adapter in PEFT's layout, and the manifest's `lora` entry names its base and the base's hashes."""
    from rlkit.io import adapters

    quiet_transformers()
    # before the save: save_pretrained empties a state dict it is given as it writes it
    dtype = _weights_dtype(state_dict if state_dict is not None else model.state_dict())
    if adapters.state(model) is not None:
        manifest = {**manifest, "lora": adapters.save(model, tmp, state_dict)}
    else:
        model.save_pretrained(tmp, safe_serialization=True, **({"state_dict": state_dict} if state_dict is not None else {}))
    tokenizer.save_pretrained(tmp)
    per_file, digest = hash_weights(tmp)
    manifest = {**manifest, "weights_sha256": per_file, "weights_digest": digest, "weights_dtype": dtype}
    if write_manifest:
        (tmp / MODEL_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _weights_dtype(sd: dict) -> str:
    """The stored dtype of the floating-point weights (fp32 for every rlkit-trained checkpoint: the
    master weights, whatever --dtype computed in), as fp32/bf16/fp16, or a mix joined by '+'."""
    names = {v: k for k, v in DTYPES.items()}
    found = sorted({str(t.dtype).removeprefix("torch.") for t in sd.values() if t.is_floating_point()})
    return "+".join(names.get(d, d) for d in found)


def load_policy(src: str | Path, dtype: str = "fp32", trust_remote_code: bool = False, merged: bool = False,
                weightless: bool = False):
    """A trainable causal LM and its tokenizer from a directory or hub id (never a pickle).

    A LoRA checkpoint loads on its hash-verified base (`rlkit.io.adapters.load`): a model whose adapter keeps
    training, or with `merged` (inference: rollout, eval, freeze-ref) the plain model, adapter merged.
    `weightless` (a data-parallel rank other than 0): the model built from its config on the meta device, no
    weight read; `rlkit.training.distributed.shard_model` fills its shards from rank 0's weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_transformers()
    p = Path(src)
    if p.exists() or str(src).startswith((".", "/")):
        check_model_dir(p, "policy")
        from rlkit.io import adapters

        if weightless and not adapters.is_adapter_dir(p):
            config = AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, DTYPES[dtype]),
                                                         trust_remote_code=trust_remote_code)
            return model, load_tokenizer(p, trust_remote_code)
        if adapters.is_adapter_dir(p):
            model = adapters.load(p, "causal-lm", merged=merged, dtype=dtype, trust_remote_code=trust_remote_code)
            check_finite(model, src, "policy")
            return model, load_tokenizer(p, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(src), dtype=getattr(torch, DTYPES[dtype]), trust_remote_code=trust_remote_code,
            use_safetensors=True,
        )
    except OSError as e:
        raise RlkitError(f"cannot load model {src}: {str(e).splitlines()[0]}") from e
    check_finite(model, src, "policy")
    return model, load_tokenizer(src, trust_remote_code)


def load_weights(d: Path) -> dict:
    """Every tensor of a safetensors checkpoint directory, in its stored dtype (no model built)."""
    from safetensors.torch import load_file

    out: dict = {}
    for f in weight_files(d):
        out.update(load_file(str(f)))
    return out


def load_weights_into(model, d: Path) -> None:
    """Copy checkpoint `d`'s safetensors into a live model of the same architecture, in place (tied
    weights stay tied: a tensor the checkpoint leaves out must share storage with one it holds). A LoRA
    checkpoint's weights are its base's with the adapter merged in."""
    from rlkit.io import adapters

    sd = adapters.load(d, merged=True).state_dict() if adapters.is_adapter_dir(d) else load_weights(d)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected:
        raise RlkitError(f"{d} holds weights this model does not have ({', '.join(sorted(unexpected)[:3])}); "
                         "is it the same architecture?")
    loaded = {p.data_ptr() for n, p in model.state_dict().items() if n in sd}
    untied = [n for n in missing if model.state_dict()[n].data_ptr() not in loaded]
    if untied:
        raise RlkitError(f"{d} lacks weights {', '.join(sorted(untied)[:3])}; is it the same architecture?")


def policy_step(src: str | Path) -> int:
    m = load_manifest(Path(src)) if Path(src).is_dir() else None
    return int(m.get("step", 0)) if m else 0


def verify_reference(d: Path) -> dict[str, Any]:
    """Check that a reference made by `freeze-ref` still has the weights it was frozen with (always,
    --no-verify or not: a reference is frozen provably)."""
    check_model_dir(d, "reference", verify=False)
    m = load_manifest(d)
    if m is None or m.get("kind") != "reference":
        raise RlkitError(f"{d} is not a frozen reference (make one with `rlkit freeze-ref --policy DIR --out {d}`)")
    verify_weights(d, "reference", m)
    return m


def load_reference(d: Path, device: str = "cpu", trust_remote_code: bool = False, compute_dtype: str = "stored"):
    """The frozen reference: hash-verified, requires_grad=False, eval mode.

    `compute_dtype` "stored" keeps the frozen dtype; "fp32" upcasts after the hash check (CPUs without
    fast bf16 kernels run fp32 several times faster; the stored weights stay what was frozen).
    """
    import torch
    from transformers import AutoModelForCausalLM

    m = verify_reference(d)
    quiet_transformers()
    dtype = DTYPES[m["config"]["dtype"]] if compute_dtype == "stored" else DTYPES[compute_dtype]
    model = AutoModelForCausalLM.from_pretrained(
        str(d), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code, use_safetensors=True,
    ).to(device)
    check_finite(model, d, "reference")
    model.eval()
    model.requires_grad_(False)
    return model, load_tokenizer(d, trust_remote_code), m


def load_teacher(d: Path, device=None, trust_remote_code: bool = False, dtype: str = "fp32"):
    """A teacher for on-policy distillation (`score-ref --teacher`): any causal LM checkpoint (an rlkit policy
    is hash-checked against its rlkit.json unless --no-verify; a LoRA one merged into its verified base), frozen:
    requires_grad=False, eval mode, on `device` in `dtype` (fp32, bf16, fp16)."""
    from rlkit.devices import TORCH_DTYPES

    model, _ = load_policy(d, "fp32", trust_remote_code, merged=True)
    if dtype != "fp32":
        import torch

        model.to(getattr(torch, TORCH_DTYPES[dtype]))
    model.eval()
    model.requires_grad_(False)
    return model.to(device) if device is not None else model


def tokenizer_fingerprint(tokenizer) -> str:
    """Identity of a tokenizer's id mapping: same vocabulary and special tokens -> same string."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items())
    return "tok:" + hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()[:16]
