"""Rollout engines side by side at the tiny size: start-up (import, engine init) and generation time of
every registered engine (`rlkit.engines`: hf, vllm), and how far the logged log-probs of each engine
whose log-probs are not the trainer's (`logprobs_match_trainer`) are from the trainer's forward pass.

Usage: python benchmarks/engines.py [--policy DIR] [--prompts 128] [--n 8] [--repeats 3]
Needs vLLM importable for the vLLM half (on a CPU: `make setup-vllm`); without a --policy it trains
the tiny default for a few seconds first. Each engine runs in its own fresh process; generation is
timed --repeats times and the median printed (vLLM's first call includes its warm-up).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIBRARY = {"hf": "transformers"}  # the library an engine imports, where it is not named as the engine is


def _child(engine: str, policy: Path, prompts: int, n: int, repeats: int, dump: Path) -> None:
    t0 = time.perf_counter()
    from rlkit import engines
    from rlkit.io import data
    from rlkit.tasks import get_task

    importlib.import_module(LIBRARY.get(engine, engine))  # the engine's library, timed apart from its start
    t1 = time.perf_counter()
    eng = engines.create(engine, policy)
    tok = eng.tokenizer
    t2 = time.perf_counter()
    ex = get_task("arithmetic").examples("train", prompts, 0)
    ids = data.encode_prompts(tok, [e.prompt for e in ex], False)
    gen_s = []
    for r in range(repeats):
        s = time.perf_counter()
        out = eng.sample(ids, n=n, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=r)
        gen_s.append(time.perf_counter() - s)
    tokens = sum(len(c) for c in out.completion_ids)
    dump.write_text(json.dumps({"engine": engine, "import_s": t1 - t0, "init_s": t2 - t1, "gen_s": gen_s,
                                "samples": len(out.completion_ids), "tokens": tokens, "prompt_ids": ids,
                                "completion_ids": out.completion_ids, "logprobs": out.logprobs}))
    eng.close()


def _mismatch(policy: Path, d: dict) -> tuple[float, float]:
    import torch

    from rlkit.algorithms.inputs import RLBatch, recompute_logprobs
    from rlkit.io import checkpoints
    from rlkit.ops.logprobs import pack_sequences

    model, tok = checkpoints.load_policy(policy)
    n = d["samples"] // len(d["prompt_ids"])
    prompts = [p for p in d["prompt_ids"] for _ in range(n)]
    ids, attn, targets, mask, start = pack_sequences(prompts, d["completion_ids"], tok.pad_token_id)
    old = torch.zeros(mask.shape)
    for i, lp in enumerate(d["logprobs"]):
        old[i, : len(lp)] = torch.tensor(lp)
    b = RLBatch(ids, attn, targets, mask, start, old, None, torch.zeros(len(prompts)), torch.zeros(len(prompts)))
    gap = (recompute_logprobs(model, b, 1.0, 256) - old).abs()[mask]
    return float(gap.max()), float(gap.mean())


def main() -> None:
    from rlkit import engines  # light: the registry imports neither torch nor an engine's library

    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", type=Path)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", choices=list(engines.ENGINES))
    ap.add_argument("--dump", type=Path)
    a = ap.parse_args()
    if a.child:
        _child(a.child, a.policy, a.prompts, a.n, a.repeats, a.dump)
        return
    with tempfile.TemporaryDirectory() as tmp:
        policy = a.policy
        if policy is None:
            policy = Path(tmp) / "sft"
            subprocess.run([sys.executable, "-m", "rlkit", "sft", "--num-examples", "6000", "--eval-num", "50",
                            "--out", str(policy)], check=True, capture_output=True)
        rows = {}
        for engine in engines.ENGINES:  # every registered engine, each in its own process
            dump = Path(tmp) / f"{engine}.json"
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, __file__, "--child", engine, "--policy", str(policy), "--prompts",
                                str(a.prompts), "--n", str(a.n), "--repeats", str(a.repeats), "--dump", str(dump)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{engine}: failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
                continue
            rows[engine] = {**json.loads(dump.read_text()), "process_s": time.perf_counter() - t0}
        print(f"{a.prompts} prompts x {a.n} samples x <=16 new tokens, tiny policy, fp32 "
              f"(generation: median of {a.repeats})")
        print(f"{'engine':8}{'import s':>10}{'init s':>9}{'generate s':>12}{'samples/s':>11}{'process s':>11}")
        for e, d in rows.items():
            g = statistics.median(d["gen_s"])
            print(f"{e:8}{d['import_s']:>10.2f}{d['init_s']:>9.2f}{g:>12.2f}{d['samples'] / g:>11.0f}"
                  f"{d['process_s']:>11.1f}")
        ref = engines.FALLBACK  # hf: the engine every other one is timed against
        base = statistics.median(rows[ref]["gen_s"]) if ref in rows else None
        for e, d in rows.items():
            if e != ref and base:
                print(f"{e} / {ref} generation time: {statistics.median(d['gen_s']) / base:.1f}x")
            if not engines.capabilities(e).logprobs_match_trainer:
                mx, mean = _mismatch(policy, d)
                print(f"{e} log-probs vs the trainer's forward pass: max abs diff {mx:.3g}, mean {mean:.3g} nats")


if __name__ == "__main__":
    main()
