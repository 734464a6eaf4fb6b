"""A second device on a CPU-only machine, for the device-placement checks (tests/unit/test_devices.py).

`with SecondDevice() as dev:` gives `dev` (the `meta` device) on which tensors hold real CPU data: the
model moved with `model.to(dev)` computes exactly what it computes on the CPU, `.item()`, `.cpu()`
and the optimizer work, but any operation that mixes a tensor on `dev` with a CPU tensor of one or
more dimensions raises `DeviceMismatch`, as CUDA raises "Expected all tensors to be on the same
device". A 0-dim CPU tensor may join, as CUDA allows. So a stage's code that forgets one `.to(device)`
fails here as it would on a GPU, where no GPU is.

Why not CUDA under `FakeTensorMode`: on a CPU-only torch build its device guards abort the process
("PyTorch is not linked with support for cuda devices"); and `meta` alone checks no devices and holds
no values. The tensors here are wrapper subclasses (as DTensor is) dispatched by one TorchDispatchMode.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

DEVICE = torch.device("meta")


class DeviceMismatch(RuntimeError):
    pass


class OnDevice(torch.Tensor):
    """A tensor that reports `DEVICE` and holds `elem`, a real CPU tensor."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            device=DEVICE, requires_grad=elem.requires_grad, layout=elem.layout)
        r.elem = elem
        return r

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: an OnDevice tensor outside SecondDevice()")


def _on(dev) -> bool:
    return dev is not None and torch.device(dev).type == DEVICE.type


def _caller() -> str:
    """Where the op was called from: the innermost frame outside torch and this module, as its file path."""
    import sys

    f = sys._getframe(2)
    while f is not None and ("/torch/" in f.f_code.co_filename or f.f_code.co_filename == __file__):
        f = f.f_back
    return f.f_code.co_filename if f is not None else ""


class SecondDevice(TorchDispatchMode):
    """The mode that runs every op on the wrapped CPU data and checks that devices are not mixed. It also
    counts host syncs (a value read back to the host: `.item()`, `.cpu()`, `float()`, `bool()`, ...) by
    the module that asked for them: `syncs["rlkit"]` are rlkit's own, `syncs["other"]` a library's."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = {"rlkit": 0, "other": 0}

    def __enter__(self):
        # module.to(DEVICE) swaps each parameter's contents in place (as for DTensor) instead of making new
        # Parameter objects, which would untie tied weights (an embedding shared with the output head)
        self._swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        super().__enter__()
        return DEVICE

    def __exit__(self, *exc):
        torch.__future__.set_swap_module_params_on_conversion(self._swap)
        return super().__exit__(*exc)

    def _sync(self) -> None:
        where = _caller()
        self.syncs["rlkit" if "/rlkit/" in where or "/stages/" in where else "other"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on: list[torch.Tensor] = []
        off: list[torch.Tensor] = []

        def scan(x):
            if isinstance(x, OnDevice):
                on.append(x)
            elif isinstance(x, torch.Tensor) and x.device.type == DEVICE.type:
                raise DeviceMismatch(f"{func}: a tensor made on {DEVICE} outside this harness (torch.tensor(data, "
                                     "device=...) does not dispatch its copy): build it with torch.full/zeros/... "
                                     "(device=...) or .to(device), which do")
            elif isinstance(x, torch.Tensor) and x.dim() > 0:
                off.append(x)

        tree_map(scan, (args, kwargs))
        if func is torch.ops.aten._local_scalar_dense.default and on:
            self._sync()
        if func is torch.ops.aten._to_copy.default:  # .to(device) / .cpu() / dtype casts
            x = args[0]
            inner = x.elem if isinstance(x, OnDevice) else x
            kw = {k: v for k, v in kwargs.items() if k != "device"}
            out = func(inner, **kw) if kw else inner.clone()
            dev = kwargs.get("device")
            if _on(dev) or (dev is None and isinstance(x, OnDevice)):
                return OnDevice(out)
            if isinstance(x, OnDevice):
                self._sync()  # to the host
            return out
        if on and off:
            raise DeviceMismatch(f"{func}: expected all tensors to be on the same device, but found at least two "
                                 f"devices, {DEVICE} and cpu (shapes {[tuple(t.shape) for t in off]} on the cpu)")
        make_on = bool(on) or _on(kwargs.get("device"))
        if _on(kwargs.get("device")):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        uargs, ukwargs = tree_map(lambda x: x.elem if isinstance(x, OnDevice) else x, (args, kwargs))
        out = func(*uargs, **ukwargs)
        if on and func._schema.is_mutable and isinstance(args[0], OnDevice):  # in place: the same tensor
            return args[0]
        if not make_on:
            return out
        return tree_map(lambda x: OnDevice(x) if isinstance(x, torch.Tensor) and not isinstance(x, OnDevice) else x,
                        out)


@contextlib.contextmanager
def loading_outside(device):
    """transformers builds a model on the (real) meta device before loading its weights, which this harness's
    `meta` would take for its own: inside, `from_pretrained` runs outside the harness (its result is on the
    CPU, and the code under test moves it). `device` None: nothing to do."""
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
