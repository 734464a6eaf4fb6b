#!/usr/bin/env bash
# Quickstart on the embedded tiny model: sft -> freeze-ref -> eval.
# Knobs (environment): RUNS (output folder), SEED, SFT_EXAMPLES, EVAL_NUM, REF_DTYPE, TASK.
# A rerun skips every stage whose output is up to date with its inputs and settings.
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

defaults RUNS=runs/quickstart SEED=0 TASK=arithmetic SFT_EXAMPLES=24000 EVAL_NUM=300 REF_DTYPE=bf16

mkdir -p "$RUNS"
rlkit sft --task "$TASK" --num-examples "$SFT_EXAMPLES" --eval-num "$EVAL_NUM" --seed "$SEED" --out "$RUNS/sft"
rlkit freeze-ref --policy "$RUNS/sft" --out "$RUNS/ref" --dtype "$REF_DTYPE"
rlkit eval --policy "$RUNS/sft" --task "$TASK" --num-prompts "$EVAL_NUM" --seed "$SEED" --label sft --metrics "$RUNS/metrics.jsonl"
rlkit inspect "$RUNS/ref"
