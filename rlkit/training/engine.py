"""rlkit's one training engine: `Engine` owns a model (LoRA and gradient checkpointing applied, FSDP2-sharded
under torchrun), its AdamW and counters, the compute precision, and the optimizer step: the data-parallel
split of a batch of rows, its micro-batches with gradient accumulation, backward, clipping, the
non-finite check, the step, and the loss and gradient-norm figures. `sft`, `train-rm` and every `update
--algo` train through it; what they differ in is an `Objective`: what a batch means (`Plan`) and one
micro-batch's loss terms (`step`).

One optimizer step over rows `rows` of a plan (`Engine.step`):

    mine = rows[rank::world]                                  # data parallel: this rank's rows
    for micro in micro_batches(mine):                         # --micro-batch-size / --micro-batch-tokens
        out = objective.step(engine, plan, Minibatch(micro, shares))
        backward(out.loss)                                    # gradients accumulate
    clip; one host sync for every figure; AdamW step

Exact normalisation. Every loss term is an average over something additive (tokens, sequences, pairs):
`Plan.weights[term](rows)`. A micro-batch scales its term by its share of that weight in the whole
optimizer step, w(micro) / w(rows), times the world size under data parallelism (FSDP averages the
ranks' gradients), so the accumulated gradient is the one-forward, one-process gradient whatever the
micro-batching and the world size (to float summation order). The ranks run equally many micro-batches
(FSDP's collectives need it): a rank with fewer runs empty ones (one row, weight 0).

Kept torch-light at import: nothing here imports an algorithm (they import it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from rlkit import devices
from rlkit.errors import RlkitError, non_finite_cause
from rlkit.ops.packing import Seqs, layout
from rlkit.training import Optim, Precision, TrainOptions
from rlkit.training.distributed import DataParallel, host64, mean_over_ranks

TRAINER_DIR = "trainer"


# -- what an objective and the engine pass each other


@dataclass(kw_only=True)
class Plan:
    """What `Objective.prepare` made of one batch; objectives subclass it for their own tensors."""

    batch: Any
    rows: Tensor  # (R,) long, on the host: the batch rows trained on
    # per loss term: what it averages over, rows (r,) -> weight (tokens, sequences, pairs): additive over rows.
    # A micro-batch (or a data-parallel rank) scales the term by its share of the step's weight.
    weights: dict[str, Callable[[Tensor], Any]]
    lengths: Tensor | None = None  # (N,) tokens each row runs forward (--micro-batch-tokens); None: rows only
    metrics: dict[str, Any] = field(default_factory=dict)  # known before the first step
    sums: tuple[str, ...] = ()  # names of `StepOut.sums`, added up over steps (and ranks)
    maxes: tuple[str, ...] = ()  # names of `StepOut.maxes`, maximised over steps (and ranks)


class Minibatch(NamedTuple):
    """One micro-batch of an optimizer step, as the objective's `step` sees it."""

    idx: Tensor  # (r,) the rows, on the engine's device
    shares: dict[str, float]  # per loss term: its factor (1.0 for a whole step in one process; 0.0: weighs nothing)
    epoch: int
    first: bool  # the first micro-batch of the run's first step (`non_finite_error` then blames the starting weights)
    rows: Tensor | None = None  # the same rows on the host (None: idx)


class StepOut(NamedTuple):
    """One micro-batch's result: the engine backpropagates `loss` and logs each of `terms`. Figures stay ()
    tensors on the device: the engine reads them all on the host in one sync per optimizer step."""

    loss: Tensor  # () what backward runs on: the sum of the terms
    terms: dict[str, Tensor]  # () each logged term ("loss" first: the progress bar shows it)
    sums: dict[str, Tensor | float] = {}  # counts for metrics (clipped tokens, ...), keys from Plan.sums
    maxes: dict[str, Tensor | float] = {}  # keys from Plan.maxes (-inf: none in this step)
    tokens: int = 0  # tokens run forward (tokens_per_s), counted on the host
    inputs: Callable[[], dict] | None = None  # what the step read, root causes first (non_finite_error)


