"""Shared fixtures: a real tiny SFT checkpoint (trained briefly, once per session) and CLI helpers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The verified-weights cache (rlkit.io.fingerprints.file_facts) of this test session, not the user's ~/.cache.
os.environ.setdefault("RLKIT_CACHE_DIR", tempfile.mkdtemp(prefix="rlkit-test-cache-"))


def rlkit_cmd() -> list[str]:
    return [sys.executable, "-m", "rlkit"]


def run_cli(*args: str, cwd: Path | None = None, input: bytes | None = None, env: dict | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real `rlkit` command in a subprocess (stdin is a pipe unless `input` is None)."""
    e = {**os.environ, "RLKIT_DEBUG": "0", **(env or {})}
    return subprocess.run([*rlkit_cmd(), *args], cwd=cwd, input=input if input is not None else b"",
                          capture_output=True, env=e, timeout=timeout)


def stage(*args: str) -> None:
    """Run one rlkit command in this process, through the CLI's own option parsing and defaults: for the
    inputs a test builds (rollouts, preferences, scored tables) but is not about. It saves a Python start
    and the torch/transformers imports, about 5 seconds a call; what a test checks runs in a subprocess."""
    from rlkit.cli import command

    rv = command().main(args=list(args), prog_name="rlkit", standalone_mode=False)
    assert rv in (None, 0), f"rlkit {' '.join(args)} exited {rv}"


def default_signals() -> None:
    """`preexec_fn` for a child a test will signal: SIGINT and SIGTERM at their defaults, whatever this
    process inherited (a suite started from a background job of a non-interactive shell runs with SIGINT
    ignored, and a Python child that inherits that installs no KeyboardInterrupt handler)."""
    import signal

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)


@contextlib.contextmanager
def tmpfs(d: Path, size: str):
    """A real file system of `size` (tmpfs, e.g. "4k") mounted at the new folder `d`, for out-of-space tests;
    skips the test where this process may not mount one (needs root with CAP_SYS_ADMIN)."""
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root with CAP_SYS_ADMIN")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """Bad input: non-zero exit, exactly one `rlkit: error:` line on stderr, no traceback."""
    lines = r.stderr.decode().strip().splitlines()
    assert r.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("rlkit: error:"), lines
    assert "Traceback" not in r.stderr.decode()
    return lines[0]


@pytest.fixture(scope="session")
def sft_dir(tmp_path_factory) -> Path:
    """A tiny policy after a short real SFT run (a few seconds)."""
    from rlkit.stages.sft import SftConfig, run

    out = tmp_path_factory.mktemp("ckpt") / "sft"
    run(SftConfig(out=out, num_examples=1500, eval_num=20, batch_tokens=512))
    return out


@pytest.fixture(scope="session")
def ref_dir(sft_dir, tmp_path_factory) -> Path:
    from rlkit.stages.freeze_ref import FreezeRefConfig, run

    out = tmp_path_factory.mktemp("ref") / "ref"
    run(FreezeRefConfig(policy=sft_dir, out=out, dtype="bf16"))
    return out


def updates_in_one_process(model, tok, cfg, tables: list[Path]):
    """The updates `rlkit update` runs, one per rollouts table, in this process with one Trainer (optimizer
    kept in memory): what N sequential `update` processes must equal. -> the TrainerState after them."""
    from rlkit.algorithms.inputs import build_batch
    from rlkit.io import streams
    from rlkit.training.trainer import Trainer

    trainer = Trainer(model, cfg, tokenizer=tok)
    for src in tables:
        t, _ = streams.read_table(src, ["rollouts"])
        batch, _ = build_batch(t, tok.pad_token_id)
        trainer.train(batch, temperature=1.0, length_norm=16.0)
    return trainer.state


def make_lora_checkpoint(base: Path, out: Path, seed: int, rank: int = 4) -> Path:
    """A LoRA checkpoint on plain checkpoint `base`, saved as `update` saves one, with an adapter far from
    zero (a fresh adapter has B = 0 and computes what its base does)."""
    import torch

    from rlkit import training
    from rlkit.io import checkpoints, manifests
    from rlkit.training import LoraOptions, TrainOptions

    model, tok = checkpoints.load_policy(base)
    model = training.prepare_model(model, TrainOptions(lora=LoraOptions(rank=rank)), "causal-lm", base=base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    out.mkdir(parents=True)
    checkpoints.save_model(model, tok, out, manifests.make_manifest("model", "test", {}, {}, step=0))
    return out


@pytest.fixture(scope="session")
def vllm_ok() -> None:
    r = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no error text"])[-1]
        msg = f"vLLM does not import in this environment, vLLM engine tests NOT RUN: {why}"
        if os.environ.get("RLKIT_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        print(f"\n*** {msg} ***", file=sys.stderr)
        pytest.skip(msg)


# The longest files first: with two pytest-xdist workers (by file) they then run beside the short ones
# instead of alone at the end.
_FIRST = ("test_recipes.py", "test_vllm.py", "test_follow_vllm.py", "test_lora_vllm.py", "test_follow.py", "test_lora.py",
          "test_distributed.py")


def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    def rank(it) -> tuple[int, int]:
        return (0 if it.name.startswith("test_every_recipe_runs") else 1,
                _FIRST.index(it.path.name) if it.path.name in _FIRST else len(_FIRST))

    items.sort(key=rank)
