"""SFT with default settings on the embedded tiny model: held-out accuracy and wall time.

Usage: python benchmarks/sft_default.py [--seeds 0 1 2]
Runs the real `rlkit sft` (process start, training, held-out eval and save all included) per seed
and prints each run and the medians. Target: 30-60% greedy held-out accuracy in about a minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    a = ap.parse_args()
    accs, walls, trains = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            out = Path(tmp) / f"sft-{seed}"
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "rlkit", "sft", "--out", str(out), "--seed", str(seed)],
                           check=True, capture_output=True)
            wall = time.perf_counter() - t
            m = json.loads((out / "rlkit.json").read_text())["metrics"]
            accs.append(m["heldout_accuracy"])
            walls.append(wall)
            trains.append(m["train_seconds"])
            print(f"seed {seed}: held-out accuracy {m['heldout_accuracy']:.1%} (n={m['heldout_n']}), "
                  f"wall {wall:.1f}s (training {m['train_seconds']:.1f}s, {m['tokens_per_s']:.0f} tok/s)")
    print(f"median: accuracy {statistics.median(accs):.1%}, wall {statistics.median(walls):.1f}s, "
          f"training {statistics.median(trains):.1f}s over {len(a.seeds)} seed(s)")


if __name__ == "__main__":
    main()
