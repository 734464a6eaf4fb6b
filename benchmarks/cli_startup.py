"""`rlkit --help` wall time (budget 0.5 s on the 2-core CPU machine) and what it imports.

Usage: python benchmarks/cli_startup.py [--runs 15]
Prints the median and min over runs, and the same for bare `python -c pass` for scale.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def timed(cmd: list[str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    a = ap.parse_args()
    probe = ("import contextlib, io, sys; from rlkit.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()): main(['--help'])\n"
             "print(','.join(m for m in ('torch','transformers','datasets','pyarrow') if m in sys.modules))")
    heavy = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip().splitlines()
    help_t = timed([sys.executable, "-m", "rlkit", "--help"], a.runs)
    base_t = timed([sys.executable, "-c", "pass"], a.runs)
    print(f"rlkit --help: median {statistics.median(help_t):.3f}s  min {min(help_t):.3f}s  ({a.runs} runs)")
    print(f"python -c pass: median {statistics.median(base_t):.3f}s  min {min(base_t):.3f}s")
    print(f"heavy modules imported by --help: {heavy[0] if heavy and heavy[0] else 'none'}")
    print(f"budget 0.5s: {'OK' if statistics.median(help_t) < 0.5 else 'OVER'}")


if __name__ == "__main__":
    main()
