#!/usr/bin/env bash
# The reward-hacking experiment: why RLHF keeps a KL leash to the reference.
#   sft -> build-prefs --bias length (longer answer preferred, right or wrong) -> train-rm (its sanity report
#   flags the length bias) -> freeze-ref -> for each BETA: ROUNDS x (rollout | score-ref --ref --rm | update,
#   the biased reward model as the only reward) with held-out accuracy every round -> one report.
# Same SFT checkpoint, same seeds, same everything per run except beta. The recipe does not assert an outcome
# (it is an experiment): look at $RUNS/report.png. What one usually sees: proxy reward climbs in every run,
# held-out accuracy falls, KL climbs faster as beta shrinks, responses get longer.
# Knobs (environment), defaults in brackets:
#   RUNS [runs/reward-hacking]  SEED [0]  TASK [arithmetic]  SFT_EXAMPLES [24000]  EVAL_NUM [300]
#   PROSE [0.25] fraction of SFT answers written as a sentence ("The total is 12."), so that the policy can
#     write longer answers at all (a policy that only ever saw bare numbers has no longer answer to find)
#   PREF_PROMPTS [512]  PREF_N [4]  RM_EPOCHS [1]  BETAS ["0.05 0.005 0"]
#   ROUNDS [3]  PROMPTS [192] prompts per round  N [8] samples per prompt  MAX_NEW_TOKENS [64]
#   ALGO [grpo]  LR [1e-4]  EPOCHS [2]  MINIBATCH [128]
# A rerun skips every stage and round that is up to date with its inputs and settings.
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

defaults RUNS=runs/reward-hacking SEED=0 TASK=arithmetic SFT_EXAMPLES=24000 EVAL_NUM=300 PREF_PROMPTS=512 PREF_N=4
defaults RM_EPOCHS=1 BETAS="0.05 0.005 0" ROUNDS=3 PROMPTS=192 N=8 MAX_NEW_TOKENS=64 PROSE=0.25
case "$TASK" in *:*) SFT_TASK="$TASK,prose=$PROSE" ;; *) SFT_TASK="$TASK:prose=$PROSE" ;; esac
defaults ALGO=grpo LR=1e-4 EPOCHS=2 MINIBATCH=128

mkdir -p "$RUNS"
rlkit sft --task "$SFT_TASK" --num-examples "$SFT_EXAMPLES" --eval-num "$EVAL_NUM" --seed "$SEED" --out "$RUNS/sft"
rlkit build-prefs --policy "$RUNS/sft" --task "$TASK" --num-prompts "$PREF_PROMPTS" --n "$PREF_N" --bias length \
  --max-new-tokens "$MAX_NEW_TOKENS" \
  --seed "$SEED" --out "$RUNS/prefs-length-biased.arrow"
rlkit train-rm --model "$RUNS/sft" --prefs "$RUNS/prefs-length-biased.arrow" --epochs "$RM_EPOCHS" --seed "$SEED" \
  --out "$RUNS/rm-length-biased"
rlkit freeze-ref --policy "$RUNS/sft" --out "$RUNS/ref" --dtype bf16

# the SFT checkpoint's held-out eval: once, the first point of every beta's curves
sft_eval="$RUNS/eval-sft.jsonl"
sft_knobs="sft_task=$SFT_TASK sft_examples=$SFT_EXAMPLES task=$TASK eval_num=$EVAL_NUM max_new=$MAX_NEW_TOKENS pref_prompts=$PREF_PROMPTS pref_n=$PREF_N rm_epochs=$RM_EPOCHS seed=$SEED"
if [ ! -s "$sft_eval" ] || [ "$(cat "$sft_eval.knobs" 2>/dev/null)" != "$sft_knobs" ]; then
  rm -f "$sft_eval" "$sft_eval.tmp"
  rlkit eval --policy "$RUNS/sft" --task "$TASK" --num-prompts "$EVAL_NUM" --max-new-tokens "$MAX_NEW_TOKENS" --rm "$RUNS/rm-length-biased" \
    --label sft --metrics "$sft_eval.tmp" --json > /dev/null
  mv "$sft_eval.tmp" "$sft_eval"
  echo "$sft_knobs" > "$sft_eval.knobs"
fi

# one round at $beta: rollout | score-ref --rm lenbias | update into $out, then its held-out eval
biased_round() {
  rlkit rollout --policy "$policy" --task "$TASK" --num-prompts "$PROMPTS" --n "$N" --max-new-tokens "$MAX_NEW_TOKENS" \
      --seed "$((SEED * 1000 + i))" \
    | rlkit score-ref --ref "$RUNS/ref" --rm "lenbias=$RUNS/rm-length-biased" \
    | rlkit update --algo "$ALGO" --policy "$policy" --out "$out" --lr "$LR" --epochs "$EPOCHS" \
        --minibatch-size "$MINIBATCH" --beta "$beta" --reward rm:lenbias=1 --seed "$SEED" --metrics "$metrics"
  rlkit eval --policy "$out" --task "$TASK" --num-prompts "$EVAL_NUM" --max-new-tokens "$MAX_NEW_TOKENS" --rm "$RUNS/rm-length-biased" --label "round-$i" \
    --metrics "$metrics" --json > /dev/null
}
report_args=()
for beta in $BETAS; do
  run="$RUNS/beta-$beta"
  metrics="$run/metrics.jsonl"
  mkdir -p "$run"
  knobs="task=$TASK prompts=$PROMPTS n=$N max_new=$MAX_NEW_TOKENS algo=$ALGO lr=$LR epochs=$EPOCHS mb=$MINIBATCH beta=$beta seed=$SEED"
  if [ "$(cat "$run/knobs" 2>/dev/null)" != "$knobs" ]; then
    rm -f "$metrics"  # a different experiment: start its curves afresh
    echo "$knobs" > "$run/knobs"
  fi
  [ -s "$metrics" ] || cp "$sft_eval" "$metrics"
  policy="$RUNS/sft"
  for i in $(seq 1 "$ROUNDS"); do
    out="$run/round-$i"
    round "beta $beta round $i" "$out" biased_round
    policy="$out"
  done
  report_args+=("beta-$beta=$metrics")
done

rlkit report "${report_args[@]}" --title "reward hacking: length-biased reward model, beta sweep" --out "$RUNS/report.png"
rlkit report "${report_args[@]}" --title "reward hacking: length-biased reward model, beta sweep" --out "$RUNS/report.html"
echo "report: $RUNS/report.png and $RUNS/report.html" >&2