class StepFigures(NamedTuple):
    """One optimizer step, read on the host: its loss terms (global under data parallelism), the gradient
    norm before clipping, the objective's sums and maxes (this rank's), the tokens this rank ran."""

    terms: dict[str, float]
    grad_norm: float
    sums: dict[str, float]
    maxes: dict[str, float]
    tokens: int
    positions: int  # positions run forward (tokens + padding): padding fraction = 1 - tokens / positions


class Objective:
    """What a training stage optimises (SFT's cross-entropy, the reward model's Bradley-Terry loss, an
    --algo's policy loss). `prepare` turns a batch into a Plan, `step` one micro-batch into loss terms,
    `finish` the sums into metrics; an objective may train models beside the engine's (PPO's critic)."""

    def trained(self) -> list[Trained]:
        """Extra models the engine steps with its own (one backward, one loss scale)."""
        return []

    def step(self, engine: Engine, plan: Plan, mb: Minibatch) -> StepOut:
        raise NotImplementedError


# -- optimizer state


@dataclass
class TrainerState:
    """What carries over between `update` processes besides the weights."""

    optimizer_step: int = 0
    updates: int = 0
    precision: dict | None = None  # rlkit.training.Precision.state(): the fp16 loss scale to resume with

    def lr_factor(self, warmup: int) -> float:
        return min(1.0, (self.optimizer_step + 1) / warmup) if warmup > 0 else 1.0


@dataclass
class Trained:
    """A model the engine trains, with its own AdamW and counters: the engine's, or an objective's (PPO's critic)."""

    model: Any
    opt: torch.optim.Optimizer
    state: TrainerState
    grad_clip: float | None = None  # None: the engine's


