"""The JSON-lines metrics file (`--metrics FILE`): where stage metrics go besides the screen and the manifest.

One metrics file collects every stage's rows in order (`update` rows: reward components, KL, entropy,
clip fraction, length, drift; `eval` rows: held-out accuracy; `sft`/`train-rm` rows at step 0), keyed by
the policy `step`, so a recipe's whole run is one file that `rlkit report` plots. The same rows go to the
experiment trackers (`rlkit.io.tracking`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write(row: dict[str, Any], jsonl: Path | None = None) -> None:
    """Append `row` (with 'stage' and 'step') to the JSON-lines file."""
    if jsonl is not None:
        with open(jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
