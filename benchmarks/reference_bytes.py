"""Bytes of the frozen reference in fp32, bf16 and fp16 (bf16/fp16 should be half of fp32).

Usage: python benchmarks/reference_bytes.py [--policy DIR]
Without --policy it trains a throwaway tiny policy for a few seconds first (real `rlkit sft`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from rlkit.io.checkpoints import safetensors_summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        policy = a.policy
        if policy is None:
            policy = Path(tmp) / "sft"
            subprocess.run([sys.executable, "-m", "rlkit", "sft", "--out", str(policy), "--num-examples", "500",
                            "--eval-num", "10"], check=True, capture_output=True)
        rows = {}
        for dtype in ("fp32", "bf16", "fp16"):
            out = Path(tmp) / f"ref-{dtype}"
            subprocess.run([sys.executable, "-m", "rlkit", "freeze-ref", "--policy", str(policy), "--out", str(out),
                            "--dtype", dtype], check=True, capture_output=True)
            s = safetensors_summary(out)
            rows[dtype] = (s["parameters"], s["bytes"], sum(f.stat().st_size for f in out.glob("*.safetensors")))
        base = rows["fp32"][1]
        print(f"{'dtype':6} {'parameters':>12} {'tensor bytes':>14} {'file bytes':>12} {'vs fp32':>8}")
        for dtype, (n, b, f) in rows.items():
            print(f"{dtype:6} {n:>12,} {b:>14,} {f:>12,} {b / base:>8.3f}")


if __name__ == "__main__":
    main()
