"""Where and how a training stage runs, resolved once per stage: `Runtime` (the device, the concrete
TrainOptions: --dtype auto and the GPU's default micro-batches made concrete, and the data-parallel world).
`sft`, `train-rm` and `update` make one with `Runtime.resolve` from their --device and training flags,
join torchrun's process group with `joined()` once their inputs are known good, and pass it down to the
engine; nothing below re-reads --device or --dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rlkit.training import TrainOptions


@dataclass(frozen=True)
class Runtime:
    device: Any  # torch.device: the rank's device under torchrun
    train: TrainOptions  # concrete: no --dtype auto
    flag: str = "auto"  # --device as given (the process group's backend follows it)
    dp: Any = None  # rlkit.training.distributed.DataParallel once joined, None in one process

    @classmethod
    def resolve(cls, device: str, train: TrainOptions, *, step_rows: int | None = None,
                step_flag: str = "--minibatch-size") -> Runtime:
        """Check the training flags (one line naming the flag), resolve --device (one line when this machine cannot
        give it) and make --dtype auto concrete for it."""
        from rlkit import devices
        from rlkit.training import distributed

        devices.parse(device)
        train.check(distributed=distributed.launched(), step_rows=step_rows, step_flag=step_flag)
        dev = devices.resolve(device)
        return cls(dev, train.on(dev), device)

    def joined(self) -> Runtime:
        """This runtime in torchrun's process group (FSDP2's world), when launched by torchrun; else itself."""
        from rlkit.training import distributed

        if self.dp is not None or not distributed.launched():
            return self
        dp = distributed.init(self.flag, timeout_min=self.train.dist_timeout)
        return replace(self, dp=dp, device=dp.device)
