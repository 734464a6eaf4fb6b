"""A fleet's costs: what one `update --follow` step publishes and what each worker pays to pick it up, measured on
this machine, and the arithmetic that sizes a GPU fleet from them.

Usage: python benchmarks/fleet.py [--steps 3] [--prompts 16] [--keep DIR]   (needs `rlkit` on PATH: make setup)

For two policies (the embedded tiny model after a short SFT, and a wider Qwen2-architecture model of ~40M
parameters, random, with the tiny tokenizer) it runs, at --max-lag 0 and the same seeds:
  one worker  `rollout --follow | update --follow` (one pipe),
  two workers `rollout --follow --shard I/2 --spool SPOOL` + `update --follow --in SPOOL`,
and prints per run the wall time, the bytes and seconds of each step's publish (weights + trainer state, written,
fsynced and renamed), the workers' weight reload seconds, the spool's bytes per batch file, and whether the two
runs' final weights are equal. Then, from the measured bytes per parameter, the per-step publish and reload volume
of a 7B policy and the --max-lag that keeps a trainer busy (see the printed formula).
On a 2-core CPU the workers and the trainer share the cores: the fleet is not faster here, and is not meant to be.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def sh(cmd: str, **env: str) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + cmd], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    if r.returncode != 0:
        raise SystemExit(f"failed: {cmd}\n{r.stderr[-3000:]}")
    return r


def wide_model(d: Path) -> Path:
    """A Qwen2-architecture model of ~40M parameters (random) with the tiny tokenizer, SFT'd for a few steps so
    that it is an rlkit checkpoint."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlkit.tiny import build_tokenizer

    tok = build_tokenizer()
    base = d / "wide-base"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                                 num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=True,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                 bos_token_id=tok.bos_token_id)).save_pretrained(base)
    tok.save_pretrained(base)
    sh(f"rlkit sft --model {base} --num-examples 64 --eval-num 8 --batch-tokens 512 --out {d / 'wide'}")
    return d / "wide"


def params(policy: Path) -> int:
    import math

    from safetensors import safe_open

    with safe_open(str(policy / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def run_one(policy: Path, d: Path, workers: int, a) -> dict:
    ck, sp = d / f"ck-{workers}", d / f"sp-{workers}"
    roll = (f"rlkit rollout --follow {ck} --policy {policy} --n 4 --batch-prompts {a.prompts} --chunk-prompts "
            f"{a.prompts // 2} --max-lag 0 --max-steps {a.steps} --seed 100")
    upd = (f"rlkit update --follow --policy {policy} --out {ck} --max-steps {a.steps} --max-lag 0 --beta 0 "
           "--minibatch-size 32 --epochs 1 --seed 0")
    t0 = time.monotonic()
    if workers == 1:
        r = sh(f"{roll} | {upd}")
        err = r.stderr
        batch_bytes = None
    else:
        sp.mkdir()
        cmd = (f"for i in $(seq 0 {workers - 1}); do {roll} --shard $i/{workers} --spool {sp} 2>{d}/w$i.log & done\n"
               f"{upd} --in {sp} --keep-batches\nwait")
        r = sh(cmd)
        err = r.stderr + "".join((d / f"w{i}.log").read_text() for i in range(workers))
        files = list((sp / "done").iterdir())
        batch_bytes = statistics.median(f.stat().st_size for f in files)
    wall = time.monotonic() - t0
    pub = [(float(s), float(mb)) for s, mb in re.findall(r"wrote \S+ in ([\d.]+)s \(([\d.]+) MiB", err)]
    reloads = [float(x) for x in re.findall(r"weight reloads, median ([\d.]+)s", err)]
    return {"wall": wall, "publish_s": statistics.median(p[0] for p in pub), "publish_mib": pub[0][1],
            "reload_s": statistics.median(reloads) if reloads else None, "batch_bytes": batch_bytes, "ck": ck}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--keep", type=Path)
    a = ap.parse_args()
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        d = a.keep or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        sh(f"rlkit sft --num-examples 1500 --eval-num 20 --batch-tokens 512 --out {d / 'tiny'}")
        models = {"tiny": d / "tiny", "wide": wide_model(d)}
        per_param = []
        for name, policy in models.items():
            n = params(policy)
            (d / f"run-{name}").mkdir(exist_ok=True)
            res = {w: run_one(policy, d / f"run-{name}", w, a) for w in (1, 2)}
            one, two = load_file(str(res[1]["ck"] / f"step-{a.steps:06d}/model.safetensors")), load_file(
                str(res[2]["ck"] / f"step-{a.steps:06d}/model.safetensors"))
            same = max(float((one[k] - two[k]).abs().max()) for k in one)
            print(f"\n{name}: {n / 1e6:.1f}M parameters; {a.steps} steps of {a.prompts} prompts x 4 at --max-lag 0")
            for w, r in res.items():
                extra = f", spool batch file {r['batch_bytes'] / 1024:.0f} KiB (median)" if r["batch_bytes"] else ""
                print(f"  {w} worker(s): wall {r['wall']:.1f}s; publish {r['publish_mib']:.1f} MiB in "
                      f"{r['publish_s']:.3f}s a step (median); reload {r['reload_s'] or 0:.3f}s a step (median){extra}")
            print(f"  final weights, 2 workers vs 1: max |diff| {same:g}")
            per_param.append((name, res[1]["publish_mib"] * 2**20 / n, res[1]["publish_mib"] * 2**20 / n /
                              max(res[1]["publish_s"], 1e-9)))
        print("\nbytes a step publishes per parameter (fp32 weights 4 + AdamW moments 8 + the rest): "
              + ", ".join(f"{nm} {b:.1f}" for nm, b, _ in per_param))
        b = per_param[-1][1]
        P7 = 7.6e9
        print(f"a 7.6B policy trained in fp32 masters: {b * P7 / 1e9:.0f} GB a publish; each worker reads the weights, "
              f"{4 * P7 / 1e9:.0f} GB (fp32) a step, so N workers read N x that from the shared filesystem a step.")
        print("keeping the trainer busy: with T_train the trainer's seconds a step, T_pub the publish, T_load a worker's "
              "reload and T_gen one batch's generation on one worker, M workers keep up when "
              "T_gen / M + T_load + T_pub <= K x T_train, i.e. --max-lag K >= (T_gen / M + T_load + T_pub) / T_train "
              "(rows are then up to K steps off-policy; the importance weights correct for it).")


if __name__ == "__main__":
    main()
