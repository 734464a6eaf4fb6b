#!/usr/bin/env bash
# Tool use on the embedded tiny model (the `calc` environment): products like <37*48>= that it cannot compute in
# its head, with a `mul` tool that can. sft on calc transcripts: a TOOL share of them call the tool
# (<call>mul(37,48)</call><tool>1776</tool>1776), the rest answer without it (The product is 1776.), so the SFT
# model samples tool calls but, greedy, answers in its head, and is wrong -> freeze-ref -> eval -> ROUNDS x
# (rollout --env calc | score-ref | update; eval). Each rollout row is a whole trajectory: the model's call
# (trained on), the tool's result (loss_mask 0: appended by the environment, never trained on), the model's
# answer; the reward is 1 when the answer's last integer is the product. RL moves the model to the tool.
# Prints held-out accuracy and tool calls per answer before and after RL; $RUNS/metrics.jsonl gets every
# update's and every held-out eval's figures, and `rlkit report` plots them.
# Knobs (environment), defaults in brackets:
#   RUNS [runs/tools]  SEED [0]  MODEL [tiny] (sft's base)  DIGITS [2] digits of each factor
#   TOOL [0.4] share of SFT transcripts that call the tool  SANDBOX [] bwrap: each tool call runs in a bubblewrap sandbox
#   SFT_EXAMPLES [20000]  EVAL_NUM [200]  ROUNDS [3]  PROMPTS [128] prompts per round  N [8] trajectories per prompt
#   ALGO [grpo]  LR [1e-4]  EPOCHS [2]  MINIBATCH [128]  BETA [0.01]  KL [k3+]  TEMPERATURE [1.0]  MAX_TURNS [4]
# A rerun skips every stage whose output is up to date with its inputs and settings.
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

defaults RUNS=runs/tools SEED=0 MODEL=tiny DIGITS=2 TOOL=0.4 SFT_EXAMPLES=20000 EVAL_NUM=200 ROUNDS=3 PROMPTS=128 N=8
defaults ALGO=grpo LR=1e-4 EPOCHS=2 MINIBATCH=128 BETA=0.01 KL=k3+ TEMPERATURE=1.0 MAX_TURNS=4
TASK="calc:digits=$DIGITS,tool=$TOOL"  # the SFT transcripts
ENV="calc:digits=$DIGITS"  # the same problems, the same held-out split
env_opts=(--env "$ENV" --max-turns "$MAX_TURNS")
[ -n "${SANDBOX:-}" ] && env_opts+=(--sandbox "$SANDBOX")  # where rollout's and eval's tool calls run

mkdir -p "$RUNS"
start_times
# evaluate POLICY LABEL: greedy trajectories on EVAL_NUM held-out problems -> $RUNS/eval-LABEL.json
evaluate() {
  into "$RUNS/eval-$2.json" rlkit eval --policy "$1" "${env_opts[@]}" --num-prompts "$EVAL_NUM" --label "$2" --json \
    --metrics "$RUNS/metrics.jsonl"
}

# sft's own held-out figure is single-turn (the model writes the tool's result itself, so ~0%); the evals below
# run trajectories against the environment
timed sft rlkit sft --model "$MODEL" --task "$TASK" --num-examples "$SFT_EXAMPLES" --eval-num 20 --seed "$SEED" \
  --out "$RUNS/sft"
timed freeze-ref rlkit freeze-ref --policy "$RUNS/sft" --out "$RUNS/ref" --dtype bf16
evaluate "$RUNS/sft" sft

knobs="env=$ENV sandbox=${SANDBOX:-} prompts=$PROMPTS n=$N algo=$ALGO lr=$LR epochs=$EPOCHS mb=$MINIBATCH beta=$BETA kl=$KL temp=$TEMPERATURE turns=$MAX_TURNS seed=$SEED"
policy="$RUNS/sft"
rl_start=$(now)
# one round: rollout --env | score-ref | update into $out, timed; its held-out eval to be redone
tool_round() {
  local t0
  rm -f "$RUNS/eval-round-$i.json"
  t0=$(now)
  timed "round-$i:rollout" rlkit rollout --policy "$policy" "${env_opts[@]}" --num-prompts "$PROMPTS" --n "$N" \
      --temperature "$TEMPERATURE" --seed "$((SEED * 1000 + i))" \
    | timed "round-$i:score-ref" rlkit score-ref --ref "$RUNS/ref" \
    | timed "round-$i:update" rlkit update --policy "$policy" --out "$out" --algo "$ALGO" --lr "$LR" \
        --epochs "$EPOCHS" --minibatch-size "$MINIBATCH" --beta "$BETA" --kl-estimator "$KL" --seed "$SEED" \
        --metrics "$RUNS/metrics.jsonl"
  log_time "round-$i" "$t0"
}
for i in $(seq 1 "$ROUNDS"); do
  out="$RUNS/round-$i"
  round "round $i" "$out" tool_round
  policy="$out"
  t0=$(now)
  [ -s "$RUNS/eval-round-$i.json" ] || evaluate "$out" "round-$i"
  eval_secs=$(awk -v e="${eval_secs:-0}" -v a="$t0" -v b="$(now)" 'BEGIN{printf "%.2f", e+b-a}')
done
rl_secs=$(awk -v a="$rl_start" -v b="$(now)" -v e="${eval_secs:-0}" 'BEGIN{printf "%.1f", b-a-e}')
rlkit report "$RUNS/metrics.jsonl" --title "Tool use: $ENV" --out "$RUNS/report.png"

summary "$RUNS" "$rl_secs" "$ROUNDS" <<'PY'
runs, rl_secs, n_rounds = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
before = json.load(open(f"{runs}/eval-sft.json"))
after = json.load(open(f"{runs}/eval-round-{n_rounds}.json"))
print(f"\n{'':24}{'held-out accuracy':>18}{'tool calls/answer':>19}")
for label, r in (("SFT checkpoint", before), (f"after RL ({n_rounds} rounds)", after)):
    print(f"{label:24}{r['mean_reward']:>18.1%}{r['mean_tool_calls']:>19.2f}")  # calc's reward: 1 right, 0 wrong
print(f"gain: {100 * (after['mean_reward'] - before['mean_reward']):+.1f} points; RL phase wall time {rl_secs:.1f}s "
      "(held-out evals not counted)\n")
PY
