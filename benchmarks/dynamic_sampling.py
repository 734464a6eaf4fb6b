"""DAPO's dynamic sampling in recipes/rlvr.sh: the RL phase without and with `rollout --min-informative-groups`,
from the same SFT checkpoint (the recipe's SFT is deterministic per machine; the script checks the two runs' weights
digests are equal), one after the other on one machine: held-out gain, RL phase wall, and per round the share of
the update's groups with a learning signal and the prompts sampled for them.

Usage: python benchmarks/dynamic_sampling.py [--seeds 0 1] [--k 512] [--max-refill 1] [--keep DIR]
(needs `rlkit` on PATH, e.g. make setup). K defaults to the recipe's PROMPTS (512): every group of a round
informative, sampling past 512 prompts as needed. Other knobs pass through the environment to the recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "rlvr.sh"


def run(runs: Path, seed: int, extra: dict[str, str]) -> dict:
    r = subprocess.run(["bash", str(RECIPE)], env={**os.environ, "RUNS": str(runs), "SEED": str(seed), **extra},
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{RECIPE} failed ({runs}):\n{r.stderr[-3000:]}")
    acc = lambda f: json.loads((runs / f).read_text())["accuracy"]  # noqa: E731
    rows = [json.loads(x) for x in (runs / "metrics.jsonl").read_text().splitlines()]
    updates = [m for m in rows if m.get("stage") == "update"]
    evals = [m["accuracy"] for m in rows if m.get("stage") == "eval" and str(m.get("label", "")).startswith("round-")]
    digest = json.loads((runs / "sft" / "rlkit.json").read_text())["weights_digest"]
    return {"before": acc("eval-sft.json"), "after": acc("eval-final.json"), "digest": digest, "evals": evals,
            "wall": float(re.search(r"RL phase wall time ([\d.]+)s", r.stdout).group(1)),
            "informative": [1 - u["degenerate_group_fraction"] for u in updates],
            "sampled": [u.get("prompts_sampled", u["sequences"] // int(os.environ.get("N", 8))) for u in updates]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--k", type=int, default=int(os.environ.get("PROMPTS", 512)))
    ap.add_argument("--max-refill", type=int, default=1)
    ap.add_argument("--keep", type=Path, help="keep the runs under DIR/seed-N/{plain,refill}")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = a.keep or Path(tmp)
        print(f"{'seed':>4} {'variant':8} {'SFT':>7} {'after':>7} {'gain':>7} {'RL wall s':>10}   per round: "
              "informative groups / prompts sampled / held-out accuracy")
        for seed in a.seeds:
            plain = run(root / f"seed-{seed}" / "plain", seed, {})
            refill = run(root / f"seed-{seed}" / "refill", seed,
                         {"MIN_INFORMATIVE": str(a.k), "MAX_REFILL": str(a.max_refill)})
            if plain["digest"] != refill["digest"]:
                raise SystemExit("the two runs' SFT checkpoints differ: not the same starting point")
            for name, r in (("plain", plain), ("refill", refill)):
                rounds = "  ".join(f"{i:.0%}/{s}/{e:.1%}" for i, s, e in zip(r["informative"], r["sampled"], r["evals"],
                                                                         strict=False))
                print(f"{seed:>4} {name:8} {r['before']:>7.1%} {r['after']:>7.1%} "
                      f"{100 * (r['after'] - r['before']):>+6.1f}p {r['wall']:>10.1f}   {rounds}")
            print(f"{'':4} {'':8} refill / plain wall: {refill['wall'] / plain['wall']:.2f}x")


if __name__ == "__main__":
    main()
