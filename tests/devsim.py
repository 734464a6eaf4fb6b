"""A simulated CUDA GPU on a CPU-only machine, so the code under test takes its GPU branches in the CPU suite.

    with SimulatedGPU(name="NVIDIA H100 80GB HBM3", memory_gib=80, capability=(9, 0)) as dev:   # dev: cuda:0
        model.to(dev); ...          # rlkit's `device.type == "cuda"` branches run, on real CPU data

What the code under test sees, inside the `with` only (everything is restored on exit):
- tensors on `dev` report `device == cuda:0` and `is_cuda`; they hold real CPU data, so a model moved with
  `model.to(dev)` computes what it computes on the CPU, and `.item()`, `.cpu()`, `.tolist()` and the optimizer
  work. An op that mixes a tensor on `dev` with a CPU tensor of one or more dimensions raises `DeviceMismatch`,
  as CUDA raises "Expected all tensors to be on the same device" (a 0-dim CPU tensor may join, as CUDA allows);
  `.numpy()` of one raises as CUDA's does. So code that forgets one `.to(device)` fails here as on a GPU.
- `torch.cuda` answers for this GPU: is_available, device_count, current_device, set_device, get_device_name,
  get_device_capability, get_device_properties, is_bf16_supported (capability >= 8.0), mem_get_info,
  memory_allocated / max_memory_allocated / memory_reserved / max_memory_reserved, reset_peak_memory_stats,
  empty_cache, synchronize, get_rng_state / set_rng_state. The memory figures are a real count: the bytes of the
  tensors alive on `dev` (activations kept for the backward included), and an allocation past `memory_gib` raises
  torch's `OutOfMemoryError` ("CUDA out of memory. ..."), as the caching allocator does.
- `pin_memory()` and `is_pinned()` work on CPU tensors (a pinned copy is marked), and every host-to-device copy
  is recorded in `copies` (pinned?, non_blocking?); `syncs` counts the host reads by who asked (`syncs["rlkit"]`:
  rlkit's own `.item()`, `.cpu()`, `float()`, ...; `syncs["other"]`: a library's); `empty_cache` counts calls.
- `torch.autocast("cuda", dtype)` casts as CUDA autocast does (`_CudaAutocast`: CUDA's policy, by function name,
  applied above autograd as torch applies it): matmuls, linear layers and attention in bf16/fp16, the fp32 list
  (softmax, norms, losses, exp/log/pow/rsqrt, sum, ...) in fp32. So bf16 autocast really computes in bf16.

How, and why not something closer to CUDA. The tensors are wrapper subclasses (as DTensor is) dispatched by one
TorchDispatchMode; they report `cuda:0` to Python and are `meta` tensors to torch's C++ core, so a tensor that
C++ makes from a simulated one's options (an autograd formula's zeros) comes back through the mode onto the
device. A wrapper that is CUDA in C++ too (`_make_wrapper_subclass(device="cuda")`) can be made on a CPU build,
and CUDA autocast even casts its forward, but the first autograd node aborts the process ("PyTorch is not
linked with support for cuda devices": no CUDA device guard), and with a guard registered (possible through
c10's registry) the backward still asks for the current accelerator's stream, which a CPU build gives only
after registering a PrivateUse1 backend for the whole process. And CUDA autocast casts only tensors that are
CUDA in C++, hence `_CudaAutocast`. Where torch's Python code reads the C++ device (`Tensor.to/.cpu/.cuda/
.tolist/.numpy/.data_ptr`), the simulated tensor answers as a CUDA tensor.

`SecondDevice` is this class with its defaults (the name the device-placement tests have used).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("cuda", 0)  # what Python sees
_INNER = torch.device("meta")  # what torch's C++ core sees (see the module docstring)
_CPU = torch.device("cpu")


class DeviceMismatch(RuntimeError):
    pass


def _is_dev(dev) -> bool:
    """`dev` is the simulated GPU: cuda, or meta where torch's C++ code passes a simulated tensor's options on."""
    return dev is not None and torch.device(dev).type in ("cuda", "meta")


class OnDevice(torch.Tensor):
    """A tensor that reports `DEVICE` and holds `elem`, a real CPU tensor."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            device=_INNER, requires_grad=elem.requires_grad, layout=elem.layout)
        r.elem = elem
        return r

    # what Python sees: a CUDA tensor
    device = property(lambda self: DEVICE)
    is_cuda = property(lambda self: True)
    is_cpu = property(lambda self: False)

    def get_device(self) -> int:
        return DEVICE.index

    def data_ptr(self) -> int:  # the CPU data's address: distinct tensors, distinct addresses, as on the GPU
        return self.elem.data_ptr()

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    def to(self, *args, **kwargs):
        copy = kwargs.pop("copy", False)
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        dtype = dtype or self.dtype
        if device is not None and not _is_dev(device):  # to the host: a copy, read back (a sync)
            return torch.ops.aten._to_copy.default(self, dtype=dtype, device=device, non_blocking=non_blocking)
        if dtype == self.dtype and not copy and memory_format is None:
            return self  # already there, as torch returns the tensor itself
        return super().to(dtype=dtype, non_blocking=non_blocking, copy=copy,
                          **({} if memory_format is None else {"memory_format": memory_format}))

    def cpu(self, memory_format=torch.preserve_format):  # noqa: ARG002
        return self.to(_CPU)

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):  # noqa: ARG002
        return self

    def tolist(self):
        return self.cpu().tolist()

    def numpy(self, *, force: bool = False):  # noqa: ARG002
        raise TypeError(f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")

    __array__ = numpy

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: an OnDevice tensor outside SimulatedGPU()")


def _caller() -> str:
    """Where the op was called from: the innermost frame outside torch and this module, as its file path."""
    f = sys._getframe(2)
    while f is not None and ("/torch/" in f.f_code.co_filename or f.f_code.co_filename == __file__):
        f = f.f_back
    return f.f_code.co_filename if f is not None else ""


# CUDA autocast's policy (aten/src/ATen/autocast_mode.cpp), by the name of the function called
_LOW = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "mv", "bmm", "baddbmm", "addmm", "addmv", "addbmm",
        "addr", "einsum", "chain_matmul", "multi_dot", "vecdot", "scaled_dot_product_attention", "conv1d", "conv2d",
        "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu", "lstm_cell", "gru_cell"}
