"""The `Algorithm` interface `rlkit.algorithms.trainer.Trainer` drives, and the small records passed between them.

One update, as the trainer runs it:

    plan = algo.prepare(trainer, batch, cfg, ctx)      # once: advantages, pi_old, rows to train
    for each epoch, each shuffled minibatch of plan.rows (this rank's share under data parallelism):
        out = algo.step(trainer, plan, minibatch)      # forward + loss terms (+ counts for metrics)
        trainer: backward, clip, step every trained model
    metrics = algo.finish(trainer, plan, sums, maxes)  # after the epochs

Everything else (optimizer, precision, the shuffle, the data-parallel split, the optimizer step,
loss and gradient-norm logging, save and resume) is the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from torch import Tensor

from rlkit.algorithms.config import RLConfig
from rlkit.training.engine import Minibatch, Objective, StepOut  # noqa: F401 (an algorithm's step reads and returns them)
from rlkit.training.engine import Plan as EnginePlan

if TYPE_CHECKING:
    from rlkit.training.engine import Engine as Trainer
    from rlkit.training.engine import Trained


class Context(NamedTuple):
    """How one batch was sampled and what the trainer should trust about it (rollout inputs)."""

    temperature: float = 1.0  # the sampling temperature: log-probs are taken at it
    length_norm: float | None = None  # seq-mean-token-sum-norm's constant: the rollout's max_new_tokens (x turns, --env)
    recompute: bool = False  # pi_old from the trainer's own forward pass, not the engine's log-probs
    lags: Tensor | None = None  # (N,) each row's policy lag (`update --follow`), for the mismatch metrics
    # the same batch on the host (the CPU), where the trainer's batch is on its device: sizes (sequence
    # lengths) and loss weights are read from it without a device sync; None: the batch itself
    host: Any = None


@dataclass(kw_only=True)
class Plan(EnginePlan):
    """What `Algorithm.prepare` made of one batch (see `rlkit.training.engine.Plan`: rows, per-term weights,
    row lengths, metrics); algorithms subclass it for their own tensors."""

    cfg: RLConfig
    ctx: Context
    # the batch's sequences on the host, (token lists, prompt lengths): what `Trainer.layout` packs per micro-batch
    source: tuple[list[list[int]], list[int]] | None = None


class Algorithm(Objective):
    """One --algo. Subclasses set the class attributes and implement `prepare`, `step` (and `finish`);
    a registry line in `rlkit.algorithms` makes it selectable and holds its defaults (`AlgoDefaults`). An instance lives as long as the trainer
    that runs it (its extra models, e.g. PPO's critic, live on it)."""

    name: ClassVar[str]
    input: ClassVar[type]  # the input kind it reads: rlkit.algorithms.inputs.Rollouts or Prefs
    shown: ClassVar[tuple[str, ...]] = ()  # the metrics it adds, in the order `update` shows them

    def __init__(self, cfg: RLConfig) -> None:
        self.cfg = cfg

    @classmethod
    def check(cls, cfg: RLConfig) -> None:
        """Refuse settings this algorithm cannot train with (after `RLConfig.check`'s own)."""

    # -- models trained beside the policy (PPO's critic): loaded after the policy's optimizer state
    def load(self, trainer: Trainer, src: Path) -> None:
        """Extra models and their state from checkpoint `src` (fresh ones when it has none)."""

    def trained(self) -> list[Trained]:
        """Extra models the trainer steps with the policy (one backward, one loss scale)."""
        return []

    def gather(self, trainer: Trainer) -> Any:
        """Their full state for `save` (collectives under data parallelism: every rank calls it)."""
        return None

    def save(self, trainer: Trainer, d: Path, gathered: Any) -> None:
        """Write them into checkpoint directory `d`."""

    # -- one update
    def prepare(self, trainer: Trainer, batch: Any, cfg: RLConfig, ctx: Context) -> Plan:
        raise NotImplementedError

    def step(self, trainer: Trainer, plan: Plan, mb: Minibatch) -> StepOut:
        raise NotImplementedError

    def finish(self, trainer: Trainer, plan: Plan, sums: dict[str, float], maxes: dict[str, float]) -> dict[str, Any]:
        """Metrics after the epochs, from the steps' sums and maxes (already summed over ranks)."""
        return {}
