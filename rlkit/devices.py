"""Where a stage's models run: `--device auto|cpu|cuda|cuda:N`, and what follows from the choice.

`auto` (every stage's default) is `cuda:LOCAL_RANK` under a launcher (torchrun sets LOCAL_RANK, even
for one process), `cuda` (the current CUDA device, cuda:0 unless CUDA_VISIBLE_DEVICES says otherwise)
when torch sees a GPU, else `cpu`. `--dtype auto` follows it: bf16 autocast over fp32 master weights
on a GPU with bf16 kernels, fp32 on the CPU, so a CPU run computes exactly what it did before the
device became a choice.

Also here: the one line each stage prints about its device, the manifest's record of it, moving a
batch of tensors to the device once (pinned, non-blocking), the peak-memory figure, and the
out-of-memory error turned into one line that names the flags that lower memory.

Importable without torch (`rlkit --help` stays light): torch is imported by the functions that need it.
"""

from __future__ import annotations

import os
import re
from typing import Any

from rlkit.errors import RlkitError

HELP = ("Where the models run: auto (cuda:LOCAL_RANK under torchrun, else cuda when a GPU is visible, else cpu), "
        "cpu, cuda or cuda:N.")
_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


class OutOfMemory(RlkitError):
    """The device (or the host) ran out of memory: the flags in force and the ones that lower memory."""

    exit_code = 71  # EX_OSERR: a resource the system could not give


def parse(spec: str) -> tuple[str, int | None]:
    """'cuda:1' -> ('cuda', 1); checks the spelling only (no torch)."""
    m = _SPEC.match(spec.strip().lower()) if isinstance(spec, str) else None
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise RlkitError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N (e.g. cuda:0)")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def launcher_local_rank() -> int | None:
    """LOCAL_RANK when a launcher (torchrun) started this process, else None."""
    v = os.environ.get("LOCAL_RANK")
    return int(v) if v is not None and v.strip().isdigit() else None


def resolve(spec: str = "auto"):
    """--device -> torch.device. `cuda` or `cuda:N` that this machine cannot give is one line (exit 2)."""
    import torch

    kind, index = parse(spec)
    if kind == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if kind == "auto":
        if not available:
            return torch.device("cpu")
        local = launcher_local_rank()
        return _on_cuda(torch.device("cuda", local if local is not None else torch.cuda.current_device()))
    if not available:
        raise RlkitError(f"--device {spec}: CUDA is not available here (torch {torch.__version__} sees no GPU); "
                         "use --device auto or --device cpu")
    count = torch.cuda.device_count()
    if index is None:
        local = launcher_local_rank()
        index = local if local is not None else torch.cuda.current_device()
    if index >= count:
        raise RlkitError(f"--device {spec}: this machine has {count} GPU{'s' if count != 1 else ''} "
                         f"(cuda:0{f'..cuda:{count - 1}' if count > 1 else ''})")
    return _on_cuda(torch.device("cuda", index))


def _on_cuda(device):
    """`device` (a CUDA device a stage is about to run on), with TF32 switched on (`enable_tf32`)."""
    enable_tf32()
    return device


def enable_tf32() -> None:
    """TF32 tensor cores for the fp32 matmuls and convolutions a stage runs on a GPU (all of them under
    `--dtype fp32`; under bf16 autocast those it leaves in fp32): cuBLAS and cuDNN only, what
    `torch.set_float32_matmul_precision("high")` means for CUDA; the CPU's matmuls are untouched.
    `NVIDIA_TF32_OVERRIDE=0` in the environment holds cuBLAS to IEEE fp32 whatever torch says."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def tf32_enabled() -> bool:
    import torch

    return bool(torch.backends.cuda.matmul.allow_tf32)


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype -> torch's names


def auto_dtype(device, dtype: str = "auto") -> str:
    """--dtype auto -> bf16 on a GPU with bf16 kernels, fp32 elsewhere; any other value stays."""
    if dtype != "auto":
        return dtype
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "fp32"


def describe(device, dtype: str | None = None) -> str:
    """'cuda:0 (NVIDIA H100 80GB HBM3, bf16)', 'cpu (fp32)'."""
    parts = []
    if device.type == "cuda":
        import torch

        parts.append(torch.cuda.get_device_name(device))
    if dtype:
        parts.append(dtype)
    return f"{device}" + (f" ({', '.join(parts)})" if parts else "")


def announce(stage: str, device, dtype: str | None = None) -> None:
    """Say the device a stage works on, once its models are loaded: the end of its start-up (`rlkit.startup`)."""
    from rlkit import console, startup

    startup.done()
    console.info(f"{stage}: device {describe(device, dtype)}")


def manifest_entry(device) -> dict[str, Any]:
    """What the manifest records: {'device': 'cuda:0', 'gpu': NAME, 'gpu_count': N, 'tf32': bool} or
    {'device': 'cpu'}."""
    if device.type != "cuda":
        return {"device": str(device)}
    import torch

    return {"device": str(device), "gpu": torch.cuda.get_device_name(device), "gpu_count": torch.cuda.device_count(),
            "tf32": tf32_enabled()}


def model_device(model):
    """The device a model's (first) parameter is on: where its inputs must go."""
    p = next(model.parameters(), None)
    if p is None:
        import torch

        return torch.device("cpu")
    return p.device