_FP32 = {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
         "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm", "norm", "cosine_similarity",
         "nll_loss", "cross_entropy", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
         "binary_cross_entropy_with_logits", "cdist", "logsumexp", "prod", "softmax", "log_softmax", "cumprod",
         "cumsum", "vector_norm", "matrix_norm", "sum"}
_PROMOTE = {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "index_put", "scatter_add", "tensordot", "cat",
            "stack", "index_copy"}


class _CudaAutocast(TorchFunctionMode):
    """`torch.autocast("cuda", dtype)` for the simulated tensors: CUDA's autocast policy applied where torch's own
    applies it, above autograd (the casts are ordinary `.to(dtype)` ops, recorded for the backward as autocast's
    are): matmuls, linear layers and attention in the autocast dtype, the fp32 list (softmax, log_softmax, norms,
    losses, exp/log/pow/rsqrt, sum, ...) in fp32, mixed inputs of cat/stack/... promoted. Only simulated tensors
    are cast, as CUDA autocast casts only CUDA tensors. (CUDA's autocast itself sees no CUDA tensor here.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _LOW or name in _FP32 or name in _PROMOTE:
            if torch.is_autocast_enabled("cuda"):
                args, kwargs = self._cast(name, args, kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _cast(name, args, kwargs):
        floats = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, OnDevice) and x.is_floating_point()]
        if not floats:
            return args, kwargs
        if name in _LOW:
            to = torch.get_autocast_dtype("cuda")
        elif name in _FP32:
            to = torch.float32
        else:
            to = functools.reduce(torch.promote_types, (x.dtype for x in floats))
        return tree_map(lambda x: x.to(to) if isinstance(x, OnDevice) and x.is_floating_point() else x, (args, kwargs))


class SimulatedGPU(TorchDispatchMode):
    """One simulated GPU, `cuda:0`: the mode that runs every op on the wrapped CPU data, checks that devices are
    not mixed, answers `torch.cuda` for the GPU and counts what a GPU run is judged by (see the module docstring).
    `memory_gib`: its memory (past it, an allocation raises CUDA's out-of-memory error); `capability`: the compute
    capability, (8, 0) and up with bf16 kernels."""

    def __init__(self, name: str = "NVIDIA H100 80GB HBM3", memory_gib: float = 80.0,
                 capability: tuple[int, int] = (9, 0)) -> None:
        super().__init__()
        self.name, self.capability = name, tuple(capability)
        self.total = int(memory_gib * 2**30)
        self.syncs = {"rlkit": 0, "other": 0}
        self.copies: list[tuple[bool, bool]] = []  # host -> device: (from pinned memory, non_blocking)
        self.empty_cache_calls = 0
        self.allocated = self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage address -> [bytes, wrappers alive]
        self._pinned: dict[int, weakref.ref] = {}
        self._rng = torch.zeros(16, dtype=torch.uint8)
        self._undo: list = []

    # ------------------------------------------------------------ the allocator's figures
    def _alloc(self, w: OnDevice) -> OnDevice:
        st = w.elem.untyped_storage()
        key, nbytes = st.data_ptr(), st.nbytes()
        if not key or not nbytes:
            return w
        entry = self._live.get(key)
        if entry is None:
            if self.allocated + nbytes > self.total:
                free = self.total - self.allocated
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {nbytes / 2**20:.2f} MiB. GPU 0 has a total capacity of "
                    f"{self.total / 2**30:.2f} GiB of which {free / 2**20:.2f} MiB is free. (simulated {self.name})")
            entry = self._live[key] = [nbytes, 0]
            self.allocated += nbytes
            self.peak = max(self.peak, self.allocated)
        entry[1] += 1
        weakref.finalize(w.elem, self._free, key)  # not on `w`: swap_tensors (module.to) refuses weakref'd tensors
        return w

    def _free(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.allocated -= entry[0]
                del self._live[key]

    def _wrap(self, x: torch.Tensor) -> OnDevice:
        return self._alloc(OnDevice(x))

    def _sync(self) -> None:
        where = _caller()
        self.syncs["rlkit" if "/rlkit/" in where or "/stages/" in where else "other"] += 1

    def _is_pinned(self, t: torch.Tensor) -> bool:
        ref = self._pinned.get(t.untyped_storage().data_ptr())
        return ref is not None and ref() is not None

    # ------------------------------------------------------------ torch.cuda, for this GPU
    def _index(self, device=None) -> int:
        if device is None:
            return 0
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if d.type != "cuda" or (d.index or 0) != 0:
            raise RuntimeError(f"simulated GPU: {d} is not cuda:0 (this machine has 1 GPU)")
        return 0

    def _cuda_api(self) -> dict:
        me = self

        def properties(device=None):
            me._index(device)
            return types.SimpleNamespace(name=me.name, total_memory=me.total, major=me.capability[0],
                                         minor=me.capability[1], multi_processor_count=132)

        def set_rng_state(state, device="cuda"):
            me._index(device)
            me._rng = state.clone()

        def reset_peak(device=None):
            me._index(device)
            me.peak = me.allocated

        def count_empty_cache():
            me.empty_cache_calls += 1

        return {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "set_device": lambda device: me._index(device) and None,
            "get_device_name": lambda device=None: [me._index(device), me.name][1],
            "get_device_capability": lambda device=None: [me._index(device), me.capability][1],
            "get_device_properties": properties,
            "is_bf16_supported": lambda including_emulation=True: me.capability >= (8, 0),
            "mem_get_info": lambda device=None: (me.total - me.allocated, me.total),
            "memory_allocated": lambda device=None: me.allocated,
            "max_memory_allocated": lambda device=None: me.peak,
            "memory_reserved": lambda device=None: me.allocated,
            "max_memory_reserved": lambda device=None: me.peak,
            "reset_peak_memory_stats": reset_peak,
            "empty_cache": count_empty_cache,
            "synchronize": lambda device=None: None,
            "get_rng_state": lambda device="cuda": me._rng.clone(),
            "set_rng_state": set_rng_state,
            "_lazy_init": lambda: None,
        }

    def _patch(self, owner, name: str, value) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self):
        # module.to(dev) swaps each parameter's contents in place (as for DTensor) instead of making new
        # Parameter objects, which would untie tied weights (an embedding shared with the output head)
        self._swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        # torch.tensor(data, device=dev) builds on the CPU and moves through this mode (as FakeTensorMode does)
        self._lift = torch._C._only_lift_cpu_tensors()
        torch._C._set_only_lift_cpu_tensors(True)
        for name, fn in self._cuda_api().items():
            self._patch(torch.cuda, name, fn)
        self._autocast = _CudaAutocast()
        self._autocast.__enter__()
        super().__enter__()
        return DEVICE

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._autocast.__exit__(*exc)
            while self._undo:
                owner, name, value = self._undo.pop()
                setattr(owner, name, value)
            torch._C._set_only_lift_cpu_tensors(self._lift)
            torch.__future__.set_swap_module_params_on_conversion(self._swap)

    # ------------------------------------------------------------ every op
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on: list[torch.Tensor] = []
        off: list[torch.Tensor] = []

        def scan(x):
            if isinstance(x, OnDevice):
                on.append(x)
            elif isinstance(x, torch.Tensor) and x.device.type == _INNER.type:
                raise DeviceMismatch(f"{func}: a tensor made on {_INNER} outside this simulation (torch.tensor(data, "
                                     "device='meta')?): build it on the GPU, torch.zeros(..., device=dev) or .to(dev)")
            elif isinstance(x, torch.Tensor) and x.dim() > 0:
                off.append(x)

        tree_map(scan, (args, kwargs))
        if func is torch.ops.aten._local_scalar_dense.default and on:
            self._sync()
        if func is torch.ops.aten.is_pinned.default:
            return not on and self._is_pinned(args[0])
        if func is torch.ops.aten._pin_memory.default:
            if on:
                raise RuntimeError(f"cannot pin a {DEVICE} tensor: only dense CPU tensors can be pinned")
            out = args[0].clone()
            self._pinned[out.untyped_storage().data_ptr()] = weakref.ref(out)
            return out
        if func is torch.ops.aten._to_copy.default:  # .to(device) / .cpu() / dtype casts
            x = args[0]
            inner = x.elem if isinstance(x, OnDevice) else x
            kw = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking", "pin_memory")}
            out = func(inner, **kw) if kw else inner.clone()
            dev = kwargs.get("device")
            if _is_dev(dev) or (dev is None and isinstance(x, OnDevice)):
                if not isinstance(x, OnDevice):
                    self.copies.append((self._is_pinned(x), bool(kwargs.get("non_blocking"))))
                return self._wrap(out)
            if isinstance(x, OnDevice):
                self._sync()  # to the host
            return out
        if on and off:
            raise DeviceMismatch(f"{func}: expected all tensors to be on the same device, but found at least two "
                                 f"devices, {DEVICE} and cpu (shapes {[tuple(t.shape) for t in off]} on the cpu)")
        make_on = bool(on) or _is_dev(kwargs.get("device"))
        if _is_dev(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
            kwargs.pop("pin_memory", None)
        uargs, ukwargs = tree_map(lambda x: x.elem if isinstance(x, OnDevice) else x, (args, kwargs))
        out = func(*uargs, **ukwargs)
        if on and func._schema.is_mutable and isinstance(args[0], OnDevice):  # in place: the same tensor
            return args[0]
        if not make_on:
            return out
        return tree_map(lambda x: self._wrap(x) if isinstance(x, torch.Tensor) and not isinstance(x, OnDevice)
                        else x, out)


SecondDevice = SimulatedGPU


@contextlib.contextmanager
def loading_outside(device):
    """transformers builds a model on the meta device before loading its weights: inside, `from_pretrained` runs
    outside the simulation (its result is on the CPU, and the code under test moves it), which is also much
    faster than loading through the mode. `device` None: nothing to do."""
    if device is None:
        yield
        return
    import transformers
    from torch.utils._python_dispatch import _disable_current_modes

    patched = {}
    for name in ("AutoModelForSequenceClassification", "AutoModelForCausalLM"):
        cls = getattr(transformers, name)
        original = cls.from_pretrained.__func__

        def outside(klass, *args, __original=original, **kwargs):
            swap = torch.__future__.get_swap_module_params_on_conversion()
            torch.__future__.set_swap_module_params_on_conversion(False)
            try:
                with _disable_current_modes():
                    return __original(klass, *args, **kwargs)
            finally:
                torch.__future__.set_swap_module_params_on_conversion(swap)

        patched[cls] = cls.from_pretrained
        cls.from_pretrained = classmethod(outside)
    try:
        yield
    finally:
        for cls, fn in patched.items():
            cls.from_pretrained = fn
