"""Data parallelism for the training stages on torch.distributed, with FSDP2 (`fully_shard`).

A stage started by `torchrun --nproc-per-node N -m rlkit <stage> ...` finds the launcher's
environment (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR), joins the process group (NCCL on CUDA,
gloo on CPU) and shards the model over all ranks, one FSDP unit per decoder layer plus the root.
Nothing else about the command changes:

- Rank 0 reads the input table (a file or stdin) and broadcasts its Arrow IPC bytes; the other
  ranks never touch stdin.
- Every rank computes the same advantages over the whole batch, then takes rows `rank::world` of
  each global minibatch. Each rank's loss is its share of the global minibatch's loss (its part of
  the numerator over the global denominator), so the summed gradient is the one-process gradient
  and results match one process up to float summation order.
- Forward-only passes over the whole batch (pi_old, PPO's values, DPO's figures) run rows rank::world on
  each rank and are all-gathered (`Engine.forward_rows`, `gather_rows`).
- Weights: rank 0 alone reads them; a rank that built its model weightless (meta device) gets its shards
  from rank 0 tensor by tensor (`shard_model`). Under bf16 on GPUs FSDP2 gathers bf16 weights
  (`rlkit.training.fsdp_mp_policy`).
- Checkpoints are gathered: rank 0 alone writes an ordinary full Hugging Face directory and the
  full optimizer state in the same per-parameter safetensors layout as one process (both gathered onto
  rank 0's host a tensor at a time), so a later `update` resumes with the same or any other world size.
- Collectives time out after --dist-timeout minutes (`init`). Where rank 0 works alone (a piped input,
  writing the checkpoint) the other ranks wait for it in the launcher's store, not in a collective
  (`wait_for_main`, used by `barrier` and `share_table`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from rlkit.errors import RlkitError


@dataclass(frozen=True)
class DataParallel:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched() -> bool:
    """True under torchrun (or any launcher that sets WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device: str = "auto", timeout_min: float | None = None) -> DataParallel | None:
    """Join the process group the launcher describes; None when not launched distributed. `device`
    (--device): auto puts rank r on cuda:LOCAL_RANK when CUDA is there (NCCL), else on the CPU (gloo).
    `timeout_min` (--dist-timeout): how long a collective waits for the other ranks (default
    `rlkit.training.DEFAULT_DIST_TIMEOUT`)."""
    if not launched():
        return None
    from datetime import timedelta

    import torch.distributed as dist

    from rlkit import devices
    from rlkit.training import DEFAULT_DIST_TIMEOUT

    dev = devices.resolve(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                timeout=timedelta(minutes=timeout_min or DEFAULT_DIST_TIMEOUT))
    dp = DataParallel(dist.get_rank(), dist.get_world_size(), dev)
    if not dp.main:  # rank 0 alone talks; errors still print on every rank
        from rlkit import console

        console.silence()
    return dp


FAILURE_WAIT_S = 10.0  # how long a failing rank waits for the others to fail too before it reports alone


def agree_on_failure(code: int, head: str, text: str, wait: float = FAILURE_WAIT_S,
                     rank: int | None = None, world: int | None = None) -> tuple[int, str | None]:
    """A failing rank's (exit code, line to print or None), so that a failure every rank meets (a bad input,
    seen by each or broadcast by rank 0) is one line from rank 0 and one exit code from every rank.

    Each failing rank puts its code and message in the launcher's key-value store (torchrun's TCPStore at
    MASTER_ADDR:MASTER_PORT: no collective, so a rank whose peers sit in a collective cannot hang or
    mismatch them), then waits up to `wait` seconds for every rank's. All there: every rank exits with the
    highest code, and rank 0 prints that rank's line. Not all (a rank failing alone: out of memory, a file
    only its node lacks), or no store: the rank prints its own line, marked with its rank when not 0.
    (Writing the line to torchrun's error file, TORCHELASTIC_ERROR_FILE, would put it in torchrun's summary,
    but torchrun then logs three lines of its own about the file.)"""
    import json
    from datetime import timedelta

    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world

    def line(r: int, head: str, text: str) -> str:
        return head + (f"rank {r}: " if r else "") + text

    # torchrun's agent keeps its store up for the whole job; otherwise there is one once the group is up
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and not dist.is_initialized():
        return code, line(rank, head, text)
    try:
        with _no_fd2():  # c10d logs its own lines (and C++ stack frames) on a timeout
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=wait), wait_for_workers=False)
            ns = f"rlkit-failed/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            store.set(f"{ns}/{rank}", json.dumps({"code": code, "head": head, "text": text}))
            keys = [f"{ns}/{r}" for r in range(world)]
            store.wait(keys, timedelta(seconds=wait))
            got = [json.loads(store.get(k)) for k in keys]
    except Exception:  # noqa: BLE001 (no store, or not every rank failed in time: report alone)
        return code, line(rank, head, text)
    worst = max(range(world), key=lambda r: (got[r]["code"], -r))  # rank 0's own line on a tie
    agreed = line(worst, got[worst]["head"], got[worst]["text"])
    return got[worst]["code"], (agreed if rank == 0 else None)


