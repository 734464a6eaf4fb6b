"""Peak memory of one training step at Qwen2.5-7B's shapes, traced on fake tensors: rlkit's completion_logprobs
forward and backward plus an AdamW step, old code against new, on a CPU, in minutes, without the memory.

Usage: python benchmarks/fake_7b.py [--old DIR] [--cases NAME ...] [--list] [--rows 128] [--prompt 512]
           [--completion 1024] [--json FILE] [--smoke]

Method: a Qwen2ForCausalLM built from a Qwen2Config with Qwen2.5-7B's shapes (hidden 3584, 28 layers, 28 heads /
4 KV heads, MLP 18944, vocabulary 152064, untied output head: 7,615,616,512 parameters) under
`torch._subclasses.fake_tensor.FakeTensorMode`, so no weight or activation is ever allocated, and
`torch.distributed._tools.mem_tracker.MemTracker` counting the bytes of every tensor the ops create, as a
device's allocator would hold them (weights and AdamW state in fp32, the forward and backward under bf16
autocast, no gradient checkpointing, sdpa attention, which keeps no (L, L) score tensor). Each row is
--prompt + --completion tokens; the loss is the token mean of the completion log-probs over the whole
minibatch of --rows rows. A case traces its forward/backward passes and then ONE AdamW step (the optimizer's
first: its moments are allocated inside the step, as in rlkit's first update):
- old-N: the old code (--old DIR, its rlkit.ops.logprobs first on the import path): N rows in one forward
  and backward, right-padded (what `update --minibatch-size N` does there);
- new-N: the new code (this checkout), N rows in one pass, padded layout;
- new-mbK: the new code's micro-batches of K rows out of --rows: the first two micro-batches are traced
  (the second runs with every gradient allocated; the later ones repeat it), their gradients accumulating,
  then the step: the peak of `update --micro-batch-size K`;
- new-mbK-packed: the same with the K sequences packed into one row (per-sequence position_ids, no padding:
  FlashAttention's varlen layout, `layout(..., capacity=None)`).
Figures: peak GiB over the whole case (the issue's figure), and its parts at that moment; the peak of the
forward/backward passes alone; and the steady-state peak of a later update, whose AdamW moments already exist
while the passes run: max(forward/backward peak + the moments' bytes, the step's peak). Each case is a
process of its own (the old and new code cannot share one). Fake tensors compute nothing, so a case traces in
20 to 50 s on a 2-core CPU whatever its row count, except new-ROWS (about 4 minutes: the new log-prob path
walks the packed (1, K) completion positions 32 at a time, K/32 = 4,096 steps for 128 x 1,024 tokens, which
is why it is not a default case); the default cases take about 5 minutes. --smoke: tiny shapes, a few
seconds a case, for checking the script itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

QWEN25_7B = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
             "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
SMOKE = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "tie_word_embeddings": False}


def cases(rows: int) -> dict[str, dict]:
    """Every case by name: which code, rows per forward, forwards traced, layout."""
    out: dict[str, dict] = {}
    for n in (rows, 8, 1):
        out[f"old-{n}"] = {"code": "old", "rows": n, "passes": 1, "layout": "padded"}
    for n in (rows, 8, 1):
        out[f"new-{n}"] = {"code": "new", "rows": n, "passes": 1, "layout": "padded"}
    for k in (1, 2, 4, 8):
        out[f"new-mb{k}"] = {"code": "new", "rows": k, "passes": 2, "layout": "padded"}
        out[f"new-mb{k}-packed"] = {"code": "new", "rows": k, "passes": 2, "layout": "packed"}
    return out


def default_cases(rows: int) -> list[str]:
    return [f"old-{rows}", "old-8", "old-1", "new-8", "new-mb1", "new-mb2", "new-mb4", "new-mb4-packed"]


# ------------------------------------------------------------------------------------------------
# The child: one case, traced


def trace(case: dict, shapes: dict, prompt: int, completion: int, minibatch: int) -> dict:
    import inspect
    import warnings

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    import rlkit.ops.logprobs as lp_mod

    hf_logging.set_verbosity_error()
    # rlkit's in-place log-prob backward compares data pointers; a fake tensor's is 0 (its copy is skipped,
    # which allocates nothing either way) and torch warns about reading it
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    new_api = "seqs" in inspect.signature(lp_mod.completion_logprobs).parameters
    if (case["code"] == "new") != new_api:
        raise SystemExit(f"{lp_mod.__file__}: completion_logprobs takes "
                         f"{'a layout (Seqs)' if new_api else 'padded tensors'}, not what a {case['code']}-code case "
                         f"calls")
    rows, L = case["rows"], prompt + completion
    total_tokens = minibatch * completion  # the loss is the token mean over the whole minibatch
    config = Qwen2Config(**shapes, attn_implementation="sdpa")
    t0 = time.monotonic()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    if new_api:  # the layout is built on the CPU from token lists, as the trainer does; then made fake
        from rlkit.ops.packing import Seqs, layout

        real = layout([[1] * L for _ in range(rows)], [prompt] * rows, packed=case["layout"] == "packed",
                      capacity=None if case["layout"] == "packed" else 0)
    with fake:
        model = Qwen2ForCausalLM(config)
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99))
        if new_api:
            seqs = Seqs(*(fake.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in real))
            mask = torch.ones((rows, completion), dtype=torch.bool)
        else:
            ids = torch.randint(0, shapes["vocab_size"], (rows, L))
            attn = torch.ones_like(ids)
            targets, start = ids[:, prompt:], torch.full((rows,), prompt - 1)
            mask = torch.ones((rows, completion), dtype=torch.bool)
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            for i in range(case["passes"]):
                if i:
                    mt.reset_mod_stats()  # per-module figures only: the tracker's peak runs on
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    if new_api:
                        logp, _ = lp_mod.completion_logprobs(model, seqs)
                    else:
                        logp, _ = lp_mod.completion_logprobs(model, ids, attn, targets, start)
                loss = -(logp * mask).sum() / total_tokens
                loss.backward()
                del logp, loss
            passes = mt.get_tracker_snapshot("peak")
            opt.step()
            opt.zero_grad(set_to_none=True)
            peak = mt.get_tracker_snapshot("peak")
            moments = mt.get_tracker_snapshot("current")
    dev = next(iter(peak))

    def parts(snap: dict) -> dict:
        return {str(getattr(k, "value", k)): int(v) for k, v in snap[dev].items()}

    p, f, cur = parts(peak), parts(passes), parts(moments)
    opt_bytes = cur.get("Optstate", 0)
    return {"parameters": params, "peak": p, "passes_peak": f, "optimizer_state_bytes": opt_bytes,
            "steady_peak": max(f["Total"] + opt_bytes, p["Total"]), "trace_s": round(time.monotonic() - t0, 1),
            "logprobs": lp_mod.__file__, "positions_per_pass": rows * L}


def child(spec: dict) -> None:
    tree = spec["tree"]
    sys.path.insert(0, tree)
    res = trace(spec["case"], spec["shapes"], spec["prompt"], spec["completion"], spec["minibatch"])
    print("@@fake_7b " + json.dumps(res), flush=True)


# ------------------------------------------------------------------------------------------------


UNIT = ["GiB", 2**30]  # --smoke prints MiB


def gib(b) -> str:
    return f"{b / UNIT[1]:,.1f}" if isinstance(b, int | float) else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, help="A checkout of the old code (git worktree add DIR COMMIT); without it the "
                    "old-* cases are skipped.")
    ap.add_argument("--cases", nargs="+", help="Cases to run (default: old-ROWS old-8 old-1 new-8 new-mb1 new-mb2 "
                    "new-mb4 new-mb4-packed); --list names them all (new-ROWS too).")
    ap.add_argument("--list", action="store_true", help="Name every case and exit.")
    ap.add_argument("--rows", type=int, default=128, help="Rows of the minibatch (one optimizer step).")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--completion", type=int, default=1024)
    ap.add_argument("--json", type=Path, help="Write every figure to this file.")
    ap.add_argument("--smoke", action="store_true", help="Tiny shapes (a few seconds a case): checks the script.")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child))
        return
    shapes = SMOKE if a.smoke else QWEN25_7B
    if a.smoke:
        a.rows, a.prompt, a.completion = 8, 16, 32
        UNIT[:] = ["MiB", 2**20]
    every = cases(a.rows)
    if a.list:
        for name, c in every.items():
            print(f"{name:16} {c['code']} code, {c['rows']} rows a pass, {c['passes']} pass(es) traced, {c['layout']}")
        return
    names = a.cases or default_cases(a.rows)
    unknown = [n for n in names if n not in every]
    if unknown:
        sys.exit(f"unknown case(s) {', '.join(unknown)}; --list names them")
    old = a.old.resolve() if a.old else None
    if old is not None and not (old / "rlkit" / "ops" / "logprobs.py").is_file():
        sys.exit(f"--old {old}: no rlkit/ops/logprobs.py there")
    t0 = time.monotonic()
    results = []
    for name in names:
        c = every[name]
        if c["code"] == "old" and old is None:
            results.append({"case": name, "status": "skipped (no --old)"})
            continue
        if c["code"] == "new" and c["rows"] > a.rows:
            results.append({"case": name, "status": f"skipped (more rows than --rows {a.rows})"})
            continue
        spec = {"tree": str(old if c["code"] == "old" else REPO), "case": c, "shapes": shapes, "prompt": a.prompt,
                "completion": a.completion, "minibatch": a.rows}
        r = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
        line = next((x for x in r.stdout.splitlines() if x.startswith("@@fake_7b ")), None)
        if r.returncode or line is None:
            err = (r.stderr.strip().splitlines() or ["no output"])[-1]
            results.append({"case": name, "status": f"failed (exit {r.returncode}): {err}"})
        else:
            results.append({"case": name, "status": "ok", **c, **json.loads(line.split(" ", 1)[1])})
        print_row(results[-1], first=len(results) == 1, shapes=shapes, a=a)
    secs = time.monotonic() - t0
    old_full = next((r for r in results if r["case"] == f"old-{a.rows}" and r["status"] == "ok"), None)
    best = min((r for r in results if r["status"] == "ok" and r["code"] == "new"), key=lambda r: r["peak"]["Total"],
               default=None)
    if old_full and best:
        print(f"{best['case']} / old-{a.rows}: {best['peak']['Total'] / old_full['peak']['Total']:.3f}x peak")
    print(f"{secs:.0f} s in all; {UNIT[0]} = {UNIT[1]:,} bytes")
    if a.json:
        a.json.write_text(json.dumps({"shapes": shapes, "rows": a.rows, "prompt": a.prompt, "completion": a.completion,
                                      "old": str(old) if old else None, "new": str(REPO), "cases": results,
                                      "seconds": round(secs, 1)}, indent=2) + "\n")


def print_row(r: dict, first: bool, shapes: dict, a) -> None:
    if first:
        print(f"Qwen2 at {'smoke' if a.smoke else 'Qwen2.5-7B'} shapes (hidden {shapes['hidden_size']}, "
              f"{shapes['num_hidden_layers']} layers, {shapes['num_attention_heads']}/{shapes['num_key_value_heads']} "
              f"heads, MLP {shapes['intermediate_size']}, vocabulary {shapes['vocab_size']:,}); minibatch {a.rows} rows "
              f"x ({a.prompt} prompt + {a.completion} completion) tokens; fp32 weights and AdamW, bf16 autocast, "
              "fake tensors (FakeTensorMode + MemTracker)")
        u = UNIT[0]
        print(f"{'case':16} {'peak ' + u:>9} {'weights':>8} {'grads':>7} {'AdamW':>7} {'act':>7} {'temp':>7} "
              f"{'passes ' + u:>10} {'steady ' + u:>10} {'trace s':>7}")
    if r["status"] != "ok":
        print(f"{r['case']:16} {r['status']}")
        return
    p = r["peak"]
    print(f"{r['case']:16} {gib(p['Total']):>9} {gib(p.get('Parameter')):>8} {gib(p.get('Gradient')):>7} "
          f"{gib(p.get('Optstate')):>7} {gib(p.get('Activation')):>7} {gib(p.get('Temp')):>7} "
          f"{gib(r['passes_peak']['Total']):>10} {gib(r['steady_peak']):>10} {r['trace_s']:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
