"""A fleet's costs: what one `update --follow` step publishes and what each worker pays to pick it up, measured on
this machine for this tree and, side by side, for another (`--old-tree`, e.g. a checkout of main, whose steps were
full resumable checkpoints), and the arithmetic that sizes a GPU fleet from them.

Usage: python benchmarks/fleet.py [--steps 2] [--prompts 16] [--old-tree DIR] [--sizes wide,large] [--keep DIR]
(needs `rlkit` on PATH: make setup; the old tree runs with PYTHONPATH=DIR and the same interpreter)

For each policy (`wide`: a Qwen2-architecture model of 37.8M parameters, random, with the tiny tokenizer; `large`:
the same architecture at 1024 wide and 8 layers, 96.6M parameters) it runs two workers
`rollout --follow --shard I/2 --spool SPOOL` and one `update --follow --in SPOOL` at --max-lag 0 and the same seeds,
in each tree, and prints per run the wall time, the bytes and seconds of each step's publish (written, fsynced and
renamed), the snapshot's bytes and seconds (this tree: `--snapshot-every`, here every step), the workers' weight
reload seconds, and whether the two trees' final weights are equal. Then, from the measured bytes per parameter,
a 7.6B policy on 8 workers: the bytes a step publishes and the workers read, and the --max-lag that hides that
traffic behind the training at a given filesystem bandwidth.
On a 2-core CPU the workers and the trainer share the cores: the fleet is not faster here, and is not meant to be.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {"wide": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
                      num_key_value_heads=4),
         "large": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=4)}


def sh(cmd: str, tree: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    e = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    if tree is not None:
        e["PYTHONPATH"] = str(tree)
    # run outside either checkout: `python -m` puts the working directory first on sys.path
    r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + cmd], capture_output=True, text=True, env=e,
                       cwd=tempfile.gettempdir())
    if r.returncode != 0:
        raise SystemExit(f"failed: {cmd}\n{r.stderr[-3000:]}")
    return r


def model(d: Path, name: str) -> Path:
    """A Qwen2-architecture model of size `name` (random) with the tiny tokenizer, SFT'd for a few steps so that it
    is an rlkit checkpoint."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlkit.tiny import build_tokenizer

    if (d / name / "rlkit.json").is_file():  # kept from an earlier run (--keep)
        return d / name
    tok = build_tokenizer()
    base = d / f"{name}-base"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                 **SIZES[name])).save_pretrained(base)
    tok.save_pretrained(base)
    sh(f"rlkit sft --model {base} --num-examples 32 --eval-num 8 --batch-tokens 512 --out {d / name}")
    return d / name


