"""The RLHF recipe's bar as a benchmark: with beta 0.05 on the embedded default, held-out task
accuracy after PPO on the learned reward must not fall below the SFT checkpoint's.

Usage: python benchmarks/rlhf_recipe.py [--seeds 0 1 2] [--keep DIR]   (needs `rlkit` on PATH)
Runs recipes/rlhf.sh per seed (its knobs come from the environment, so `PREF_PROMPTS=3072 RM_EPOCHS=2
python benchmarks/rlhf_recipe.py` measures other settings) and prints, per seed:
- the reward model's held-out pair accuracy;
- judge vs writer: how often the reward model ranks the gold sum first among gold-3 .. gold+3, beside
  the SFT policy's greedy accuracy on the same held-out prompts. PPO can only move the policy towards
  what the reward model prefers, so a judge no better than the writer has nothing to teach;
- held-out accuracy before and after PPO, and the whole recipe's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "rlhf.sh"
OFFSETS = (-3, -2, -1, 0, 1, 2, 3)


def judge_vs_writer(runs: Path, num: int = 1000) -> tuple[float, float]:
    """(reward-model top-1 among gold+OFFSETS, SFT greedy accuracy) on the same held-out prompts."""
    from rlkit.io import checkpoints
    from rlkit.sampling.evaluate import greedy_eval
    from rlkit.scorers.reward_model import load_reward_model, score_texts
    from rlkit.tasks import get_task

    task = get_task(os.environ.get("TASK", "arithmetic"))
    exs = task.examples("heldout", num, seed=7)
    prompts, responses = [], []
    for e in exs:
        for d in OFFSETS:  # a negative candidate is replaced by one above the range, still a wrong answer
            n = int(e.answer) + d
            prompts.append(e.prompt)
            responses.append(str(n if n >= 0 else int(e.answer) + 4 - d))
    rm, tok = load_reward_model(runs / "rm")
    s = score_texts(rm, tok, prompts, responses)
    k, gold = len(OFFSETS), OFFSETS.index(0)
    top1 = sum(max(range(k), key=lambda j: s[i * k + j]) == gold for i in range(len(exs))) / len(exs)
    model, ptok = checkpoints.load_policy(runs / "sft")[:2]
    writer = greedy_eval(model, ptok, [e.prompt for e in exs], [e.answer for e in exs], task)["accuracy"]
    return top1, writer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--keep", type=Path, help="Keep each seed's runs under DIR/seed-N (default: a temporary folder).")
    a = ap.parse_args()
    gains = []
    for seed in a.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            runs = a.keep / f"seed-{seed}" if a.keep else Path(tmp)
            t0 = time.monotonic()
            subprocess.run(["bash", str(RECIPE)], env={**os.environ, "RUNS": str(runs), "SEED": str(seed)},
                           capture_output=True, text=True, check=True)
            wall = time.monotonic() - t0
            pair = json.loads((runs / "rm" / "rlkit.json").read_text())["metrics"]["heldout_pair_accuracy"]
            before = json.loads((runs / "rlhf-eval-sft.json").read_text())
            after = json.loads((runs / "rlhf-eval-final.json").read_text())
            top1, writer = judge_vs_writer(runs)
        gains.append(100 * (after["accuracy"] - before["accuracy"]))
        print(f"seed {seed}: reward model pair accuracy {pair:.1%}; judge top-1 {top1:.1%} vs writer {writer:.1%}; "
              f"held-out accuracy {before['accuracy']:.1%} -> {after['accuracy']:.1%} ({gains[-1]:+.1f} points, "
              f"n={after['n']}); RM score {before['rm_score_mean']:.2f} -> {after['rm_score_mean']:.2f}; "
              f"recipe {wall:.0f} s")
    print(f"median {statistics.median(gains):+.1f} points, worst {min(gains):+.1f} over {len(a.seeds)} seed(s); "
          "bar: not below the SFT checkpoint (>= 0)")


if __name__ == "__main__":
    main()
