#!/usr/bin/env bash
# RLHF on the embedded tiny model: sft -> build-prefs -> train-rm -> freeze-ref
#   -> ROUNDS x (rollout | score-ref --ref --rm | update --algo ppo; eval) -> report.
# $RUNS/rlhf-metrics.jsonl gets every update's and every held-out eval's figures; $RUNS/report.png plots them.
# The reward is the reward model's score alone (REWARD), the task's verifier only measures: held-out
# accuracy before and after shows whether optimising the learned reward helped or hurt the task.
# Knobs (environment), defaults in brackets:
#   RUNS [runs/rlhf]  SEED [0]  TASK [arithmetic]  SFT_EXAMPLES [24000]  EVAL_NUM [1000]
#   PREF_PROMPTS [24 x PROMPTS, at least 64] prompts for preference pairs (~4.7 pairs each)  PREF_N [4]  RM_EPOCHS [2]
#     PPO only helps when the reward model judges answers better than the policy writes them. With a quarter
#     of these pairs (or, on some seeds, one epoch) the reward model ranked the right sum first among
#     gold-3..gold+3 no more often than the SFT policy wrote it, and PPO lowered held-out accuracy
#     (docs/rlhf.md; benchmarks/rlhf_recipe.py measures both).
#   ROUNDS [3]  PROMPTS [512] prompts per round  N [4] samples per prompt  MAX_NEW_TOKENS [16]
#   LR [5e-5]  EPOCHS [1]  MINIBATCH [128]  BETA [0.05] KL coefficient (in the reward)  TARGET_KL [] adaptive
#   REWARD [rm:rm=1] update --reward weights (e.g. "rm:rm=1 verifier=1")
#   CRITIC_INIT [rm] the value model starts as the reward model (InstructGPT), or "policy" (a zero value head)
# A rerun skips every stage and round that is up to date with its inputs and settings.
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

defaults RUNS=runs/rlhf SEED=0 TASK=arithmetic SFT_EXAMPLES=24000 EVAL_NUM=1000 ROUNDS=3 PROMPTS=512 N=4
defaults PREF_PROMPTS=$(( PROMPTS * 24 < 64 ? 64 : PROMPTS * 24 )) PREF_N=4 RM_EPOCHS=2 MAX_NEW_TOKENS=16 LR=5e-5 EPOCHS=1
defaults MINIBATCH=128 BETA=0.05 TARGET_KL= REWARD=rm:rm=1 CRITIC_INIT=rm
critic_init=$CRITIC_INIT
[ "$CRITIC_INIT" = rm ] && critic_init="$RUNS/rm"
reward_flags=()
for w in $REWARD; do reward_flags+=(--reward "$w"); done
kl_flags=()
[ -n "$TARGET_KL" ] && kl_flags=(--target-kl "$TARGET_KL")

mkdir -p "$RUNS"
METRICS="$RUNS/rlhf-metrics.jsonl"

rlkit sft --task "$TASK" --num-examples "$SFT_EXAMPLES" --eval-num "$EVAL_NUM" --seed "$SEED" --out "$RUNS/sft"
rlkit build-prefs --policy "$RUNS/sft" --task "$TASK" --num-prompts "$PREF_PROMPTS" --n "$PREF_N" --seed "$SEED" \
  --out "$RUNS/prefs.arrow"
rlkit train-rm --model "$RUNS/sft" --prefs "$RUNS/prefs.arrow" --epochs "$RM_EPOCHS" --seed "$SEED" --out "$RUNS/rm"
rlkit freeze-ref --policy "$RUNS/sft" --out "$RUNS/ref" --dtype bf16
rlkit eval --policy "$RUNS/sft" --task "$TASK" --num-prompts "$EVAL_NUM" --rm "$RUNS/rm" --label sft --json \
  --metrics "$METRICS" > "$RUNS/rlhf-eval-sft.json"

knobs="task=$TASK prompts=$PROMPTS n=$N max_new=$MAX_NEW_TOKENS lr=$LR epochs=$EPOCHS mb=$MINIBATCH beta=$BETA target_kl=$TARGET_KL reward=$REWARD critic=$CRITIC_INIT seed=$SEED"
# one round: rollout | score-ref --rm | update --algo ppo into $out; its held-out eval to be redone
ppo_round() {
  rlkit rollout --policy "$policy" --task "$TASK" --num-prompts "$PROMPTS" --n "$N" --max-new-tokens "$MAX_NEW_TOKENS" \
      --seed "$((SEED * 1000 + i))" \
    | rlkit score-ref --ref "$RUNS/ref" --rm "rm=$RUNS/rm" \
    | rlkit update --algo ppo --policy "$policy" --out "$out" --lr "$LR" --epochs "$EPOCHS" \
        --minibatch-size "$MINIBATCH" --beta "$BETA" "${kl_flags[@]}" "${reward_flags[@]}" --seed "$SEED" \
        --critic-init "$critic_init" \
        --metrics "$METRICS"
  rm -f "$RUNS/rlhf-eval-round-$i.json"
}
policy="$RUNS/sft"
for i in $(seq 1 "$ROUNDS"); do
  out="$RUNS/ppo-round-$i"
  round "round $i" "$out" ppo_round
  policy="$out"
  if [ ! -s "$RUNS/rlhf-eval-round-$i.json" ]; then  # held-out accuracy and RM score after every round
    into "$RUNS/rlhf-eval-round-$i.json" rlkit eval --policy "$out" --task "$TASK" --num-prompts "$EVAL_NUM" \
      --rm "$RUNS/rm" --label "ppo-round-$i" --json --metrics "$METRICS"
  fi
done
cp "$RUNS/rlhf-eval-round-$ROUNDS.json" "$RUNS/rlhf-eval-final.json"
rlkit report "$METRICS" --title "RLHF: PPO on a learned reward ($TASK)" --out "$RUNS/report.png"

summary "$RUNS" "$ROUNDS" <<'PY'
runs, rounds = sys.argv[1], sys.argv[2]
rm = json.load(open(f"{runs}/rm/rlkit.json"))
before = json.load(open(f"{runs}/rlhf-eval-sft.json"))
after = json.load(open(f"{runs}/rlhf-eval-final.json"))
m, s = rm["metrics"], rm["sanity"]
print(f"\nreward model: held-out pair accuracy {m['heldout_pair_accuracy']:.1%} over {m['heldout_pairs']} pairs; "
      f"score-length correlation {s['length_correlation']:+.2f}")
print(f"\n{'':26}{'held-out accuracy':>18}{'mean RM score':>15}{'mean tokens':>13}")
for name, e in (("SFT checkpoint", before), (f"after PPO ({rounds} rounds)", after)):
    print(f"{name:26}{e['accuracy']:>18.1%}{e['rm_score_mean']:>15.4f}{e['mean_response_tokens']:>13.2f}")
d = 100 * (after["accuracy"] - before["accuracy"])
print(f"task accuracy {d:+.1f} points; reward-model score {after['rm_score_mean'] - before['rm_score_mean']:+.4f}")
PY
