"""rlkit's own steps traced on fake tensors at real shapes: what one GPU would hold, measured, not a formula.

Each `Spec` is one stage's step: `update`'s `Trainer` optimizer step (the algorithm's loss through the
engine's micro-batches, the log-prob path, backward, clipping and AdamW), `sft`'s and `train-rm`'s engine
step, `score-ref`'s forward-only scoring pass. The model is built from its `config.json` under
`torch._subclasses.fake_tensor.FakeTensorMode`, so no weight, activation or optimizer moment is ever
allocated, and `torch.distributed._tools.mem_tracker.MemTracker` counts the bytes every op creates as a
device's allocator would hold them. Under data parallelism (`world` > 1) the same engine shards the model
with FSDP2 over a fake process group (backend "fake"), traced by `FSDPMemTracker` as rank 0 sees it.

What makes a 7B step trace in seconds on a CPU:
- **Layers**: decoder layers are identical, so once the peak falls at the same moment of the step every
  figure is linear in their number. The step is traced at 1, 2 and 3 layers, and at more while three
  consecutive counts do not grow alike (with few layers the peak can fall at another moment: the end of the
  backward, where the embedding's gradient is gathered, instead of the logits); each figure, every part of
  the peak included, is extrapolated from the last two to the model's count (`extrapolate`), so the parts
  sum to the peak. The planner's tests check the extrapolation against a full trace.
- **Micro-batches**: an optimizer step of K equal micro-batches peaks in its second (the first runs
  before any gradient exists, the later ones repeat the second), so two micro-batches per rank are traced.
- **Phases**: the passes (forward, backward, clipping) and the optimizer step peak at different moments;
  each is measured on its own (the tracker's peak is reset when AdamW starts) and extrapolated on its own.
  From the second optimizer step on (and in every `update` after the first, which resumes AdamW's state)
  the moments are held while the passes run: the steady peak is max(passes + moments, optimizer step).

The stage's code runs as it is. Three things make it run on fake tensors, all confined to the tracing
process (`python -m rlkit.planner.trace`, a child of the planner, so a stage's own process group and
torch state are never touched): host-side bookkeeping on real CPU tensors (row indices, loss weights) runs
for real, outside the fake mode; a value read back from a fake tensor (the step's one host sync) reads as
0; `Module.to` is a no-op (the fake model already sits on the tracing device). The GPU's choices are made
as on a GPU: bf16 compute under `--dtype auto`, the default token budget per micro-batch, bf16 frozen
LoRA bases and FSDP2's bf16 mixed-precision policy, through the functions the stages call.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

# MemTracker's categories -> the planner's parts (FSDPMemTracker names the sharded and gathered ones apart)
PARTS = {
    "Parameter": "weights", "Buffer": "weights", "Sharded Param": "weights", "Unsharded Param": "weights",
    "All Gather": "weights", "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "Reduce Scatter": "gradients", "Optstate": "optimizer", "OptState": "optimizer", "Activation": "activations",
    "Temp": "activations", "Other": "activations", "Inputs": "activations",
}
PART_NAMES = ("weights", "gradients", "optimizer", "activations")
TRACE_LAYERS = (1, 2, 3)  # the first layer counts traced; every figure is extrapolated from alike ones


@dataclass(frozen=True)
class Spec:
    """One step to trace. `rows`: rows of one optimizer step (all ranks together; score-ref: one forward
    batch), each `prompt` + `completion` tokens; `train`: TrainOptions' fields (dtype concrete, as on the GPU:
    bf16 or fp32), `micro_tokens` the token budget when the GPU default applies; `algo`: update's --algo."""

    stage: str  # update | sft | train-rm | score-ref
    config: dict  # the model's config.json
    rows: int
    prompt: int
    completion: int
    world: int = 1
    train: dict = field(default_factory=dict)
    algo: str = "grpo"
    beta: float = 0.0
    reward_model: bool = False  # score-ref: a reward model (sequence classification) instead of the reference
    exact: bool = False  # trace every layer (no extrapolation): what the extrapolation is checked against

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


# -- the tracing process


