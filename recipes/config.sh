#!/usr/bin/env bash
# RLVR from one config file: sft -> freeze-ref -> eval -> ROUNDS x (rollout | score-ref | update; eval), every
# stage reading its settings from CONFIG [recipes/rlvr.toml] with `--config`. The knobs below, when set,
# are passed as flags, which win over the file. Each checkpoint records the options it ran with:
# `rlkit inspect RUNS/round-1 --config` writes them back as a file `--config` reads.
# Knobs (environment): RUNS [runs/config]  CONFIG [recipes/rlvr.toml]  ROUNDS [2]  SEED [0] (rollout's, per round)
#   and, to scale it down, SFT_EXAMPLES  EVAL_NUM  PROMPTS  N (unset: the file's values)
set -euo pipefail

CONFIG=${CONFIG:-$(dirname "$0")/rlvr.toml}
RUNS=${RUNS:-runs/config}
ROUNDS=${ROUNDS:-2}
SEED=${SEED:-0}
sft=() ev=() roll=()
[ -n "${SFT_EXAMPLES:-}" ] && sft+=(--num-examples "$SFT_EXAMPLES")
[ -n "${EVAL_NUM:-}" ] && sft+=(--eval-num "$EVAL_NUM") && ev+=(--num-prompts "$EVAL_NUM")
[ -n "${PROMPTS:-}" ] && roll+=(--num-prompts "$PROMPTS")
[ -n "${N:-}" ] && roll+=(--n "$N")

mkdir -p "$RUNS"
rlkit sft --config "$CONFIG" "${sft[@]}" --out "$RUNS/sft"
rlkit freeze-ref --config "$CONFIG" --policy "$RUNS/sft" --out "$RUNS/ref"
: > "$RUNS/metrics.jsonl"
rlkit eval --config "$CONFIG" --policy "$RUNS/sft" "${ev[@]}" --label sft --json --metrics "$RUNS/metrics.jsonl" > "$RUNS/eval-sft.json"
policy="$RUNS/sft"
for i in $(seq 1 "$ROUNDS"); do
  rlkit rollout --config "$CONFIG" --policy "$policy" "${roll[@]}" --seed "$((SEED * 1000 + i))" \
    | rlkit score-ref --config "$CONFIG" --ref "$RUNS/ref" \
    | rlkit update --config "$CONFIG" --policy "$policy" --out "$RUNS/round-$i" --metrics "$RUNS/metrics.jsonl"
  rlkit eval --config "$CONFIG" --policy "$RUNS/round-$i" "${ev[@]}" --label "round-$i" --json \
    --metrics "$RUNS/metrics.jsonl" > "$RUNS/eval-round-$i.json"
  policy="$RUNS/round-$i"
done
rlkit report "$RUNS/metrics.jsonl" --title "RLVR from $(basename "$CONFIG")" --out "$RUNS/report.png"
echo "the options round $ROUNDS ran with (rlkit inspect $policy --config):"
rlkit inspect "$policy" --config
