"""Where stage metrics go besides the screen and the manifest: a JSON-lines file and TensorBoard.

One metrics file collects every stage's rows in order (`update` rows: reward components, KL,
entropy, clip fraction, length, drift; `eval` rows: held-out accuracy), keyed by the policy `step`,
so a recipe's whole run is one file that `rlkit report` plots. TensorBoard is optional (the
`tensorboard` extra): rows become scalars `<stage>/<key>` at the row's step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError


def check_tensorboard(logdir: Path | None) -> None:
    """Fail before any work when --tensorboard is asked for and cannot be written."""
    if logdir is None:
        return
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise RlkitError(f"--tensorboard {logdir}: the tensorboard package is not installed; "
                         "pip install 'rlkit[tensorboard]' (or leave out --tensorboard)") from None
    if logdir.exists() and not logdir.is_dir():
        raise RlkitError(f"--tensorboard {logdir}: exists and is not a directory; expected a log directory")


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (booleans and strings left out)."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step"}


def write(row: dict[str, Any], jsonl: Path | None = None, tensorboard: Path | None = None) -> None:
    """Append `row` (with 'stage' and 'step') to the JSON-lines file and/or the TensorBoard log."""
    if jsonl is not None:
        with open(jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
    if tensorboard is not None:
        from torch.utils.tensorboard import SummaryWriter

        w = SummaryWriter(log_dir=str(tensorboard))
        try:
            for k, v in scalars(row).items():
                w.add_scalar(f"{row['stage']}/{k}", v, global_step=int(row.get("step", 0)))
        finally:
            w.close()
