"""The files of a model directory, below the checkpoint logic: its weights files and their hashes, its `rlkit.json`
manifest, its tokenizer, and transformers' loader kept quiet. `rlkit.io.checkpoints` (verification, loading,
saving) and `rlkit.io.adapters` (the LoRA format) both build on it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rlkit.errors import RlkitError
from rlkit.io.fingerprints import sha256_cached
from rlkit.io.manifests import MODEL_MANIFEST

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def weight_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def hash_weights(d: Path) -> tuple[dict[str, str], str]:
    """sha256 of each weights file and one digest over all of them (each file read once per version of
    it, whatever the number of processes: `fingerprints.file_facts`)."""
    per_file = {f.name: sha256_cached(f) for f in weight_files(d)}
    digest = hashlib.sha256(json.dumps(per_file, sort_keys=True).encode()).hexdigest()
    return per_file, digest


def load_manifest(d: Path) -> dict | None:
    m = d / MODEL_MANIFEST
    if not m.is_file():
        return None
    try:
        manifest = json.loads(m.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise RlkitError(f"{m} is not valid JSON ({e}); the checkpoint's manifest is damaged") from None
    if not isinstance(manifest, dict):
        raise RlkitError(f"{m} is not a JSON object; the checkpoint's manifest is damaged")
    return manifest


def quiet_transformers() -> None:
    """No per-load progress bars on stderr (stages print their own one-line summaries), and transformers'
    log records go to Python's root logger: the command's one handler (rlkit.console.set_level)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


def load_tokenizer(src: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src), trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise RlkitError(f"{src}: tokenizer has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok
