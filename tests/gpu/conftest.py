"""The GPU tests: real `rlkit` processes on CUDA, run as a user runs them on a GPU machine (`make test-gpu`).

- Every test in this folder is marked `gpu` (and `slow`) here, so no test can forget it, and is skipped with one
  reason where torch sees no CUDA device (a CPU machine, or a CPU build of torch): NO_CUDA. Tests that take the
  `two_gpus` fixture are skipped with their own reason on a machine with one GPU.
- They run one at a time, on one pytest worker under `make test`'s xdist (xdist_group "gpu"): each may hold
  most of a GPU.
- RLKIT_REQUIRE_GPU=1 (set by `make test-gpu`) makes a run in which no GPU test passed a failure, so a machine
  without a GPU cannot pass `make test-gpu` by skipping everything.
- This pytest process never touches CUDA: every stage runs in its own `rlkit` process (what the GPU can do is
  asked in a subprocess, `gpu`), and the in-process checks (HF log-probs, LoRA checkpoints) run on the CPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import run_cli

HERE = Path(__file__).resolve().parent
NO_CUDA = "no CUDA device: the GPU tests need one (make test-gpu on a GPU machine)"
_passed: list[str] = []


def _cuda_devices() -> int:
    """CUDA devices torch sees (0: none, or a CPU build). Creates no CUDA context in this process."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.hookimpl(tryfirst=True)  # before `-m gpu` selects by marker and before xdist reads xdist_group
def pytest_collection_modifyitems(config, items):
    mine = [it for it in items if HERE in Path(it.path).resolve().parents]
    if not mine:
        return
    count = _cuda_devices()
    xdist = config.pluginmanager.hasplugin("xdist")
    for it in mine:
        it.add_marker(pytest.mark.gpu)
        it.add_marker(pytest.mark.slow)
        if xdist:
            it.add_marker(pytest.mark.xdist_group("gpu"))
        if count == 0:
            it.add_marker(pytest.mark.skip(reason=NO_CUDA))
        elif "two_gpus" in it.fixturenames and count < 2:
            it.add_marker(pytest.mark.skip(reason="one CUDA device visible: this test runs torchrun on 2 GPUs "
                                                  "(make test-gpu on a machine with 2 or more)"))


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed and "gpu" in report.keywords:
        _passed.append(report.nodeid)


def _nothing_ran(config) -> str | None:
    """RLKIT_REQUIRE_GPU=1 and no GPU test passed: why that fails (None otherwise; the controller decides under xdist)."""
    if os.environ.get("RLKIT_REQUIRE_GPU") != "1" or hasattr(config, "workerinput") or _passed:
        return None
    return (f"RLKIT_REQUIRE_GPU=1 but no GPU test ran and passed ({_cuda_devices()} CUDA devices visible to torch): "
            "the GPU tests prove nothing here")


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    if _nothing_ran(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    msg = _nothing_ran(config)
    if msg:
        terminalreporter.write_sep("!", msg, red=True, bold=True)


@pytest.fixture(scope="session")
def two_gpus() -> int:
    """A test that takes this runs on 2 GPUs (skipped, with its reason, where fewer are visible)."""
    return _cuda_devices()


@pytest.fixture(scope="session")
def gpu() -> dict:
    """What torch sees of the GPU the stages get by default (`--device auto`: the current device), asked in a
    subprocess: name, count, bf16, memory_gib."""
    code = ("import json, torch; d = torch.cuda.current_device(); p = torch.cuda.get_device_properties(d); "
            "print(json.dumps({'index': d, 'name': torch.cuda.get_device_name(d), 'count': torch.cuda.device_count(), "
            "'bf16': torch.cuda.is_bf16_supported(), 'memory_gib': p.total_memory / 2**30}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\nGPU: {info}", file=sys.stderr)
    return info


def auto_dtype(gpu: dict) -> str:
    """What `--dtype auto` trains in on this GPU (the contract: bf16 where the GPU has it, else fp32)."""
    return "bf16" if gpu["bf16"] else "fp32"


def vllm_half(gpu: dict) -> str:
    """The half-precision `rollout --dtype` for vLLM on this GPU."""
    return "bfloat16" if gpu["bf16"] else "float16"


def device_line(stderr: str, stage: str) -> str:
    """The stage's one `STAGE: device cuda:N (GPU NAME[, DTYPE])` line on stderr (printed once per process)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.startswith(f"{stage}: device ")]
    assert len(lines) == 1, f"{stage}: expected one device line on stderr, got {lines}"
    assert re.fullmatch(rf"{re.escape(stage)}: device cuda:\d+ \(.+\)", lines[0]), lines[0]
    return lines[0]


def on_cuda(manifest: dict, gpus: int = 1) -> None:
    """The manifest records the GPU the stage ran on: device cuda:N, the GPU's name, how many were visible."""
    assert re.fullmatch(r"cuda:\d+", str(manifest.get("device"))), manifest.get("device")
    assert manifest.get("gpu"), manifest.get("gpu")
    assert manifest.get("gpu_count", 0) >= gpus, manifest.get("gpu_count")


def metrics_rows(path: Path, stage: str) -> list[dict]:
    return [r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if r.get("stage") == stage]


def bash(script: str, timeout: float = 1800, **env: str) -> subprocess.CompletedProcess:
    """A shell pipe of real `rlkit` processes (set -euo pipefail)."""
    return subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "RLKIT_DEBUG": "0", **env})


@dataclass(frozen=True)
class Stage:
    """A finished stage: its output, its stderr, its manifest."""

    dir: Path
    stderr: str
    manifest: dict


@pytest.fixture(scope="session")
def cuda_sft(tmp_path_factory) -> Stage:
    """The tiny policy after a short SFT on the GPU, run as a user runs it: `rlkit sft --out DIR` with the
    defaults (--device auto, --dtype auto), the same size as tests/conftest.py's sft_dir."""
    out = tmp_path_factory.mktemp("gpu-sft") / "sft"
    r = run_cli("sft", "--out", str(out), "--num-examples", "1500", "--eval-num", "20", "--batch-tokens", "512",
                timeout=1200)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return Stage(out, r.stderr.decode(), json.loads((out / "rlkit.json").read_text()))


@pytest.fixture(scope="session")
def cuda_ref(cuda_sft, tmp_path_factory) -> Path:
    """`cuda_sft` frozen as the bf16 reference (freeze-ref runs no model)."""
    out = tmp_path_factory.mktemp("gpu-ref") / "ref"
    r = run_cli("freeze-ref", "--policy", str(cuda_sft.dir), "--out", str(out), "--dtype", "bf16")
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return out
