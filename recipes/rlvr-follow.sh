#!/usr/bin/env bash
# RLVR on the embedded tiny model as ONE persistent pipe: the same run as recipes/rlvr.sh (same knobs,
# seeds and summary lines), but rollout, score-ref and update each start once and keep their models:
#   sft -> freeze-ref -> eval -> rollout --follow DIR | score-ref | update --follow --out DIR --max-steps ROUNDS
# update writes DIR/step-000001 .. step-ROUNDS (DIR/latest names the newest); rollout reloads each new step
# into its live engine between batches, at most LAG steps behind (LAG=0: synchronous, the same weights as
# rlvr.sh; LAG=1: rollout samples batch b+1 while update trains on batch b).
# $RUNS/metrics.jsonl gets every step's and every held-out eval's figures; `rlkit report` plots them.
# Knobs (environment), defaults in brackets: every knob of recipes/rlvr.sh (ROUNDS is the number of steps),
#   plus LAG [1] the policy lag bound K (rollout --max-lag, update --max-lag)
#        ENGINE [auto] rollout engine (hf, vllm, auto)
#        EVAL_LIVE [0] 1: a separate process evaluates DIR/latest while the pipe runs (it shares the cores, so
#                  the RL wall time then includes its load); 0: every step is evaluated after the pipe ends
# A rerun with the same knobs resumes an unfinished run from its newest snapshot and skips a finished one; other
# knobs start DIR afresh.
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

defaults RUNS=runs/rlvr-follow SEED=0 TASK=arithmetic SFT_EXAMPLES=24000 EVAL_NUM=300 ROUNDS=3 PROMPTS=512 N=8
defaults MAX_NEW_TOKENS=16 ALGO=grpo LR=5e-5 EPOCHS=2 MINIBATCH=128 BETA=0.01 KL=k3+ TEMPERATURE=1.0
defaults DROP_DEGENERATE=0 DUAL_CLIP=3 LAG=1 ENGINE=auto EVAL_LIVE=0
drop_flag=()
[ "$DROP_DEGENERATE" = 1 ] && drop_flag=(--drop-degenerate)

mkdir -p "$RUNS"
start_times

timed sft rlkit sft --task "$TASK" --num-examples "$SFT_EXAMPLES" --eval-num "$EVAL_NUM" --seed "$SEED" --out "$RUNS/sft"
timed freeze-ref rlkit freeze-ref --policy "$RUNS/sft" --out "$RUNS/ref" --dtype bf16
timed eval-sft rlkit eval --policy "$RUNS/sft" --task "$TASK" --num-prompts "$EVAL_NUM" --label sft --json \
  --metrics "$RUNS/metrics.jsonl" > "$RUNS/eval-sft.json"

CKPTS="$RUNS/ckpts"
knobs="task=$TASK prompts=$PROMPTS n=$N max_new=$MAX_NEW_TOKENS algo=$ALGO lr=$LR epochs=$EPOCHS mb=$MINIBATCH beta=$BETA kl=$KL temp=$TEMPERATURE drop=$DROP_DEGENERATE dual=$DUAL_CLIP seed=$SEED lag=$LAG engine=$ENGINE"
if [ "$(cat "$CKPTS.knobs" 2>/dev/null)" != "$knobs" ]; then
  rm -rf "$CKPTS" "$RUNS"/eval-step-*.json
  echo "$knobs" > "$CKPTS.knobs"
fi
last_step() { local l; l=$(readlink "$CKPTS/latest" 2>/dev/null) || { echo 0; return 0; }; l=${l#step-}; echo $((10#$l)); }

# the held-out eval of one step, once (its JSON is the record that it was done)
eval_step() {
  local i=$1
  [ -s "$RUNS/eval-step-$i.json" ] && return 0
  into "$RUNS/eval-step-$i.json" rlkit eval --policy "$CKPTS/$(printf 'step-%06d' "$i")" --task "$TASK" \
    --num-prompts "$EVAL_NUM" --label "step-$i" --json --metrics "$RUNS/metrics.jsonl"
}
# EVAL_LIVE=1: beside the pipe, evaluate the newest step whenever a new one appears (it reads DIR/latest)
watch_evals() {
  local seen=0 s
  while :; do
    s=$(last_step)
    if [ "$s" -gt "$seen" ]; then
      eval_step "$s"
      seen=$s
    fi
    [ "$seen" -ge "$ROUNDS" ] && return 0
    [ -e "$RUNS/.pipe-done" ] && [ "$(last_step)" -le "$seen" ] && return 0
    sleep 0.2
  done
}

rl_start=$(now)
if [ "$(last_step)" -ge "$ROUNDS" ]; then
  echo "ckpts: $CKPTS already holds $ROUNDS steps with these knobs; skipping the pipe" >&2
  rl_secs=0
else
  rm -f "$RUNS/.pipe-done"
  watcher=
  if [ "$EVAL_LIVE" = 1 ]; then
    watch_evals &
    watcher=$!
  fi
  # batch b samples the prompts `rollout --seed SEED*1000+b+1` does: round i of rlvr.sh
  timed rollout rlkit rollout --follow "$CKPTS" --policy "$RUNS/sft" --task "$TASK" --batch-prompts "$PROMPTS" --n "$N" \
      --max-new-tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE" --seed "$((SEED * 1000))" --max-lag "$LAG" \
      --max-steps "$ROUNDS" --engine "$ENGINE" \
    | timed score-ref rlkit score-ref --ref "$RUNS/ref" \
    | timed update rlkit update --follow --policy "$RUNS/sft" --out "$CKPTS" --max-steps "$ROUNDS" --max-lag "$LAG" \
        --algo "$ALGO" --lr "$LR" --epochs "$EPOCHS" --minibatch-size "$MINIBATCH" --beta "$BETA" --kl-estimator "$KL" \
        --dual-clip "$DUAL_CLIP" --seed "$SEED" "${drop_flag[@]}" --metrics "$RUNS/metrics.jsonl"
  rl_secs=$(awk -v a="$rl_start" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}')
  touch "$RUNS/.pipe-done"
  [ -n "$watcher" ] && wait "$watcher"
fi
for i in $(seq 1 "$ROUNDS"); do
  [ "$EVAL_LIVE" = 1 ] && [ "$i" -lt "$ROUNDS" ] && continue  # live mode evaluated what it saw; the last always
  eval_step "$i"
done
cp "$RUNS/eval-step-$ROUNDS.json" "$RUNS/eval-final.json"
rlkit report "$RUNS/metrics.jsonl" --title "RLVR (follow, lag $LAG): $TASK" --out "$RUNS/report.png"

summary "$RUNS" "$rl_secs" "$ROUNDS" "$LAG" <<'PY'
runs, rl_secs, n_rounds, lag = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
times = wall_times(runs)
before, after = accuracy_table(runs, f"after RL ({n_rounds} steps)")
note = " (the run was complete; skipped)" if rl_secs == 0 else ""
print(f"{gain(before, after)}; RL phase wall time {rl_secs:.1f}s{note} "
      f"(one persistent pipe, lag bound {lag}; held-out evals not counted)\n")
if rl_secs:
    print(f"{'process':10}{'wall s':>8}   (they overlap in the pipe)")
    for k in ("rollout", "score-ref", "update"):
        print(f"{k:10}{times[k]:>8.1f}")
    steps_line(runs, n_rounds)
PY
