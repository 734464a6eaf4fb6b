"""Peak memory of scoring completion log-probs with a 150k vocabulary: rlkit's lean path against the
naive `log_softmax(model(x).logits).gather(...)`.

Usage: python benchmarks/logprob_memory.py [--vocab 151936] [--batch 8] [--prompt 64] [--completion 256]
Each method runs in a fresh process (peak RSS = ru_maxrss); the figures are the peak over the
process's footprint after the model and inputs are built, plus the logits' own size for scale.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from rlkit.ops.logprobs import completion_logprobs, padded, pack_sequences
a = json.loads(sys.argv[1])
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=a["vocab"], hidden_size=256, intermediate_size=512,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)).eval()
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, a["vocab"], (a["prompt"],), generator=g).tolist() for _ in range(a["batch"])]
comps = [torch.randint(0, a["vocab"], (a["completion"],), generator=g).tolist() for _ in range(a["batch"])]
ids, attn, targets, cmask, start = pack_sequences(prompts, comps, 0)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    if a["method"] == "naive":
        logits = model(input_ids=ids, attention_mask=attn).logits
        lp = torch.log_softmax(logits.float(), -1)
        out = torch.stack([lp[b, start[b] + torch.arange(targets.shape[1])].gather(-1, targets[b].unsqueeze(-1)).squeeze(-1)
                           for b in range(len(prompts))])
    else:
        out, _ = completion_logprobs(model, padded(ids, attn, start))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"base_kb": base, "peak_kb": peak, "checksum": float(out.sum())}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--completion", type=int, default=256)
    a = vars(ap.parse_args())
    res = {}
    for method in ("naive", "rlkit"):
        r = subprocess.run([sys.executable, "-c", CHILD, json.dumps({**a, "method": method})],
                           capture_output=True, text=True, check=True)
        res[method] = json.loads(r.stdout.strip().splitlines()[-1])
    logits_mb = a["batch"] * (a["prompt"] + a["completion"]) * a["vocab"] * 4 / 2**20
    print(f"vocab {a['vocab']:,}, batch {a['batch']}, prompt {a['prompt']} + completion {a['completion']} tokens; "
          f"full fp32 logits = {logits_mb:,.0f} MiB")
    for m, r in res.items():
        print(f"{m:6} peak RSS {r['peak_kb'] / 1024:8,.0f} MiB  (+{(r['peak_kb'] - r['base_kb']) / 1024:,.0f} MiB over "
              f"the built model)  checksum {r['checksum']:.3f}")
    n, k = (res[m]["peak_kb"] - res[m]["base_kb"] for m in ("naive", "rlkit"))
    print(f"scoring overhead ratio naive/rlkit: {n / k:.2f}x; same log-probs: "
          f"{abs(res['naive']['checksum'] - res['rlkit']['checksum']) < 1e-2 * abs(res['naive']['checksum'])}")


if __name__ == "__main__":
    main()