def to_device(tensors, device):
    """A tensor, or a NamedTuple / tuple / dict of tensors (None kept), on `device`: each moved once, from
    pinned host memory without blocking the host when the target is a GPU. On the CPU: the same objects."""
    import torch

    if tensors is None:
        return None
    if isinstance(tensors, torch.Tensor):
        if tensors.device == device:
            return tensors
        if device.type == "cuda" and tensors.device.type == "cpu":
            return tensors.pin_memory().to(device, non_blocking=True)
        return tensors.to(device)
    if isinstance(tensors, dict):
        return {k: to_device(v, device) for k, v in tensors.items()}
    if isinstance(tensors, tuple):
        moved = [to_device(v, device) for v in tensors]
        return type(tensors)(*moved) if hasattr(tensors, "_fields") else tuple(moved)
    return tensors


def host(values) -> list[float]:
    """The values of a list of () tensors (or numbers) on the host, with one device sync for all of them."""
    import torch

    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    got = iter(torch.stack([t.detach().float().reshape(()) for t in tensors]).cpu().tolist())
    return [next(got) if isinstance(v, torch.Tensor) else float(v) for v in values]


def release_cached(device) -> None:
    """Give the GPU memory torch's allocator keeps cached back to the driver (another process on the same
    GPU, e.g. a vLLM engine waking from sleep, can then take it). Nothing on the CPU."""
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.empty_cache()


def reset_peak_memory(device) -> None:
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device) -> dict[str, float]:
    """{'gpu_mem_peak_gib': ...} on CUDA (torch.cuda.max_memory_allocated), {} elsewhere."""
    if getattr(device, "type", None) != "cuda":
        return {}
    import torch

    return {"gpu_mem_peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)}


# the flags that lower a stage's memory, in the order worth trying: micro-batches first (the same update in
# less memory), --minibatch-size last among the sizes shown and never advised (it changes the algorithm:
# more optimizer steps per batch, more off-policy)
MEMORY_FLAGS = ("--micro-batch-size", "--micro-batch-tokens", "--batch-tokens", "--gradient-checkpointing",
                "--lora-rank", "--gpu-memory-utilization")
SIZE_FLAGS = ("--minibatch-size", *MEMORY_FLAGS)


_OOM_TEXTS = ("can't allocate memory", "CUDA out of memory", "No available memory for the cache blocks")


def is_out_of_memory(e: BaseException) -> bool:
    """torch's CUDA OutOfMemoryError, the CPU allocator's "can't allocate memory" (a RuntimeError), vLLM's
    "No available memory for the cache blocks", or a MemoryError."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    return isinstance(e, (RuntimeError, ValueError)) and any(t in str(e) for t in _OOM_TEXTS)


def out_of_memory(stage: str, params: dict[str, Any], e: BaseException) -> OutOfMemory:
    """One line: the stage, the sizes in force (those of `params` among SIZE_FLAGS and --device/--dtype)
    and the flags that would lower memory without changing the algorithm (MEMORY_FLAGS)."""
    def flag(k: str) -> str:
        return "--" + k.replace("_", "-")

    have = {flag(k): v for k, v in params.items()}
    sizes = [f"{f} {have[f]}" for f in (*SIZE_FLAGS, "--dtype", "--device") if have.get(f) not in (None, False)]
    sizes = [s.replace(" True", "") for s in sizes]
    lower = [f for f in MEMORY_FLAGS if f in have and not (f == "--gradient-checkpointing" and have[f])]
    where = "host" if isinstance(e, MemoryError) or "can't allocate memory" in str(e) else "GPU"
    return OutOfMemory(f"{stage}: out of {where} memory" + (f" with {', '.join(sizes)}" if sizes else "")
                       + (f"; lower it with {', '.join(lower)}" if lower else "") + "; nothing was written")
