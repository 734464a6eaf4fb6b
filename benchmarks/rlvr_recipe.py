"""The RLVR recipe's target as a benchmark: held-out accuracy gain of the RL phase over the SFT
checkpoint, and the RL phase's wall time (all rounds, every process start included).

Usage: python benchmarks/rlvr_recipe.py [--seeds 0 1 2] [--keep DIR]   (needs `rlkit` on PATH, e.g. make setup)
Runs recipes/rlvr.sh with default knobs per seed in a temporary folder; prints each run and medians.
Environment knobs pass through to the recipe (e.g. KL=k3 to compare KL estimators in the loss).
Target on a 2-core CPU machine: +15 points within 60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "rlvr.sh"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--keep", type=Path, help="Keep each seed's runs under DIR/seed-N (default: a temporary folder).")
    a = ap.parse_args()
    gains, walls = [], []
    for seed in a.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            runs = a.keep / f"seed-{seed}" if a.keep else Path(tmp)
            r = subprocess.run(["bash", str(RECIPE)], env={**os.environ, "RUNS": str(runs), "SEED": str(seed)},
                               capture_output=True, text=True, check=True)
            before = json.loads((runs / "eval-sft.json").read_text())["accuracy"]
            after = json.loads((runs / "eval-final.json").read_text())["accuracy"]
            wall = float(re.search(r"RL phase wall time ([\d.]+)s", r.stdout).group(1))
            updates = [m for m in map(json.loads, (runs / "metrics.jsonl").read_text().splitlines())
                       if m.get("stage") == "update"]
        gains.append(100 * (after - before))
        walls.append(wall)
        def per_round(key: str, fmt: str) -> str:
            return " ".join(format(m.get(key) or 0.0, fmt) for m in updates)  # noqa: B023

        print(f"seed {seed}: SFT {before:.1%} -> RL {after:.1%} ({gains[-1]:+.1f} points), RL phase {wall:.1f}s; "
              f"per round: KL/seq {per_round('kl_per_seq', '.3f')}, ratio max {per_round('ratio_max', '.2f')}, "
              f"dual-clipped tokens {per_round('dual_clip_fraction', '.2e')}")
    print(f"median gain {statistics.median(gains):+.1f} points, median RL phase {statistics.median(walls):.1f}s "
          f"over {len(a.seeds)} seed(s); target +15 points within 60s")


if __name__ == "__main__":
    main()
