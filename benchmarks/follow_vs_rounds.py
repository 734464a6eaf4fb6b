"""Persistent stages vs one process per stage per round: recipes/rlvr.sh and recipes/rlvr-follow.sh
(LAG=0 and LAG=1) back to back, same seeds, same knobs, sharing each seed's SFT checkpoint and
reference (the follow runs find them up to date).

Usage: python benchmarks/follow_vs_rounds.py [--seeds 0 1 2] [--keep DIR] [--vllm]
(needs `rlkit` on PATH, e.g. make setup). Environment knobs pass through to both recipes.
Prints each run, then per variant the median held-out gain and RL phase wall time, the wall as a
fraction of rlvr.sh's (median of the per-seed ratios), and the targets:
  LAG=0: RL phase <= 60% of rlvr.sh's, accuracy within 2 points of it;
  LAG=1: RL phase <= 45% of rlvr.sh's, gain >= +15 points.
--vllm adds one LAG=1 run with ENGINE=vllm (seed of the first --seeds) and reports the vLLM engine's
start-up seconds (once per run) and its weight reload seconds (per step).
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

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def run(recipe: str, runs: Path, seed: int, **knobs: str) -> dict:
    r = subprocess.run(["bash", str(RECIPES / recipe)], capture_output=True, text=True,
                       env={**os.environ, "RUNS": str(runs), "SEED": str(seed), **knobs})
    if r.returncode != 0:
        raise SystemExit(f"{recipe} (seed {seed}, {knobs}) failed:\n{r.stderr[-3000:]}")
    before = json.loads((runs / "eval-sft.json").read_text())["accuracy"]
    after = json.loads((runs / "eval-final.json").read_text())["accuracy"]
    out = {"before": before, "after": after, "gain": 100 * (after - before),
           "wall": float(re.search(r"RL phase wall time ([\d.]+)s", r.stdout).group(1))}
    m = re.search(r"(\d+) weight reloads, median ([\d.]+)s, max ([\d.]+)s; one engine start \(([\d.]+)s\)", r.stderr)
    if m:
        out.update(reloads=int(m.group(1)), reload_median=float(m.group(2)), reload_max=float(m.group(3)),
                   engine_start=float(m.group(4)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--keep", type=Path, help="Keep each seed's runs under DIR/seed-N (default: a temporary folder).")
    ap.add_argument("--vllm", action="store_true", help="Also one LAG=1 run with ENGINE=vllm (engine start, reloads).")
    a = ap.parse_args()
    variants = {"rlvr.sh": ("rlvr.sh", {}), "follow LAG=0": ("rlvr-follow.sh", {"LAG": "0"}),
                "follow LAG=1": ("rlvr-follow.sh", {"LAG": "1"})}
    res: dict[str, list[dict]] = {v: [] for v in variants}
    for seed in a.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            runs = a.keep / f"seed-{seed}" if a.keep else Path(tmp)
            for name, (recipe, knobs) in variants.items():
                r = run(recipe, runs, seed, **knobs)
                res[name].append(r)
                base = res["rlvr.sh"][-1]
                print(f"seed {seed} {name:13}: SFT {r['before']:.1%} -> {r['after']:.1%} ({r['gain']:+.1f} points), "
                      f"RL phase {r['wall']:.1f}s = {r['wall'] / base['wall']:.0%} of rlvr.sh's", flush=True)
            if a.vllm and seed == a.seeds[0]:
                r = run("rlvr-follow.sh", runs, seed, LAG="1", ENGINE="vllm")
                print(f"seed {seed} follow LAG=1 ENGINE=vllm: SFT {r['before']:.1%} -> {r['after']:.1%} "
                      f"({r['gain']:+.1f} points), RL phase {r['wall']:.1f}s; one vLLM engine start "
                      f"{r.get('engine_start', float('nan')):.1f}s, {r.get('reloads', 0)} weight reloads, median "
                      f"{r.get('reload_median', float('nan')):.3f}s (max {r.get('reload_max', float('nan')):.3f}s)",
                      flush=True)
    print(f"\n{'variant':14}{'median gain':>13}{'median RL wall':>16}{'wall / rlvr.sh':>16}   target")
    targets = {"follow LAG=0": "<= 60% of rlvr.sh's wall, accuracy within 2 points",
               "follow LAG=1": "<= 45% of rlvr.sh's wall, gain >= +15 points"}
    for name, rs in res.items():
        ratio = statistics.median(r["wall"] / b["wall"] for r, b in zip(rs, res["rlvr.sh"], strict=True))
        print(f"{name:14}{statistics.median(r['gain'] for r in rs):>+12.1f} "
              f"{statistics.median(r['wall'] for r in rs):>14.1f}s{ratio:>15.0%}   {targets.get(name, '')}")
    diffs = [100 * (r["after"] - b["after"]) for r, b in zip(res["follow LAG=0"], res["rlvr.sh"], strict=True)]
    print(f"LAG=0 accuracy minus rlvr.sh's, per seed: {', '.join(f'{d:+.1f}' for d in diffs)} points "
          f"({len(a.seeds)} seed(s); a 2-core CPU machine, seconds are noisy)")


if __name__ == "__main__":
    main()
