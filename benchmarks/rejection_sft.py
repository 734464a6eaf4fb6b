"""Rejection-sampling SFT (DeepSeek-R1's stage 3) on the arithmetic task: held-out greedy accuracy of an SFT
checkpoint before and after one round of sample -> keep the correct -> fine-tune on them, with and without
--best-of, all through the real commands:

    rlkit rollout --policy SFT --task arithmetic --num-prompts 512 --n 8 --max-new-tokens 16 --seed S --out r.arrow
    rlkit sft --model SFT --data r.arrow --min-reward 1 [--best-of] --lr LR --out rs
    rlkit eval --policy SFT|rs --task arithmetic --num-prompts 300 --max-new-tokens 16 --json

Usage: python benchmarks/rejection_sft.py [--policy runs/rlvr0/sft] [--seed 0] [--lr 2e-5] [--epochs 1]
Waits for DIR/rlkit.json (a run still writing the checkpoint). Prints the table's pass rate, the rows each sft kept
and the held-out accuracy before and after (n=300, the task's held-out split, which rollout never samples).
The lr is for continuing from a trained checkpoint: sft's default 1e-3 is for training from scratch, and a fresh
AdamW's first steps move every weight by about the lr whatever its gradient's size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rlkit(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "rlkit", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"rlkit {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout


def accuracy(policy: Path, prompts: int) -> float:
    out = rlkit("eval", "--policy", str(policy), "--task", "arithmetic", "--num-prompts", str(prompts),
                "--max-new-tokens", "16", "--json")
    return json.loads(out)["accuracy"]


def sampled_accuracy(policy: Path, heldout: Path, n: int, tmp: Path) -> float:
    """Held-out accuracy sampled at temperature 1, n samples a prompt: the mean verifier reward of a rollout of the
    held-out prompts (n x more answers than the greedy figure, so a smaller standard error)."""
    import pyarrow as pa

    out = tmp / "sampled.arrow"
    rlkit("rollout", "--policy", str(policy), "--task", "arithmetic", "--prompts", str(heldout), "--n", str(n),
          "--max-new-tokens", "16", "--seed", "0", "--out", str(out), "--force")
    with pa.OSFile(str(out)) as f:
        v = pa.ipc.open_stream(f).read_all().column("reward/verifier").to_pylist()
    return sum(v) / len(v)


def main() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", type=Path, default=Path("/work/runs/rlvr0/sft"), help="the SFT checkpoint")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", default="2e-5")
    ap.add_argument("--epochs", default="1")
    ap.add_argument("--num-prompts", default="512")
    ap.add_argument("--n", default="8")
    ap.add_argument("--eval-prompts", type=int, default=300)
    ap.add_argument("--wait", type=float, default=1800, help="seconds to wait for POLICY/rlkit.json")
    a = ap.parse_args()
    deadline = time.monotonic() + a.wait
    while not (a.policy / "rlkit.json").is_file():
        if time.monotonic() > deadline:
            raise SystemExit(f"{a.policy}/rlkit.json did not appear within {a.wait:.0f} s")
        time.sleep(5)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        table = Path(tmp) / "r.arrow"
        rlkit("rollout", "--policy", str(a.policy), "--task", "arithmetic", "--num-prompts", a.num_prompts, "--n", a.n,
              "--max-new-tokens", "16", "--seed", str(a.seed), "--out", str(table))
        rows = []
        heldout = Path(tmp) / "heldout.arrow"
        rlkit("prompts", "--task", "arithmetic", "--split", "heldout", "--num-prompts", str(a.eval_prompts),
              "--out", str(heldout))
        before = accuracy(a.policy, a.eval_prompts), sampled_accuracy(a.policy, heldout, 8, Path(tmp))
        for label, extra in (("min-reward 1", ()), ("min-reward 1 --best-of", ("--best-of",))):
            out = Path(tmp) / label.replace(" ", "_")
            rlkit("sft", "--model", str(a.policy), "--data", str(table), "--min-reward", "1", *extra, "--lr", a.lr,
                  "--epochs", a.epochs, "--seed", str(a.seed), "--eval-num", "10", "--out", str(out), "-q")
            m = json.loads((out / "rlkit.json").read_text())["metrics"]
            rows.append((label, m, (accuracy(out, a.eval_prompts), sampled_accuracy(out, heldout, 8, Path(tmp)))))
        secs = time.perf_counter() - t0
    m0 = rows[0][1]
    print(f"policy {a.policy}, seed {a.seed}: rollout {a.num_prompts} prompts x {a.n} (max 16 new tokens), "
          f"pass rate {m0['reward_mean_read']:.1%} ({m0['rows_kept']} of {m0['rows_read']} correct, "
          f"{m0['groups_kept']} of {m0['groups_read']} prompts with one)")
    print(f"sft --lr {a.lr} --epochs {a.epochs}; held-out accuracy, arithmetic, {a.eval_prompts} prompts: greedy, "
          "and sampled (T=1, 8 a prompt)")
    print(f"  {'before':<26} {before[0]:6.1%}  {before[1]:6.1%}")
    for label, m, acc in rows:
        print(f"  {'after --' + label:<26} {acc[0]:6.1%}  {acc[1]:6.1%}  ({acc[0] - before[0]:+.1%} / "
              f"{acc[1] - before[1]:+.1%}; {m['rows_kept']} rows kept, {m['steps']} steps, final loss "
              f"{m['train_loss']:.3f})")
    print(f"{secs:.0f} s in all, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