def make_optimizer(model, optim: Optim) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (LoRA: the adapter only); state is saved per parameter name."""
    from rlkit.training import make_adamw

    return make_adamw(model, optim.lr, optim.weight_decay, betas=optim.betas, eps=optim.eps)


def trainer_tensors(model, opt: torch.optim.Optimizer, dp: DataParallel | None = None) -> dict[str, Tensor]:
    """AdamW moments and step per parameter name plus the torch RNG, unsharded (a collective under `dp`)."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if dp is not None:
        from rlkit.training.distributed import full_optimizer_state

        per_name = full_optimizer_state(model, opt)
    else:
        per_name = {name: opt.state[p] for name, p in model.named_parameters() if opt.state.get(p)}
    for name, st in per_name.items():
        for k in ("exp_avg", "exp_avg_sq"):
            tensors[f"{name}/{k}"] = st[k].detach().contiguous()
        tensors[f"{name}/step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1)
    return tensors


def save_trainer(model, opt: torch.optim.Optimizer | None, state: TrainerState, d: Path,
                 tensors: dict[str, Tensor] | None = None) -> None:
    """safetensors + JSON: the same layout whatever the world size, so any world size resumes it."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors if tensors is not None else trainer_tensors(model, opt), str(d / "optimizer.safetensors"))
    s = {"optimizer_step": state.optimizer_step, "updates": state.updates}
    if state.precision:
        s["precision"] = state.precision
    (d / "state.json").write_text(json.dumps(s) + "\n")


def load_trainer(model, opt: torch.optim.Optimizer, d: Path, dp: DataParallel | None = None) -> TrainerState:
    """Restore what `save_trainer` wrote; a checkpoint without it (an SFT model) starts fresh. Under `dp`
    the full state is sharded onto this rank's FSDP parameters."""
    from safetensors.torch import load_file

    if not (d / "optimizer.safetensors").is_file():
        return TrainerState()
    tensors = load_file(str(d / "optimizer.safetensors"))
    names = [name for name, _ in model.named_parameters()]
    per_name = {name: {"step": tensors[f"{name}/step"].reshape(()).clone(),
                       "exp_avg": tensors[f"{name}/exp_avg"].float(),
                       "exp_avg_sq": tensors[f"{name}/exp_avg_sq"].float()}
                for name in names if f"{name}/exp_avg" in tensors}
    if dp is not None:
        from rlkit.training.distributed import load_full_optimizer_state

        load_full_optimizer_state(model, opt, per_name)
    else:
        for name, p in model.named_parameters():
            if name in per_name:
                st = per_name[name]
                opt.state[p] = {"step": st["step"], "exp_avg": st["exp_avg"].to(device=p.device, dtype=p.dtype),
                                "exp_avg_sq": st["exp_avg_sq"].to(device=p.device, dtype=p.dtype)}
    torch.set_rng_state(tensors["rng/torch"])
    s = json.loads((d / "state.json").read_text())
    return TrainerState(optimizer_step=s["optimizer_step"], updates=s["updates"], precision=s.get("precision"))


def non_finite_error(what: str, step: int, lr: float, inputs: Callable[[], dict] | None) -> RlkitError:
    """A NaN/inf `what` (loss, gradient): the step's non-finite input when one was (`inputs()`: what to
    call it -> tensor or model, see `rlkit.errors.non_finite_cause`), else the step diverged: lower --lr."""
    cause = non_finite_cause(inputs()) if inputs is not None else None
    tail = f": {cause}" if cause else f" (lower --lr, now {lr})"
    return RlkitError(f"non-finite {what} at optimizer step {step}; nothing was written{tail}")


# -- micro-batches


def micro_batches(rows: Tensor, lengths: Tensor | None, size: int | None, tokens: int | None) -> list[Tensor]:
    """`rows` (host, in order) cut into the micro-batches of one optimizer step: at most `size` rows each,
    or rows taken in order while their `lengths` sum to at most `tokens` (a row longer than that runs
    alone: never dropped); neither: one micro-batch of every row."""
    if tokens is not None and lengths is not None:
        out, cur, n = [], [], 0
        for r, length in zip(rows.tolist(), lengths[rows].tolist(), strict=True):
            if cur and n + length > tokens:
                out.append(cur)
                cur, n = [], 0
            cur.append(r)
            n += length
        if cur:
            out.append(cur)
        return [torch.tensor(c, dtype=torch.long) for c in out]
    if size is not None:
        return list(rows.split(size))
    return [rows]


class Engine:
    """A model and its optimizer, stepped by an objective's micro-batches. See the module docstring.

        engine = Engine(model, objective, Optim(lr=1e-5), train=TrainOptions(micro_batch_size=4))
        figures = engine.step(plan, rows)      # one optimizer step on `rows` of `plan`

    `train` (TrainOptions): precision, gradient checkpointing, LoRA (a fresh adapter on `model`, whose
    weights came from directory `base`), micro-batches and packing. `dp`: data parallelism (FSDP2);
    `shard_fn`: the forward FSDP's root unit runs (`rlkit.training.distributed.shard_model`); `setup(model)`:
    runs once the model is prepared (LoRA), before it is sharded or moved. `runtime`: a stage's
    `rlkit.training.runtime.Runtime`, in place of `train`, `dp` and `device`."""

    def __init__(self, model, objective: Objective, optim: Optim, *, train: TrainOptions = TrainOptions(),
                 kind: str = "causal-lm", base: Path | None = None, dp: DataParallel | None = None, device=None,
                 tokenizer=None, trust_remote_code: bool = False, shard_fn=None, name: str = "train",
                 setup: Callable[[Any], None] | None = None, runtime=None) -> None:
        from rlkit import training

        if runtime is not None:  # a stage's Runtime (rlkit.training.runtime): device, options and world in one
            train, dp, device = runtime.train, runtime.dp, runtime.device
        self.objective, self.optim, self.name = objective, optim, name
        # the device everything trains on: the data-parallel rank's, else `device` (default the CPU)
        self.device = dp.device if dp is not None else torch.device(device) if device is not None else torch.device("cpu")
        train = train.on(self.device)  # --dtype auto made concrete
        self.tokenizer, self.train_options, self.dp, self.trust_remote_code = tokenizer, train, dp, trust_remote_code
        self.prec = Precision(train.dtype, self.device.type, sharded=dp is not None)
        model = training.prepare_model(model, train, kind, base=base)
        if setup is not None:  # e.g. a resume snapshot's weights: on the whole model, before it is sharded
            setup(model)
        if dp is not None:
            from rlkit import console
            from rlkit.training import distributed

            model = distributed.shard_model(model, dp, shard_fn, train.dtype)
            mixed = training.fsdp_param_dtype(train.dtype, dp.device.type)
            console.info(f"{name}: data-parallel over {dp.world} processes ({dp.device.type}, FSDP2"
                         + (f", {mixed} all-gathers" if mixed else "")
                         + (", fused AdamW" if training.fused_adamw([dp.device.type]) else "") + ")")
        else:
            from rlkit.training import lora

            lora.hold_base(model, train.dtype, self.device)  # LoRA in bf16 on a GPU: the frozen base held in bf16
            model.to(self.device)
        self.model = model
        self.opt = make_optimizer(model, optim)
        self.state = TrainerState()
        self.padding = [0, 0]  # [tokens, positions] run forward since the last `padding_fraction()`

    @property
    def trained(self) -> list[Trained]:
        return [Trained(self.model, self.opt, self.state), *self.objective.trained()]

    # -- layouts
    def layout(self, tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> Seqs:
        """Sequences laid out for a forward pass on the engine's device, packed unless --no-packing: rows as
        long as the longest sequence (sdpa/eager attention), or one row under FlashAttention (varlen)."""
        packed = self.train_options.packing
        varlen = "flash" in str(getattr(getattr(self.model, "config", None), "_attn_implementation", ""))
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        seqs = layout(tokens, prompt_lens, packed=packed, capacity=None if varlen else 0, pad_id=pad)
        self.padding[0] += seqs.tokens
        self.padding[1] += seqs.positions
        return seqs.to(self.device)

    def padding_fraction(self) -> float | None:
        """Padded share of the positions run forward since the last call (None: none ran); resets the count."""
        tokens, positions = self.padding
        self.padding = [0, 0]
        return round(1 - tokens / positions, 4) if positions else None

    # -- one optimizer step
    def step(self, plan: Plan, rows: Tensor, *, epoch: int = 0, first: bool = False, lr: float | None = None,
             grad_clip: float | None = None) -> StepFigures:
        """One optimizer step on rows `rows` (host) of `plan`, through this rank's micro-batches: backward each
        (loss-scaled under fp16), clip, then ONE host sync for the step's figures, then step every trained
        model (`lr`: the engine's learning rate for this step; an objective's model keeps its own). A NaN/inf
        loss term or (fp32/bf16) gradient aborts before the optimizer steps, so nothing is written and the
        weights stay as they were; an fp16 overflow skips the step as any loss scaler does."""
        trained = self.trained
        for t in trained:
            t.opt.zero_grad(set_to_none=True)
        if lr is not None:
            for g in self.opt.param_groups:
                g["lr"] = lr
        world = self.dp.world if self.dp is not None else 1
        totals = {k: float(w(rows)) for k, w in plan.weights.items()}
        per_rank = [rows[r::world] for r in range(world)]
        cuts = [self._micro(plan, mine) for mine in per_rank]
        mine = cuts[self.dp.rank if self.dp is not None else 0]
        n = max(len(c) for c in cuts)
        mine = mine + [None] * (n - len(mine))  # empty micro-batches: FSDP's collectives run on every rank
        terms: dict[str, Tensor] = {}
        sums: dict[str, Any] = {}
        maxes: dict[str, Any] = {}
        tokens = positions = 0
        inputs = None
        for k, micro in enumerate(mine):
            if micro is None or len(micro) == 0:
                micro, shares = rows[:1], dict.fromkeys(plan.weights, 0.0)
            else:
                shares = {t: (float(w(micro)) / totals[t] * world if totals[t] > 0 else 0.0)
                          for t, w in plan.weights.items()}
            before = self.padding[:]
            out = self.objective.step(self, plan, Minibatch(devices.to_device(micro, self.device), shares, epoch,
                                                            first and k == 0, micro))
            self.prec.backward(out.loss)
            for name, v in out.terms.items():
                terms[name] = v.detach() if name not in terms else terms[name] + v.detach()
            for name, v in out.sums.items():
                sums[name] = v if name not in sums else sums[name] + v
            for name, v in out.maxes.items():
                maxes[name] = v if name not in maxes else torch.maximum(torch.as_tensor(maxes[name]), torch.as_tensor(v))
            if any(shares.values()):
                tokens += out.tokens
                positions += self.padding[1] - before[1]
            if inputs is None:
                inputs = out.inputs
        groups = [(t.model.parameters(), t.opt, t.grad_clip if t.grad_clip is not None else
                   grad_clip if grad_clip is not None else self.optim.grad_clip) for t in trained]
        norms = self.prec.clip(groups)
        nt, ns = len(terms), len(sums)
        if self.dp is None:
            got = devices.host([*terms.values(), *sums.values(), *maxes.values(), *norms])
        else:  # the terms' mean over the ranks on the device, then the same one host read
            got = host64([*mean_over_ranks(list(terms.values()), self.dp), *sums.values(), *maxes.values(), *norms])
        values = got[:nt]
        sums_v = dict(zip(sums, got[nt : nt + ns], strict=True))
        maxes_v = dict(zip(maxes, got[nt + ns : nt + ns + len(maxes)], strict=True))
        norm_values = got[len(got) - len(norms):]
        if not all(math.isfinite(v) for v in values):
            raise non_finite_error("loss", self.state.optimizer_step, self.optim.lr, inputs)
        stepped = self.prec.apply(groups, all(math.isfinite(v) for v in norm_values))
        if not stepped and self.prec.scaler is None:
            raise non_finite_error("gradient", self.state.optimizer_step, self.optim.lr, inputs)
        for t in trained:
            t.state.optimizer_step += 1
        return StepFigures(dict(zip(terms, values, strict=True)), float(norm_values[0]), sums_v, maxes_v, tokens,
                           positions)

    def forward_chunks(self, rows: Tensor, lengths: Tensor | None, chunk_rows: int) -> list[Tensor]:
        """`rows` cut for forward-only passes (scoring, pi_old): `chunk_rows` rows at a time, or this engine's
        micro-batches when they are smaller."""
        size, tokens = self.train_options.micro_limits(self.device)
        return [m for c in rows.split(chunk_rows) for m in micro_batches(c, lengths, size, tokens)]

    def forward_rows(self, rows: Tensor, lengths: Tensor | None, chunk_rows: int, fn: Callable[[Tensor], Tensor],
                     out: Tensor) -> Tensor:
        """A forward-only pass over `rows` (host), no grad: `fn(chunk)` -> (len(chunk), *tail) on the device for
        each chunk (`forward_chunks`), written into `out` (len(rows), *tail) in `rows`' order; returns `out`.
        Data-parallel, each rank runs rows rank::world only (as `step` trains them), every rank the same number
        of forward passes (FSDP's collectives need it: a rank with fewer runs a one-row pass whose result it
        drops), and one all_gather puts every rank's rows into `out` on every rank. `self.forward_rows_run`:
        the rows this process ran (its share)."""
        world = self.dp.world if self.dp is not None else 1
        pos = torch.arange(len(rows))
        cuts = [self.forward_chunks(pos[r::world], lengths[rows] if lengths is not None else None, chunk_rows)
                for r in range(world)]
        rank = self.dp.rank if self.dp is not None else 0
        mine = cuts[rank] + [None] * (max(map(len, cuts), default=0) - len(cuts[rank]))
        local = out if self.dp is None else out.new_zeros((len(pos[rank::world]), *out.shape[1:]))
        at = 0
        with torch.no_grad():
            for c in mine:
                if c is None:  # an empty pass: the collectives of a forward, nothing kept
                    fn(rows[:1])
                    continue
                local[at : at + len(c)] = fn(rows[c])
                at += len(c)
        self.forward_rows_run = at
        if self.dp is not None:
            from rlkit.training.distributed import gather_rows

            out.copy_(gather_rows(local, len(rows), self.dp))
        return out

    def _micro(self, plan: Plan, mine: Tensor) -> list[Tensor]:
        return micro_batches(mine, plan.lengths, *self.train_options.micro_limits(self.device))

    # -- save and resume
    def load_state(self, src: Path) -> None:
        """Optimizer state, counters, RNG and loss scale from checkpoint `src`'s trainer/ (fresh when it has none)."""
        self.state = load_trainer(self.model, self.opt, src / TRAINER_DIR, self.dp)
        self.prec.load_state(self.state.precision)
