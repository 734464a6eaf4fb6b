"""Programs per second through the code sandbox, and what the sandbox costs per program.

Trivial programs (`print(int(input()) * 2)` against one stdio test, compared on the host) through
`rlkit.sandbox.programs.run_programs` with 1 worker and with one per CPU, under bwrap and under kind "none"
(the same harness in a bare subprocess, the same limits, no namespaces): the difference per program is the
sandbox's own overhead (bwrap's namespaces, mounts and the uid drop).

    python benchmarks/sandbox_throughput.py                 # 256 programs
    python benchmarks/sandbox_throughput.py --programs 4096
"""

from __future__ import annotations

import argparse
import os
import time

from rlkit.sandbox import Sandbox
from rlkit.sandbox.programs import TestCase, TestSuite, run_programs


def measure(kind: str, workers: int, n: int) -> float:
    jobs = [("print(int(input()) * 2)", TestSuite((TestCase("stdio", f"{i}\n", str(2 * i)),))) for i in range(n)]
    sb = Sandbox(kind, workers=workers)
    sb.check()
    t = time.perf_counter()
    out = run_programs(sb, jobs)
    took = time.perf_counter() - t
    bad = [o for o in out if o.reason != "passed"]
    if bad:
        raise SystemExit(f"{len(bad)} of {n} trivial programs failed under {kind}: {bad[0]}")
    return n / took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=256)
    args = ap.parse_args()
    cpus = os.cpu_count() or 1
    n = args.programs
    rows = []
    for workers in sorted({1, cpus}):
        bw = measure("bwrap", workers, n)
        bare = measure("none", workers, n)
        rows.append((workers, bw, bare))
    print(f"{n} trivial programs, one stdio test each, {cpus} CPUs")
    print(f"{'workers':>7} | {'bwrap prog/s':>12} | {'bare prog/s':>11} | {'bwrap ms/prog':>13} | "
          f"{'bare ms/prog':>12} | {'overhead ms':>11} | {'ratio':>5}")
    for workers, bw, bare in rows:
        print(f"{workers:>7} | {bw:>12.1f} | {bare:>11.1f} | {1000 / bw:>13.2f} | {1000 / bare:>12.2f} | "
              f"{1000 / bw - 1000 / bare:>11.2f} | {bare / bw:>5.2f}")
    if len(rows) == 2:
        print(f"scaling 1 -> {cpus} workers: bwrap x{rows[1][1] / rows[0][1]:.2f}, bare x{rows[1][2] / rows[0][2]:.2f}")


if __name__ == "__main__":
    main()