_FD2 = {"depth": 0, "saved": -1}
_FD2_LOCK = threading.Lock()


@contextmanager
def _no_fd2() -> Iterator[None]:
    """File descriptor 2 (stderr) on /dev/null for a moment: what C++ code writes there is lost. Nested or
    from several threads at once, the outermost restores it."""
    import sys

    with _FD2_LOCK:
        if _FD2["depth"] == 0:
            sys.stderr.flush()
            _FD2["saved"], null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 2)
            os.close(null)
        _FD2["depth"] += 1
    try:
        yield
    finally:
        with _FD2_LOCK:
            _FD2["depth"] -= 1
            if _FD2["depth"] == 0:
                os.dup2(_FD2["saved"], 2)
                os.close(_FD2["saved"])


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


ROOT_PREFIX = "policy."  # parameter names under an _FnRoot


class _FnRoot(torch.nn.Module):
    """An FSDP root whose forward is `fn(model, *args)`: rlkit's stages call parts of a model (the base
    model, then the output head on a few positions), and only a root unit's forward hooks gather the
    root weights (embeddings, norm, head) for such calls and reduce their gradients."""

    def __init__(self, policy, fn) -> None:
        super().__init__()
        self.policy = policy
        self.fn = fn

    def forward(self, *args):
        return self.fn(self.policy, *args)


def shard_model(model, dp: DataParallel, fn=None, dtype: str = "fp32"):
    """FSDP2: one unit per decoder layer, then a root unit: the model itself (callers use its forward),
    or, with `fn`, a wrapper whose forward is fn(model, *args); `model._rlkit_fsdp_root` is then what
    rlkit's forward helpers (`logprobs.completion_logprobs`, `reward_model.forward_scores`) call.
    `dtype` (--dtype, concrete): bf16 on a GPU shards under `MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)` (`rlkit.training.fsdp_param_dtype`), and `Precision` then enters no autocast."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dp.device.type, (dp.world,))
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise RlkitError(f"{type(model).__name__}: no decoder layers (.layers) to shard; rlkit shards decoder-only "
                         "transformers (Llama, Qwen2, Mistral, ...)")
    # a rank that built the model weightless (on the meta device: `checkpoints.load_policy(weightless=True)`)
    # gets its shards from rank 0's weights, one tensor at a time: one full copy on the host, rank 0's
    weightless = int(any(t.is_meta for t in (*model.parameters(), *model.buffers())))
    if all_max([weightless], dp)[0]:
        return _shard_from_rank0(model, dp, fn, dtype, mesh, layers)
    model.to(dp.device)
    _fully_shard(model, fn, dtype, mesh, layers, dp)
    return model


def _fully_shard(model, fn, dtype: str, mesh, layers, dp: DataParallel) -> None:
    from torch.distributed.fsdp import fully_shard

    from rlkit.training import fsdp_mp_policy

    kw = {"mp_policy": policy} if (policy := fsdp_mp_policy(dtype, dp.device.type)) is not None else {}
    for layer in layers:
        fully_shard(layer, mesh=mesh, **kw)
    if fn is None:
        fully_shard(model, mesh=mesh, **kw)
    else:  # no module cycle
        object.__setattr__(model, "_rlkit_fsdp_root", fully_shard(_FnRoot(model, fn), mesh=mesh, **kw))


def _shard_from_rank0(model, dp: DataParallel, fn, dtype: str, mesh, layers):
    """Shard, then fill every rank's shards from rank 0's full weights (`set_model_state_dict` with
    broadcast_from_rank0: tensor by tensor) and its buffers (rotary tables, which no state dict holds)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if dp.main:
        full = {k: v.detach() for k, v in model.state_dict().items()}  # rank 0's weights, on the host
        model.to(dp.device)
    _fully_shard(model, fn, dtype, mesh, layers, dp)
    if not dp.main:
        model.to_empty(device=dp.device)
    root = _root(model)
    prefix = ROOT_PREFIX if root is not model else ""
    set_model_state_dict(root, {prefix + k: v for k, v in full.items()} if dp.main else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for b in model.buffers():
            dist.broadcast(b, 0)
    return model


def _root(model):
    return getattr(model, "_rlkit_fsdp_root", model)


def fsdp_root(model):
    """The module FSDP2 sharded as `model`'s root (the function wrapper of `shard_model(fn=...)`, whose parameter
    names carry `ROOT_PREFIX`), or the model itself: what torch's state-dict helpers take."""
    return _root(model)


@contextmanager
def root_gathered(model):
    """With `shard_model(model, dp, fn)`, the model's own forward (`generate`, sft's held-out eval) goes around
    the root unit, whose weights (embeddings, final norm, head) stay sharded: gather them for the block, and
    shard them again after. The decoder layers' units gather their own weights as they run. A no-op for a
    model without a function root (or not sharded)."""
    root = getattr(model, "_rlkit_fsdp_root", None)
    if root is None:
        yield model
        return
    root.unshard()
    try:
        yield model
    finally:
        root.reshard()


def _strip(d: dict) -> dict:
    return {k.removeprefix(ROOT_PREFIX): v for k, v in d.items()}


def broadcast_bytes(data: bytes | None, dp: DataParallel) -> bytes:
    """Rank 0's bytes on every rank (a uint8 tensor; no pickle)."""
    import torch.distributed as dist

    dev = dp.device  # NCCL moves CUDA tensors only; gloo CPU ones
    n = torch.tensor([len(data) if dp.main and data is not None else 0], dtype=torch.long, device=dev)
    dist.broadcast(n, 0)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if dp.main and data
           else torch.empty(int(n), dtype=torch.uint8, device=dev))
    dist.broadcast(buf, 0)
    return bytes(buf.cpu().numpy().tobytes())