def params(policy: Path) -> int:
    import math

    from safetensors import safe_open

    with safe_open(str(policy / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def run_fleet(policy: Path, d: Path, tree: Path | None, a, new: bool) -> dict:
    """Two workers and one update on a spool; the figures its lines print."""
    ck, sp = d / "ck", d / "sp"
    sp.mkdir(parents=True)
    py = f"{sys.executable} -m rlkit"
    roll = (f"{py} rollout --follow {ck} --policy {policy} --n 4 --batch-prompts {a.prompts} --chunk-prompts "
            f"{a.prompts // 2} --max-lag 0 --max-steps {a.steps} --seed 100")
    upd = (f"{py} update --follow --policy {policy} --out {ck} --max-steps {a.steps} --max-lag 0 --beta 0 "
           f"--minibatch-size 32 --epochs 1 --seed 0 --in {sp}" + (" --snapshot-every 1" if new else ""))
    t0 = time.monotonic()
    cmd = f"for i in 0 1; do {roll} --shard $i/2 --spool {sp} 2>{d}/w$i.log & done\n{upd}\nwait"
    err = sh(cmd, tree).stderr
    wall = time.monotonic() - t0
    err += "".join((d / f"w{i}.log").read_text() for i in (0, 1))
    pub = [(float(s), float(mb)) for s, mb in re.findall(r"wrote \S+ in ([\d.]+)s \(([\d.]+) MiB", err)]
    snap = [(float(s), float(mb)) for s, mb in re.findall(r"snapshot in ([\d.]+)s, ([\d.]+) MiB", err)]
    reloads = [float(x) for x in re.findall(r"weight reloads, median ([\d.]+)s", err)]
    step = ck / f"step-{a.steps:06d}"  # what a worker reads of a step: all of it but the trainer state
    read = sum(f.stat().st_size for f in step.rglob("*") if f.is_file() and "trainer" not in f.relative_to(step).parts)
    return {"read_mib": read / 2**20, "wall": wall, "publish_s": statistics.median(p[0] for p in pub), "publish_mib": pub[0][1],
            "snapshot_s": statistics.median(s[0] for s in snap) if snap else None,
            "snapshot_mib": snap[0][1] if snap else None,
            "reload_s": statistics.median(reloads) if reloads else None, "ck": ck}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--old-tree", type=Path, help="a checkout of the tree to compare with (e.g. main)")
    ap.add_argument("--sizes", default="wide,large")
    ap.add_argument("--train-seconds", type=float, default=60.0, help="7.6B: a training step's seconds, for the lag")
    ap.add_argument("--keep", type=Path)
    a = ap.parse_args()
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        d = a.keep or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        per_param = {}
        for name in a.sizes.split(","):
            policy = model(d, name)
            n = params(policy)
            res = {"new": run_fleet(policy, d / f"{name}-new", None, a, True)}
            if a.old_tree:
                res["old"] = run_fleet(policy, d / f"{name}-old", a.old_tree, a, False)
            print(f"\n{name}: {n / 1e6:.1f}M parameters; 2 workers, {a.steps} steps of {a.prompts} prompts x 4 at "
                  "--max-lag 0")
            for tree, r in sorted(res.items(), reverse=True):
                snap = (f"; snapshot {r['snapshot_mib']:.1f} MiB in {r['snapshot_s']:.3f}s" if r["snapshot_s"] is not None
                        else "")
                print(f"  {tree}: wall {r['wall']:.1f}s; publish {r['publish_mib']:.1f} MiB in {r['publish_s']:.3f}s a "
                      f"step (median){snap}; worker reload {r['reload_s'] or 0:.3f}s (median)")
            if "old" in res:
                one, two = (load_file(str(res[t]["ck"] / f"step-{a.steps:06d}/model.safetensors")) for t in ("new", "old"))
                same = max(float((one[k] - two[k]).abs().max()) for k in one)
                print(f"  published bytes new/old: {res['new']['publish_mib'] / res['old']['publish_mib']:.3f}; final "
                      f"weights new vs old: max |diff| {same:g}")
            per_param[name] = {t: (r["publish_mib"] * 2**20 / n, r["read_mib"] * 2**20 / n) for t, r in res.items()}
            per_param[name]["snapshot"] = ((res["new"]["snapshot_mib"] or 0) * 2**20 / n, 0)
        name = list(per_param)[-1]
        b = per_param[name]
        print("\nbytes per parameter (" + name + "): a step publishes / a worker reads "
              + ", ".join(f"{t} {v[0]:.2f} / {v[1]:.2f}" for t, v in b.items() if t != "snapshot")
              + f"; a snapshot {b['snapshot'][0]:.2f}")
        P7, N = 7.6e9, 8
        # bf16 on a GPU: the fp32 figures measured here, halved (the weights are the step but for a few KiB)
        rows = [("new, GPU (bf16)", b["new"][0] / 2, b["new"][1] / 2), ("new, CPU (fp32)", *b["new"])]
        rows += [("old", *b["old"])] if "old" in b else []
        print(f"a 7.6B policy, {N} workers: per step")
        for label, pub, read in rows:
            print(f"  {label}: publishes {pub * P7 / 1e9:.1f} GB, each worker reads {read * P7 / 1e9:.1f} GB: "
                  f"{(pub + N * read) * P7 / 1e9:.0f} GB through the filesystem")
        print(f"  snapshot: {b['snapshot'][0] * P7 / 1e9:.0f} GB every --snapshot-every K steps (K = 10: "
              f"{b['snapshot'][0] * P7 / 10 / 1e9:.1f} GB a step on average), each rank writing its shards")
        print(f"--max-lag K hides the weight traffic behind training when T_pub + T_load <= K x T_train; with "
              f"T_train {a.train_seconds:g}s a step and a filesystem bandwidth B that the publish and the {N} workers' "
              "reads share (T_pub + T_load = (published + N x read) / B):")
        for bw in (1e9, 5e9, 20e9):
            ks = []
            for label, pub, read in rows:
                io = (pub + N * read) * P7 / bw
                ks.append(f"{label} {io:.0f}s -> --max-lag {max(1, -(-io // a.train_seconds)):.0f}")
            print(f"  B = {bw / 1e9:g} GB/s: " + "; ".join(ks))


if __name__ == "__main__":
    main()