def _modes():
    """The tracer's dispatch modes and tracker, built once torch is imported."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from torch.utils._pytree import tree_flatten

    class HostReal(TorchDispatchMode):
        """Ops on real tensors only (the engine's host bookkeeping: rows, loss weights) run for real; a
        value read from a fake tensor reads as 0; tensors as wide as the vocabulary are counted while live
        (`logits_peak`: the logits and their gradient)."""

        def __init__(self, vocab: int) -> None:
            super().__init__()
            self.vocab, self.live, self.logits_peak = vocab, {}, 0
            self._refs: dict[int, int] = {}

        def _count(self, t) -> None:
            if not isinstance(t, FakeTensor) or t.dim() < 2 or t.shape[-1] != self.vocab:
                return
            st = t.untyped_storage()
            key = st._cdata
            if key not in self._refs:
                self.live[key] = st.nbytes()
                self.logits_peak = max(self.logits_peak, sum(self.live.values()))
            self._refs[key] = self._refs.get(key, 0) + 1
            weakref.finalize(t, self._drop, key)

        def _drop(self, key: int) -> None:
            self._refs[key] -= 1
            if not self._refs[key]:
                del self._refs[key]
                self.live.pop(key, None)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            flat, _ = tree_flatten((args, kwargs))
            tensors = [x for x in flat if isinstance(x, torch.Tensor)]
            if func is torch.ops.aten._local_scalar_dense.default and isinstance(tensors[0], FakeTensor):
                return False if tensors[0].dtype == torch.bool else 0
            if tensors and not any(isinstance(x, FakeTensor) for x in tensors):
                with _disable_current_modes():
                    return func(*args, **kwargs)
            out = func(*args, **kwargs)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._count(t)
            return out

    class StepTracker(MemTracker):
        """MemTracker over one optimizer step of several micro-batches: the root module's second forward
        starts a new iteration of module statistics (the step's peak runs on)."""

        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                parents = set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
                if parents == {"Global"}:
                    self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # gradient hooks on the trained parameters only (a frozen LoRA base cannot take one)
            out = super()._track_module_params_and_buffers(module, install_grad_hooks=False)

            def grad(g) -> None:
                self._update_and_maybe_create_winfos(g, _MemRefType.GRAD)

            if install_grad_hooks:
                for p in module.parameters():
                    if p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                        self._param_to_grad_hook_handles[p] = (
                            p.register_hook(grad), p.register_post_accumulate_grad_hook(lambda q: grad(q.grad)))
            return out

        def restart_peak(self) -> dict:
            """The peak so far; the peak then counts from now."""
            peak = self.get_tracker_snapshot("peak")
            now = self.get_tracker_snapshot("current")
            self._peak_mem_snap = now
            self._peak_mem = {d: s["Total"] for d, s in now.items()}
            return peak

    def fsdp_tracker():
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        class FSDPStepTracker(FSDPMemTracker, StepTracker):
            """FSDPMemTracker over several micro-batches (the root unit's second forward: a new iteration)."""

            def _fsdp_state_pre_forward(self, fsdp_mod, orig):
                inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

                def again(*args, **kwargs):
                    if fsdp_mod in self.memory_tracking and not self._mod_tracker.is_bw:
                        fqn = self._mod_tracker.get_known_fqn(fsdp_mod)
                        if set(self._mod_tracker.parents) - {fqn} == {"Global"}:
                            self.reset_mod_stats()
                    return inner(*args, **kwargs)

                return again

        return FSDPStepTracker

    return HostReal, StepTracker, fsdp_tracker


def _parts(snap: dict) -> dict[str, int]:
    out = dict.fromkeys(PART_NAMES, 0)
    for dev_snap in snap.values():
        for k, v in dev_snap.items():
            name = PARTS.get(str(getattr(k, "value", k)))
            if name is not None:
                out[name] += int(v)
    return out


def _model_config(spec: Spec, layers: int):
    from transformers import AutoConfig

    d = {k: v for k, v in spec.config.items() if not k.startswith("_") and k not in ("architectures", "transformers_version")}
    kind = d.pop("model_type")
    d["num_hidden_layers"] = layers
    d.pop("layer_types", None)  # per-layer lists follow num_hidden_layers
    d.pop("torch_dtype", None)
    d.pop("dtype", None)
    cfg = AutoConfig.for_model(kind, **d)
    cfg._attn_implementation = "sdpa"
    if spec.reward_model or spec.stage == "train-rm":
        cfg.num_labels = 1
        cfg.pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    return cfg


def _train_options(spec: Spec):
    from rlkit.training import TrainOptions
    from rlkit.training.lora import LoraOptions

    t = dict(spec.train)
    lora = t.pop("lora", None)
    return TrainOptions(**t, lora=LoraOptions(**lora) if lora else None)


def real_step(spec: Spec, device: str) -> tuple[Any, Any]:
    """The spec's model and step built for real on `device` (fp32 masters, the spec's options): what a plan of
    the spec is checked against. -> (model, step: call `.run()` for one optimizer step)."""
    cfg = _model_config(spec, int(spec.config["num_hidden_layers"]))
    model, step, _ = _build(spec, cfg, _train_options(spec), None, int(spec.config["num_hidden_layers"]), device)
    return model, step


def _rows_traced(spec: Spec, opts) -> int:
    """Rows that give every rank two micro-batches (the step's peak), at most the step's rows."""
    length = spec.prompt + spec.completion
    per_micro = opts.micro_batch_size
    pairs = spec.stage == "train-rm" or (spec.stage == "update" and spec.algo == "dpo")  # both sides in one pass
    if per_micro is None and opts.micro_batch_tokens is not None:
        per_micro = max(1, opts.micro_batch_tokens // (2 * length if pairs else length))
    if per_micro is None:
        return spec.rows
    return min(spec.rows, 2 * per_micro * spec.world)


def trace_one(spec: Spec, layers: int) -> dict[str, Any]:
    """Trace `spec` with `layers` decoder layers -> the measured figures (bytes)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rlkit.training.distributed import DataParallel

    HostReal, StepTracker, fsdp_tracker = _modes()
    cfg = _model_config(spec, layers)
    opts = _train_options(spec)
    vocab = int(cfg.vocab_size)
    dp = None
    if spec.world > 1:
        dp = DataParallel(0, spec.world, torch.device("cpu"))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    host_bytes = 0
    with fake:
        model, step, host_bytes = _build(spec, cfg, opts, dp, layers)
    tracked = getattr(model, "_rlkit_fsdp_root", model)
    if spec.world > 1:
        Tracker = fsdp_tracker()
        mt = Tracker(tracked, step.opt) if step.opt is not None else Tracker(tracked)
    else:
        mt = StepTracker()
        mt.track_external(*([model, step.opt] if step.opt is not None else [model]))
    host = HostReal(vocab)
    phases: dict[str, Any] = {}
    if step.opt is not None:
        def before_step(*_):
            phases["passes"] = mt.restart_peak()

        step.opt.register_step_pre_hook(before_step)
    with fake, mt, host:
        step.run()
        end = mt.get_tracker_snapshot("peak")
        current = mt.get_tracker_snapshot("current")
    passes = phases.get("passes", end)
    out = {"passes": _parts(passes), "passes_total": sum(_parts(passes).values()),
           "step": _parts(end) if "passes" in phases else None,
           "step_total": sum(_parts(end).values()) if "passes" in phases else 0,
           "optimizer": _parts(current)["optimizer"], "logits": host.logits_peak, "host_bytes": host_bytes}
    return out


class _Step:
    def __init__(self, run, opt) -> None:
        self.run, self.opt = run, opt


def _build(spec: Spec, cfg, opts, dp, layers: int, device: str = "cpu"):
    """The stage's model and engine, and the step to trace -> (model, _Step, batch bytes per row). Under the fake
    mode for a plan; for real on `device` where a plan is checked against the real step (tests/gpu)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlkit.training import Optim

    length = spec.prompt + spec.completion
    rows = _rows_traced(spec, opts)
    if spec.stage == "score-ref":
        from rlkit.planner import scoring_dtype

        cls = AutoModelForSequenceClassification if spec.reward_model else AutoModelForCausalLM
        model = cls.from_config(cfg, torch_dtype=getattr(torch, scoring_dtype(spec.train.get("dtype", "bf16")))).eval()
        tokens = [[1] * length for _ in range(rows)]
        prompts = [spec.prompt] * rows

        def run() -> None:
            from rlkit.ops.packing import layout

            seqs = layout(tokens, prompts, packed=opts.packing)
            with torch.no_grad():
                if spec.reward_model:
                    from rlkit.scorers.reward_model import seq_scores

                    seq_scores(model, seqs)
                else:
                    from rlkit.ops.logprobs import completion_logprobs

                    completion_logprobs(model, seqs)

        return model, _Step(run, None), 0
    base_kind = "seq-cls" if spec.stage == "train-rm" else "causal-lm"
    cls = AutoModelForSequenceClassification if base_kind == "seq-cls" else AutoModelForCausalLM
    model = cls.from_config(cfg, torch_dtype=torch.float32)
    base = _lora_base() if opts.lora is not None else None
    if spec.stage == "update":
        from rlkit.algorithms.base import Context
        from rlkit.algorithms.batch import RLBatch
        from rlkit.algorithms.config import RLConfig
        from rlkit.algorithms.trainer import Trainer

        n, c = rows, spec.completion

        def const(value, *shape, dtype=None):
            """A host tensor of `shape` holding `value` everywhere, one element of storage (stride 0): the plan
            never allocates a sequence-sized tensor for real."""
            return torch.tensor(value, dtype=dtype).expand(*shape)

        with _real():
            if spec.algo == "dpo":  # `rows` preference pairs: chosen and rejected, each `length` tokens
                from rlkit.algorithms.batch import PrefBatch

                batch = PrefBatch(const(1, 2 * n, length), const(1, 2 * n, length), const(1, 2 * n, c),
                                  const(True, 2 * n, c), torch.full((2 * n,), spec.prompt - 1),
                                  torch.full((2 * n,), -5.0), torch.zeros(n, dtype=torch.bool))
            else:  # `rows` rollouts, groups of two with rewards 0 and 1
                batch = RLBatch(const(1, n, length), const(1, n, length), const(1, n, c), const(True, n, c),
                                torch.full((n,), spec.prompt - 1), const(-0.5, n, c),
                                const(-0.5, n, c) if spec.beta > 0 else None,
                                (torch.arange(n) % 2).float(), torch.arange(n) // 2)
            host_bytes = sum(t.nbytes for t in batch if t is not None) // n  # per row
        t = Trainer(model, RLConfig(algo=spec.algo, beta=spec.beta, minibatch_size=rows), train=opts, base=base,
                    device=device, dp=dp)
        with _real():  # as Trainer.train does: the batch on the device once, its host copy for sizes
            from rlkit import devices

            plan = t.algo.prepare(t, devices.to_device(batch, t.device), t.cfg,
                                  Context(1.0, float(c), False, None, batch))

        def run() -> None:
            t.step(plan, plan.rows)

        return t.model, _Step(run, t.opt), host_bytes
    from rlkit.training.engine import Engine
    from rlkit.training.supervised import BradleyTerry, CrossEntropy

    if spec.stage == "sft":
        objective = CrossEntropy()
        with _real():
            plan = objective.plan([[1] * length for _ in range(rows)], [spec.prompt] * rows)
    else:  # train-rm: pairs, each side `length` tokens
        objective = BradleyTerry()
        with _real():
            plan = objective.plan([[1] * length for _ in range(rows)], [[2] * length for _ in range(rows)], range(rows))
    eng = Engine(model, objective, Optim(lr=1e-5), train=opts, kind=base_kind, base=base, dp=dp, device=device,
                 name=spec.stage)

    def run() -> None:
        eng.step(plan, plan.rows)

    return eng.model, _Step(run, eng.opt), 0


def _real():
    """Host tensors made for real inside the fake mode (the batch the trainer reads on the host)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


_LORA_BASE: list = []


def _lora_base():
    """A directory LoRA's `base` may name (peft records it; nothing is read from it)."""
    import tempfile

    if not _LORA_BASE:
        _LORA_BASE.append(tempfile.mkdtemp(prefix="rlkit-plan-"))
    return _LORA_BASE[0]


def extrapolate(at: dict[int, dict], layers: int) -> dict[str, Any]:
    """Figures measured at two layer counts -> at `layers` (each linear in the layer count). Nothing is clipped:
    the parts of a snapshot sum to its total, so the extrapolated parts sum to the extrapolated total."""
    (a, fa), (b, fb) = sorted(at.items())[:2]

    def lin(x, y):
        if isinstance(x, dict):
            return {k: lin(x[k], y[k]) for k in x}
        if x is None:
            return None
        return round(x + (layers - a) * (y - x) / (b - a))

    return {k: lin(fa[k], fb[k]) for k in fa}


def _slopes(fa: dict, fb: dict) -> list[tuple[int, int]]:
    """(per-layer growth, size) of every figure from one layer count to the next (the snapshots' parts included)."""
    out = []
    for k in ("passes", "step"):
        if fa[k] is not None:
            out += [(fb[k][p] - fa[k][p], max(fa[k][p], fb[k][p])) for p in PART_NAMES]
    return out + [(fb["optimizer"] - fa["optimizer"], fb["optimizer"])]


def linear(f1: dict, f2: dict, f3: dict) -> bool:
    """Whether three traces at consecutive layer counts grow alike (every part by the same bytes a layer, to 1% of
    the largest), so their peaks are the same moment of the step and one more layer adds the same again."""
    s12, s23 = _slopes(f1, f2), _slopes(f2, f3)
    scale = max([abs(d) for d, _ in s12 + s23] + [1])
    return all(abs(x - y) <= 0.01 * scale + 4096 for (x, _), (y, _) in zip(s12, s23, strict=True))


def _setup_world(world: int) -> None:
    """A fake process group of `world` ranks (this process is rank 0) and its CPU mesh, made before any fake
    tensor exists; `init_device_mesh` then returns that mesh (FSDP2's sharding reads it)."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as dm
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() == world:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = dm.init_device_mesh("cpu", (world,))
    dm.init_device_mesh = lambda *a, **k: mesh


def _as_on_gpu() -> None:
    """What the stages choose on a GPU, chosen here for the CPU the trace runs on."""
    import torch

    from rlkit import console

    torch.nn.Module.to = lambda self, *a, **k: self  # the fake model already sits where it is traced
    console.silence()
    from rlkit import planner

    planner.on_gpu_hooks()


def measure(spec: Spec) -> dict[str, Any]:
    """`spec` traced at a few layer counts and extrapolated to its model's layers, in this process. The peak of a
    step with few layers can fall at another moment than with many (the logits' peak at the end of the forward
    against the embedding's gradient at the end of the backward): the counts traced go up from TRACE_LAYERS
    until three consecutive ones grow alike (`linear`), or the model is traced whole."""
    if spec.world > 1:
        _setup_world(spec.world)
    t0 = time.monotonic()
    layers = int(spec.config["num_hidden_layers"])
    first = TRACE_LAYERS[0]
    if spec.exact or layers <= first + 2:
        out = trace_one(spec, layers)
    else:
        got = {n: trace_one(spec, n) for n in range(first, first + 3)}
        n = first
        while not linear(got[n], got[n + 1], got[n + 2]) and n + 3 < layers:
            n += 1
            got[n + 2] = trace_one(spec, n + 2)
        if linear(got[n], got[n + 1], got[n + 2]):
            out = extrapolate({n + 1: got[n + 1], n + 2: got[n + 2]}, layers)
        else:  # no run of alike layers below the model's count: the model whole
            out = trace_one(spec, layers)
        out["layers_traced"] = sorted(got)
    out["trace_s"] = round(time.monotonic() - t0, 2)
    return out


def main(argv: list[str]) -> None:
    """`python -m rlkit.planner.trace` reads a JSON list of specs on stdin and prints one JSON line per spec."""
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    _as_on_gpu()
    specs = json.loads(sys.stdin.read())
    for d in specs:
        try:
            res = measure(Spec(**d))
        except Exception as e:  # noqa: BLE001 (the parent says which spec could not be traced)
            res = {"error": f"{type(e).__name__}: {e}"}
        print("@@plan " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
