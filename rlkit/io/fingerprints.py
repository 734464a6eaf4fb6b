"""Fingerprints of input files and directories (recorded in manifests for the rerun rule) and content hashes of
weights, cached per file version so an unchanged checkpoint is read once."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError

# Files at least this big are fingerprinted by (size, mtime) instead of content: cheap for
# multi-GB checkpoints, still changes whenever a file is rewritten.
CONTENT_HASH_LIMIT = 64 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# The verified-weights cache: what is known of a file while its (device, inode, size, mtime, ctime) stay
# the same: its sha256 and whether its tensors are all finite. Any write to the file changes mtime and
# ctime (and a user cannot set ctime back), so a hit is the same bytes. One small JSON file per entry
# under $RLKIT_CACHE_DIR (default $XDG_CACHE_HOME/rlkit or ~/.cache/rlkit), shared by every process;
# an unwritable cache only means hashing again.
_FACTS: dict[str, dict] = {}


CACHE_ENTRIES = 4096


def cache_dir() -> Path:
    if os.environ.get("RLKIT_CACHE_DIR"):
        return Path(os.environ["RLKIT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlkit"


def _facts_key(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}"


def file_facts(path: Path, compute: Mapping[str, Callable[[Path], Any]]) -> dict:
    """The cached facts named in `compute` about `path`, computing (and caching) the missing ones."""
    key = _facts_key(path)
    facts = _FACTS.get(key)
    store = cache_dir() / "files" / f"{key}.json"
    if facts is None:
        try:
            facts = json.loads(store.read_text())
        except (OSError, ValueError):
            facts = {}
    missing = [name for name in compute if name not in facts]
    for name in missing:
        facts[name] = compute[name](path)
    _FACTS[key] = facts
    if missing:
        _store_facts(store, facts)
    return facts


def _store_facts(store: Path, facts: dict) -> None:
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_name(f".{store.name}.{os.getpid()}")
        tmp.write_text(json.dumps(facts))
        os.replace(tmp, store)
        entries = list(os.scandir(store.parent))
        if len(entries) > CACHE_ENTRIES:  # drop the oldest half
            entries.sort(key=lambda e: e.stat().st_mtime)
            for e in entries[: len(entries) // 2]:
                os.unlink(e.path)
    except OSError:
        pass


def sha256_cached(path: Path) -> str:
    """`sha256_file`, read once per file version (see `file_facts`)."""
    return file_facts(path, {"sha256": sha256_file})["sha256"]


def fingerprint(path: str | Path) -> str:
    """A cheap identity for an input file or directory, recorded in manifests for rerun checks.

    Small files are hashed by content; big ones (weights) by size and mtime, so a multi-GB
    checkpoint costs a stat, not a read. Rewriting any file changes the fingerprint.
    """
    p = Path(path)
    if not p.exists():
        raise RlkitError(f"{p}: no such file or directory")
    h = hashlib.sha256()
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    for q in files:
        st = q.stat()
        h.update(str(q.relative_to(p) if p.is_dir() else q.name).encode() + b"\0")
        if st.st_size < CONTENT_HASH_LIMIT:
            h.update(sha256_file(q).encode())
        else:
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return "sha256:" + h.hexdigest()


def refuse_policy_itself(what: str, model: str, policies, whose: str, why: str) -> None:
    """A model that scores a policy's samples (a judge, a teacher) and is that policy: `model`, its fingerprint, is
    one of `policies` (the sampling policies' fingerprints). One line: `what` is `whose` itself, and `why` that is
    no use."""
    if model in policies:
        raise RlkitError(f"{what} is {whose} itself (the same weights' fingerprint): {why}")


def stream_fingerprint(manifest: Mapping[str, Any] | None) -> str:
    """Identity of a table read from a pipe: its producer's manifest (which names its inputs)."""
    blob = json.dumps(manifest, sort_keys=True).encode()
    return "stream:" + hashlib.sha256(blob).hexdigest()
