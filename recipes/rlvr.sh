#!/usr/bin/env bash
# RLVR on the embedded tiny model: sft -> freeze-ref -> eval -> ROUNDS x (rollout | score-ref | update; eval).
# $RUNS/metrics.jsonl gets every update's and every held-out eval's figures; `rlkit report` plots them.
# Knobs (environment), defaults in brackets:
#   RUNS [runs/rlvr]  SEED [0]  TASK [arithmetic] (any --task spec)  MODEL [tiny] (sft's base: a model directory or hub id)
#   SFT_EXAMPLES [24000]  EVAL_NUM [300]
#   ROUNDS [3]  PROMPTS [512] prompts per round  N [8] samples per prompt  MAX_NEW_TOKENS [16]
#   ALGO [grpo]  LR [5e-5]  EPOCHS [2]  MINIBATCH [128]  BETA [0.01]  KL [k3+] (in the loss; see docs/algorithms.md)  TEMPERATURE [1.0]
#   DROP_DEGENERATE [0] leave out groups whose rewards are all equal (no signal, ~20% less work)
#   DUAL_CLIP [3] cap on the loss of negative-advantage tokens (-C*A; 0: off)
#   MIN_INFORMATIVE [] DAPO's dynamic sampling: groups with unequal rewards a round (rollout --min-informative-groups),
#     sampling past PROMPTS until there are that many  MAX_REFILL [4] extra rounds of PROMPTS at most
#   SANDBOX [] where the code task's programs run: bwrap (its default) or none (unsafe)  SANDBOX_WORKERS [CPU count]
#   REPORT_TO [] experiment trackers, e.g. wandb or tensorboard,mlflow (--report-to; the whole recipe is one run)  PROJECT [rlkit]
# A rerun skips every stage whose output is up to date with its inputs and settings.
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

defaults RUNS=runs/rlvr SEED=0 TASK=arithmetic MODEL=tiny SFT_EXAMPLES=24000 EVAL_NUM=300 ROUNDS=3 PROMPTS=512 N=8
defaults MAX_NEW_TOKENS=16 ALGO=grpo LR=5e-5 EPOCHS=2 MINIBATCH=128 BETA=0.01 KL=k3+ TEMPERATURE=1.0
defaults DROP_DEGENERATE=0 DUAL_CLIP=3
drop_flag=()
[ "$DROP_DEGENERATE" = 1 ] && drop_flag=(--drop-degenerate)
refill=()
[ -n "${MIN_INFORMATIVE:-}" ] && refill=(--min-informative-groups "$MIN_INFORMATIVE" --max-refill-rounds "${MAX_REFILL:-4}")
sandbox=()
[ -n "${SANDBOX:-}" ] && sandbox+=(--sandbox "$SANDBOX")
[ -n "${SANDBOX_WORKERS:-}" ] && sandbox+=(--sandbox-workers "$SANDBOX_WORKERS")
# sft starts the tracker run; eval and update continue the run their --policy was trained in
track=()
[ -n "${REPORT_TO:-}" ] && track=(--report-to "$REPORT_TO" --project "${PROJECT:-rlkit}")

mkdir -p "$RUNS"
start_times

timed sft rlkit sft --model "$MODEL" --task "$TASK" --num-examples "$SFT_EXAMPLES" --eval-num "$EVAL_NUM" --seed "$SEED" \
  --out "$RUNS/sft" "${sandbox[@]}" "${track[@]}"
timed freeze-ref rlkit freeze-ref --policy "$RUNS/sft" --out "$RUNS/ref" --dtype bf16
timed eval-sft rlkit eval --policy "$RUNS/sft" --task "$TASK" --num-prompts "$EVAL_NUM" --max-new-tokens "$MAX_NEW_TOKENS" --label sft --json \
  --metrics "$RUNS/metrics.jsonl" "${sandbox[@]}" "${track[@]}" > "$RUNS/eval-sft.json"