def all_sum(values: list[float], dp: DataParallel | None) -> list[float]:
    """Element-wise sum over ranks (float64)."""
    if dp is None:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=dp.device)
    dist.all_reduce(t)
    return t.cpu().tolist()


def mean_over_ranks(values: list[Tensor], dp: DataParallel) -> list[Tensor]:
    """The mean over ranks of each () tensor, float64, left on the device: one all_reduce, no host sync (NCCL
    runs it on the GPU's stream). The same figures `all_sum` of each rank's value / world gives."""
    import torch.distributed as dist

    if not values:
        return []
    t = torch.stack([v.detach().double().reshape(()) for v in values]) / dp.world
    dist.all_reduce(t)
    return list(t.unbind())


def host64(values: list) -> list[float]:
    """`rlkit.devices.host` in float64: the values of () tensors (or numbers) with one device sync, a float64
    tensor's value unrounded (a float32 one's read exactly, as `devices.host` reads it)."""
    tensors = [v for v in values if isinstance(v, Tensor)]
    if not tensors:
        return [float(v) for v in values]
    got = iter(torch.stack([t.detach().double().reshape(()) for t in tensors]).cpu().tolist())
    return [next(got) if isinstance(v, Tensor) else float(v) for v in values]


def gather_rows(local: Tensor, n: int, dp: DataParallel) -> Tensor:
    """Every rank's rows in one tensor: `local` (len(range(rank, n, world)), *tail) holds rows rank::world of
    n; -> (n, *tail) on every rank, row i from rank i % world. One all_gather of equal pieces (a rank with
    fewer rows pads its piece)."""
    import torch.distributed as dist

    m = -(-n // dp.world)
    piece = local.new_zeros((m, *local.shape[1:]))
    piece[: len(local)] = local
    parts = [torch.empty_like(piece) for _ in range(dp.world)]
    dist.all_gather(parts, piece.contiguous())
    out = local.new_empty((n, *local.shape[1:]))
    for r, part in enumerate(parts):
        out[r::dp.world] = part[: len(range(r, n, dp.world))]
    return out


def all_max(values: list[float], dp: DataParallel | None) -> list[float]:
    if dp is None:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=dp.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def stand_down(dp: DataParallel | None, metrics: dict) -> bool:
    """After the last gather: True on a rank that does not write (it waits at the barrier for rank 0,
    which then writes and meets it there); records the world size in rank 0's metrics."""
    if dp is None:
        return False
    metrics["world_size"] = dp.world
    if not dp.main:
        barrier(dp)
        return True
    return False


def barrier(dp: DataParallel | None) -> None:
    """Every rank here before any goes on. The other ranks first wait for rank 0 in the launcher's key-value
    store (`wait_for_main`): rank 0 alone writes checkpoints and snapshots, for as long as that takes, and no
    collective (bound by --dist-timeout) is open meanwhile."""
    if dp is not None:
        import torch.distributed as dist

        wait_for_main(dp, "barrier")
        dist.barrier()


_WAITS: dict[str, int] = {}
POLL_S = 0.2


def wait_for_main(dp: DataParallel, what: str, timeout_s: float | None = None) -> None:
    """Rank 0 says it got here (a key in the process group's store); the other ranks poll for that key
    instead of waiting in a collective, so rank 0's work alone (reading a piped input whose upstream is
    still sampling, writing and hashing a checkpoint) is bounded by no timeout, or by `timeout_s` seconds
    (`update --follow` waiting for its next batch: --dist-timeout), after which the rank fails with one line.
    Every rank calls it the same number of times per `what`, as for a collective."""
    import time

    import torch.distributed as dist

    n = _WAITS[what] = _WAITS.get(what, 0) + 1
    key = f"rlkit/main-at/{what}/{n}"
    store = dist.distributed_c10d._get_default_store()
    if dp.main:
        store.set(key, "1")
        return
    t0 = time.monotonic()
    while not store.check([key]):
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise RlkitError(f"rank 0 read no input for {timeout_s / 60:g} minutes (--dist-timeout): its upstream "
                             "sends no batch, or rank 0 is stuck")
        time.sleep(POLL_S)


def full_model_state(model) -> dict[str, Tensor]:
    """Every parameter and buffer, unsharded, on CPU: on all ranks (collective; rank 0 saves it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = _strip(get_model_state_dict(_root(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    if getattr(model.config, "tie_word_embeddings", False):  # saved once, as one process saves it
        for k in getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}:
            sd.pop(k, None)
    return sd


def full_optimizer_state(model, opt) -> dict[str, dict[str, Tensor]]:
    """{param FQN: {exp_avg, exp_avg_sq, step}} unsharded on CPU (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(_root(model), opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _strip(osd.get("state", {}))  # rank 0 only; the others get nothing


def load_full_optimizer_state(model, opt, state: dict[str, dict[str, Tensor]]) -> None:
    """Shard a full per-FQN AdamW state (as `full_optimizer_state` gives) into `opt` on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not state:
        return
    root = _root(model)
    # the param groups from the optimizer itself, its parameters by name: asking torch for a full optimizer
    # state dict would gather every rank's AdamW shards whole onto each GPU just to read them
    names = {id(p): n for n, p in root.named_parameters()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in opt.param_groups]
    prefix = ROOT_PREFIX if root is not model else ""  # names under an _FnRoot, or the model's own
    set_optimizer_state_dict(root, opt, {"state": {prefix + k: v for k, v in state.items()}, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=True))


@dataclass
class SharedTable:
    """An input table every rank holds (what `TableReader` gives one process, read whole)."""

    kind: str
    manifest: dict | None
    fingerprint: str
    label: str
    table: object  # pa.Table

    @property
    def record(self):
        """The manifest parsed (`rlkit.io.manifests.Manifest`), as `TableReader.record`."""
        from rlkit.io.manifests import Manifest

        return Manifest.parse(self.manifest)

    def read_all(self, require_rows: bool = True):
        if require_rows and self.table.num_rows == 0:
            raise RlkitError(f"{self.label}: the table has no rows")
        return self.table


def share_table(pending, dp: DataParallel) -> SharedTable:
    """Rank 0 reads the input (file or stdin) whole and broadcasts it as Arrow IPC bytes; a read error on
    rank 0 is broadcast too, so every rank stops with the same one-line error instead of hanging."""

    def make():
        reader = pending.result()
        return ({"kind": reader.kind, "manifest": reader.manifest, "fingerprint": reader.fingerprint,
                 "label": reader.label}, reader.read_all(require_rows=False))

    # a piped input ends when its upstream does: no collective open until then
    header, table = share(dp, "input", make)
    return SharedTable(header["kind"], header["manifest"], header["fingerprint"], header["label"], table)


def share(dp, what: str, make, timeout_s: float | None = None):
    """Rank 0's `make()` -> (JSON-able dict, pa.Table or None) on every rank: broadcast as JSON and Arrow IPC bytes
    (no pickle), a `RlkitError` it raised too, so that every rank fails with rank 0's line and exit code. The other
    ranks wait for rank 0 in the launcher's store (`wait_for_main`), up to `timeout_s` seconds."""
    import io
    import json

    import pyarrow as pa

    head, body, err = {}, b"", None
    if dp.main:
        try:
            head, table = make()
            if table is not None:
                sink = io.BytesIO()
                with pa.ipc.new_stream(sink, table.schema) as w:
                    w.write_table(table)
                body = sink.getvalue()
        except RlkitError as e:
            err = e
            head = {"error": str(e), "exit_code": e.exit_code}
    wait_for_main(dp, what, timeout_s=timeout_s)
    head = json.loads(broadcast_bytes(json.dumps(head).encode(), dp))
    if "error" in head:
        if err is not None:
            raise err
        same = RlkitError(head["error"])
        same.exit_code = int(head["exit_code"])
        raise same
    data = broadcast_bytes(body, dp)
    return head, (pa.ipc.open_stream(data).read_all() if data else None)
