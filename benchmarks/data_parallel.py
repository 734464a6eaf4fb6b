"""`rlkit update` on one process vs `torchrun --nproc-per-node 2` (FSDP2, gloo on CPU) on the same batch.

Prints the wall time of each (median of --repeats, whole process: start-up, load, train, save), and how
far the two resulting checkpoints are apart compared with how far the update moved the weights.
On a 2-core CPU the two processes share the cores, so expect no speed-up: this measures parity and the
cost of the collectives, not scaling (that needs one GPU per process).

    python benchmarks/data_parallel.py [--policy SFT_DIR] [--prompts 256] [--n 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rlkit(*args: str, torchrun: bool = False) -> float:
    pre = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun else \
        [sys.executable]
    t0 = time.perf_counter()
    r = subprocess.run([*pre, "-m", "rlkit", *args], capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
                       if torchrun else None)
    if r.returncode:
        sys.exit(r.stderr.decode()[-3000:])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", type=Path)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        policy = a.policy
        if policy is None:
            policy = d / "sft"
            rlkit("sft", "--num-examples", "8000", "--out", str(policy))
        roll = d / "r.arrow"
        rlkit("rollout", "--policy", str(policy), "--num-prompts", str(a.prompts), "--n", str(a.n), "--out", str(roll))
        flags = ["--policy", str(policy), "--in", str(roll), "--beta", "0", "--epochs", "2", "--minibatch-size", "128"]
        times = {1: [], 2: []}
        for i in range(a.repeats):
            times[1].append(rlkit("update", *flags, "--out", str(d / f"one-{i}")))
            times[2].append(rlkit("update", *flags, "--out", str(d / f"two-{i}"), torchrun=True))
        w0, w1, w2 = (load_file(str(p / "model.safetensors")) for p in (policy, d / "one-0", d / "two-0"))
        moved = max(float((w1[k] - w0[k]).abs().max()) for k in w1)
        gap = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
        rows = a.prompts * a.n
        print(f"update on {rows} rollouts ({a.prompts} prompts x {a.n}), 2 epochs, minibatch 128, {a.repeats} repeats")
        for w in (1, 2):
            print(f"  {w} process{'es' if w > 1 else ''}: median wall {statistics.median(times[w]):.1f} s "
                  f"(runs: {', '.join(f'{t:.1f}' for t in times[w])})")
        print(f"  2-process / 1-process wall time: {statistics.median(times[2]) / statistics.median(times[1]):.2f}x")
        print(f"  weights: max |1-proc - 2-proc| = {gap:.2e}; the update moved them by up to {moved:.2e} "
              f"({gap / moved:.2%} of it)")


if __name__ == "__main__":
    main()