knobs="task=$TASK prompts=$PROMPTS n=$N max_new=$MAX_NEW_TOKENS algo=$ALGO lr=$LR epochs=$EPOCHS mb=$MINIBATCH beta=$BETA kl=$KL temp=$TEMPERATURE drop=$DROP_DEGENERATE dual=$DUAL_CLIP seed=$SEED${MIN_INFORMATIVE:+ refill=$MIN_INFORMATIVE/${MAX_REFILL:-4}}"
policy="$RUNS/sft"
rl_start=$(now)
# one round: rollout | score-ref | update into $out, timed, its held-out eval to be redone
rl_round() {
  local t0
  t0=$(now)
  timed "round-$i:rollout" rlkit rollout --policy "$policy" --task "$TASK" --num-prompts "$PROMPTS" --n "$N" \
      --max-new-tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE" --seed "$((SEED * 1000 + i))" "${sandbox[@]}" "${refill[@]}" \
    | timed "round-$i:score-ref" rlkit score-ref --ref "$RUNS/ref" \
    | timed "round-$i:update" rlkit update --policy "$policy" --out "$out" --algo "$ALGO" --lr "$LR" \
        --epochs "$EPOCHS" --minibatch-size "$MINIBATCH" --beta "$BETA" --kl-estimator "$KL" --dual-clip "$DUAL_CLIP" \
        --seed "$SEED" "${drop_flag[@]}" --metrics "$RUNS/metrics.jsonl" "${track[@]}"
  log_time "round-$i" "$t0"
  rm -f "$RUNS/eval-round-$i.json"
}
for i in $(seq 1 "$ROUNDS"); do
  out="$RUNS/round-$i"
  round "round $i" "$out" rl_round
  policy="$out"
  # held-out accuracy after every round, beside the update's reward, KL and length in the same metrics file
  if [ ! -s "$RUNS/eval-round-$i.json" ]; then
    t0=$(now)
    into "$RUNS/eval-round-$i.json" rlkit eval --policy "$out" --task "$TASK" --num-prompts "$EVAL_NUM" \
      --max-new-tokens "$MAX_NEW_TOKENS" --label "round-$i" --json --metrics "$RUNS/metrics.jsonl" "${sandbox[@]}" "${track[@]}"
    eval_secs=$(awk -v e="${eval_secs:-0}" -v a="$t0" -v b="$(now)" 'BEGIN{printf "%.2f", e+b-a}')
  fi
done
# the RL phase: the rounds' pipes, without the per-round held-out evals (observability, not training)
rl_secs=$(awk -v a="$rl_start" -v b="$(now)" -v e="${eval_secs:-0}" 'BEGIN{printf "%.1f", b-a-e}')
cp "$RUNS/eval-round-$ROUNDS.json" "$RUNS/eval-final.json"
rlkit report "$RUNS/metrics.jsonl" --title "RLVR: $TASK" --out "$RUNS/report.png"

summary "$RUNS" "$rl_secs" "$ROUNDS" <<'PY'
runs, rl_secs, n_rounds = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
times = wall_times(runs)
rounds = sorted({k.split(":")[0] for k in times if k.startswith("round-")}, key=lambda r: int(r.split("-")[1]))
before, after = accuracy_table(runs, f"after RL ({n_rounds} rounds)")
skipped = n_rounds - len(rounds)
note = f" ({skipped} up-to-date rounds skipped)" if skipped else ""
print(f"{gain(before, after)}; RL phase wall time {rl_secs:.1f}s{note} (per-round held-out evals not counted)\n")
if rounds:
    print(f"{'round':8}{'wall s':>8}{'rollout':>9}{'score-ref':>11}{'update':>8}   (process wall times; they overlap in the pipe)")
    for r in rounds:
        print(f"{r:8}{times[r]:>8.1f}{times[r + ':rollout']:>9.1f}{times[r + ':score-ref']:>11.1f}{times[r + ':update']:>8.1f}")
PY
