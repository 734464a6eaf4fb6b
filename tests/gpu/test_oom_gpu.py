"""A CUDA out-of-memory error in `update` is one line naming the flag that lowers memory, exit code 71, and nothing
at --out.

What runs out, on any GPU made so far: a 973M-parameter model of the embedded model's architecture (Llama; hidden
2048, 16 layers, MLP 8192) and tokenizer (one token a character), built from a config and saved with
save_pretrained, asked to train a rollouts table of 4,096 rows of 2,000-token prompts as ONE minibatch
(--minibatch-size 4096), 8.2M tokens a forward pass. Whatever update computes first over that minibatch (the pi_old
recompute under bf16 autocast, or the fp32 training forward), the embedding's output alone is 8.2M x 2048 fp32 =
63 GiB and the first RMSNorm makes two more of that size: ~190 GiB before any matmul, and the MLP's intermediate
activations are 4x larger still. The rollouts come from an 80k-parameter model with the same tokenizer (update
only warns that they were sampled from another checkpoint), so sampling them takes seconds on a GPU.
(The embedded architecture rather than Qwen2: transformers loads a qwen2 checkpoint's tokenizer as Qwen2's
byte-level one, which would not keep the character tokenizer.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli

ROWS, PROMPT_CHARS = 4096, 2000  # 512 prompts x 8 samples; one character is one token (the tiny tokenizer)

BUILD = r"""
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from rlkit.tiny import build_tokenizer
out, hidden, layers, heads, kv, inter = sys.argv[1], *map(int, sys.argv[2:])
tok = build_tokenizer()
config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=4096,
                     tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id)
torch.manual_seed(0)
model = LlamaForCausalLM(config)
model.generation_config.pad_token_id = tok.pad_token_id
model.save_pretrained(out, safe_serialization=True)
tok.save_pretrained(out)
print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))
"""


def build(out: Path, hidden: int, layers: int, heads: int, kv: int, inter: int) -> int:
    """A random Llama from a config with the embedded tokenizer, saved with save_pretrained (CPU, a subprocess)."""
    r = subprocess.run([sys.executable, "-c", BUILD, str(out), *map(str, (hidden, layers, heads, kv, inter))],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["parameters"]


@pytest.fixture(scope="module")
def long_rollouts(tmp_path_factory) -> Path:
    """ROWS rollouts of PROMPT_CHARS-token prompts, sampled on the GPU by a small random model."""
    d = tmp_path_factory.mktemp("oom")
    build(d / "small", hidden=64, layers=2, heads=4, kv=2, inter=128)
    filler = "0123456789+-= abcdefghijklmnopqrstuvwxyz"
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(ROWS // 8):
            q = f"<{i}+1>="
            text = "".join(filler[(i * 7 + j * 13) % len(filler)] for j in range(PROMPT_CHARS - len(q))) + q
            f.write(json.dumps({"prompt": text, "answer": str(i + 1)}) + "\n")
    out = d / "rollouts.arrow"
    r = run_cli("rollout", "--policy", str(d / "small"), "--engine", "hf", "--prompts", str(d / "prompts.jsonl"),
                "--n", "8", "--max-new-tokens", "16", "--batch-tokens", "131072", "--out", str(out), timeout=1200)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return out


def test_update_out_of_gpu_memory_is_one_line_exit_71_and_writes_nothing(long_rollouts, tmp_path):
    from rlkit.io import streams

    table, _ = streams.read_table(long_rollouts, ["rollouts"])
    assert table.num_rows == ROWS
    assert min(len(p) for p in table.column("prompt_ids").to_pylist()) >= PROMPT_CHARS
    big = tmp_path / "big"
    params = build(big, hidden=2048, layers=16, heads=16, kv=4, inter=8192)
    assert 900_000_000 < params < 1_100_000_000  # ~1B

    out, metrics = tmp_path / "oom" / "upd", tmp_path / "metrics.jsonl"
    r = run_cli("update", "--policy", str(big), "--in", str(long_rollouts), "--out", str(out), "--beta", "0",
                "--epochs", "1", "--length-penalty", "0.05", "--minibatch-size", str(ROWS), "--metrics", str(metrics),
                timeout=1800)
    err = r.stderr.decode()
    assert r.returncode == 71, f"exit {r.returncode}: {err[-3000:]}"
    errors = [ln for ln in err.splitlines() if ln.startswith("rlkit:")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err[-3000:]
    line = errors[0]
    print(f"\n{line}")
    assert re.fullmatch(rf"rlkit: error: update: out of GPU memory with --minibatch-size {ROWS}\b.*; lower it with "
                        r"--micro-batch-size\b.*; nothing was written", line), line
    assert "Traceback" not in err and r.stdout == b""
    # nothing at --out: no directory, no leftovers, not even the parent it created; no metrics line
    assert not out.exists() and not out.parent.exists()
    assert not metrics.exists() or metrics.read_text() == ""
