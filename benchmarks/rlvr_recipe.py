"""The RLVR recipe's target as a benchmark: held-out accuracy gain of the RL phase over the SFT
checkpoint, and the RL phase's wall time (all rounds, every process start included).

Usage: python benchmarks/rlvr_recipe.py [--seeds 0 1 2]   (needs `rlkit` on PATH, e.g. make setup)
Runs recipes/rlvr.sh with default knobs per seed in a temporary folder; prints each run and medians.
Target on a 2-core CPU machine: +15 points within 60 s.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "rlvr.sh"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    a = ap.parse_args()
    gains, walls = [], []
    for seed in a.seeds:
        with tempfile.TemporaryDirectory() as runs:
            r = subprocess.run(["bash", str(RECIPE)], env={**__import__("os").environ, "RUNS": runs, "SEED": str(seed)},
                               capture_output=True, text=True, check=True)
            before = json.loads((Path(runs) / "eval-sft.json").read_text())["accuracy"]
            after = json.loads((Path(runs) / "eval-final.json").read_text())["accuracy"]
            wall = float(re.search(r"RL phase wall time ([\d.]+)s", r.stdout).group(1))
        gains.append(100 * (after - before))
        walls.append(wall)
        print(f"seed {seed}: SFT {before:.1%} -> RL {after:.1%} ({gains[-1]:+.1f} points), RL phase {wall:.1f}s")
    print(f"median gain {statistics.median(gains):+.1f} points, median RL phase {statistics.median(walls):.1f}s "
          f"over {len(a.seeds)} seed(s); target +15 points within 60s")


if __name__ == "__main__":
    main()
