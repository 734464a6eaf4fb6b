#!/usr/bin/env bash
# RLAIF on the embedded tiny model: an LLM judge, not a verifier or human labels, is the reward source.
#   sft (policy) -> sft (judge, on generated judgments of arithmetic under two rubrics) -> build-prefs --judge
#   -> train-rm -> ROUNDS x (rollout | score-ref --rm --judge | update --reward rm:rm=1; eval) -> report.
# The task's verifier only measures: held-out accuracy before and after, beside the judge's own agreement with
# the verifier and, every round, the reward model's score, the judge's direct score and the verifier's accuracy
# ($RUNS/metrics.jsonl, $RUNS/report.png), so a policy that pleases the judge without being right shows.
# Knobs (environment), defaults in brackets:
#   RUNS [runs/rlaif]  SEED [0]  SFT_EXAMPLES [24000]  EVAL_NUM [300]
#   JUDGE [] a judge checkpoint to use as it is; empty: one is trained: its own SFT run on arithmetic (seed
#     SEED+1, so not the policy), then JUDGE_EXAMPLES [72000] judgments at JUDGE_LR [3e-4]
#   PAIRWISE [recipes/rubrics/arithmetic-pairwise.toml]  YESNO [recipes/rubrics/arithmetic-yes-no.toml]
#   PREF_PROMPTS [4096] prompts for judged pairs  PREF_N [4]  RM_EPOCHS [2]
#   ROUNDS [3]  PROMPTS [512]  N [8]  MAX_NEW_TOKENS [16]  ALGO [grpo]  LR [5e-5]  EPOCHS [2]  BETA [0.01]
#   REWARD [rm:rm=1] update --reward weights: the judge-trained reward model; "judge=1" trains on the judge's
#     direct yes-probability instead
# A rerun skips every stage and round that is up to date with its inputs and settings.
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

HERE=$(cd "$(dirname "$0")" && pwd)
defaults RUNS=runs/rlaif SEED=0 SFT_EXAMPLES=24000 JUDGE_EXAMPLES=72000 JUDGE_LR=3e-4 EVAL_NUM=300
defaults PAIRWISE="$HERE/rubrics/arithmetic-pairwise.toml" YESNO="$HERE/rubrics/arithmetic-yes-no.toml"
defaults PREF_PROMPTS=4096 PREF_N=4 RM_EPOCHS=2 ROUNDS=3 PROMPTS=512 N=8 MAX_NEW_TOKENS=16 ALGO=grpo LR=5e-5 EPOCHS=2
defaults BETA=0.01 REWARD=rm:rm=1
reward_flags=()
for w in $REWARD; do reward_flags+=(--reward "$w"); done

mkdir -p "$RUNS"
METRICS="$RUNS/metrics.jsonl"
rlkit sft --task arithmetic --num-examples "$SFT_EXAMPLES" --eval-num "$EVAL_NUM" --seed "$SEED" --out "$RUNS/sft"
rlkit freeze-ref --policy "$RUNS/sft" --out "$RUNS/ref" --dtype bf16
# the judge: an SFT run of its own on arithmetic (another seed: not the policy), then trained on judgments (a
# proposed answer, the gold one or a near miss; the verdict each rubric asks for); its held-out evaluations are
# its agreement with the verifier
if [ -z "${JUDGE:-}" ]; then
  rlkit sft --task arithmetic --num-examples "$SFT_EXAMPLES" --eval-num "$EVAL_NUM" --seed "$((SEED + 1))" \
    --out "$RUNS/judge-base"
  rlkit sft --model "$RUNS/judge-base" --task "judge:task=arithmetic,rubric=$PAIRWISE|$YESNO" \
    --num-examples "$JUDGE_EXAMPLES" --lr "$JUDGE_LR" --eval-num "$EVAL_NUM" --seed "$((SEED + 1))" --out "$RUNS/judge"
  JUDGE="$RUNS/judge"
fi
for r in pairwise yes-no; do
  rubric=$PAIRWISE
  [ "$r" = yes-no ] && rubric=$YESNO
  rlkit eval --policy "$JUDGE" --task "judge:task=arithmetic,rubric=$rubric" --num-prompts "$EVAL_NUM" --json \
    > "$RUNS/judge-eval-$r.json"
done
rlkit build-prefs --policy "$RUNS/sft" --judge "$JUDGE" --rubric "$PAIRWISE" --num-prompts "$PREF_PROMPTS" \
  --n "$PREF_N" --seed "$SEED" --out "$RUNS/prefs.arrow"
rlkit train-rm --model "$RUNS/sft" --prefs "$RUNS/prefs.arrow" --epochs "$RM_EPOCHS" --seed "$SEED" --out "$RUNS/rm"
rlkit eval --policy "$RUNS/sft" --task arithmetic --num-prompts "$EVAL_NUM" --max-new-tokens "$MAX_NEW_TOKENS" --label sft \
  --json --metrics "$METRICS" > "$RUNS/eval-sft.json"

knobs="judge=$JUDGE prompts=$PROMPTS n=$N max_new=$MAX_NEW_TOKENS algo=$ALGO lr=$LR epochs=$EPOCHS beta=$BETA reward=$REWARD seed=$SEED"
# one round: rollout | score-ref --rm --judge | update into $out
judged_round() {
  rm -f "$RUNS/eval-round-$i.json"
  rlkit rollout --policy "$policy" --task arithmetic --num-prompts "$PROMPTS" --n "$N" --max-new-tokens "$MAX_NEW_TOKENS" \
      --seed "$((SEED * 1000 + i))" \
    | rlkit score-ref --ref "$RUNS/ref" --rm "rm=$RUNS/rm" --judge "judge=$JUDGE:rubric=$YESNO" \
    | rlkit update --algo "$ALGO" --policy "$policy" --out "$out" --lr "$LR" --epochs "$EPOCHS" --beta "$BETA" \
        "${reward_flags[@]}" --seed "$SEED" --metrics "$METRICS"
}
policy="$RUNS/sft"
for i in $(seq 1 "$ROUNDS"); do
  out="$RUNS/round-$i"
  round "round $i" "$out" judged_round
  policy="$out"
  if [ ! -s "$RUNS/eval-round-$i.json" ]; then
    into "$RUNS/eval-round-$i.json" rlkit eval --policy "$out" --task arithmetic --num-prompts "$EVAL_NUM" \
      --max-new-tokens "$MAX_NEW_TOKENS" --label "round-$i" --json --metrics "$METRICS"
  fi
done
rlkit report "$METRICS" --title "RLAIF: a judge-trained reward (arithmetic)" --out "$RUNS/report.png"

summary "$RUNS" "$ROUNDS" <<'PY'
import pyarrow as pa

runs, rounds = sys.argv[1], int(sys.argv[2])
load = lambda name: json.load(open(f"{runs}/{name}"))  # noqa: E731
with pa.OSFile(f"{runs}/prefs.arrow") as f:
    judged = json.loads(pa.ipc.open_stream(f).schema.metadata[b"rlkit"])["judge"]
rm = load("rm/rlkit.json")["metrics"]
print("\nthe judge's agreement with the verifier on held-out problems: "
      f"pairwise {load('judge-eval-pairwise.json')['accuracy']:.1%}, yes-no {load('judge-eval-yes-no.json')['accuracy']:.1%}")
agree = judged["verifier_agreement"]
print(f"judged pairs: {judged['pairs_kept']} of {judged['pairs_judged']} kept ({judged['ties']} ties), agreeing with the "
      f"verifier on {'-' if agree is None else f'{agree:.1%}'} of the {judged['verifier_decided']} it tells apart; "
      f"reward model held-out pair accuracy {rm['heldout_pair_accuracy']:.1%}")
updates = [json.loads(x) for x in open(f"{runs}/metrics.jsonl") if '"stage": "update"' in x]
print(f"\n{'':16}{'held-out accuracy':>18}{'reward/rm:rm':>14}{'reward/judge':>14}{'verifier (train)':>18}")
print(f"{'SFT checkpoint':16}{load('eval-sft.json')['accuracy']:>18.1%}")
for i in range(1, rounds + 1):
    u = updates[i - 1] if i - 1 < len(updates) else {}
    print(f"{'round ' + str(i):16}{load(f'eval-round-{i}.json')['accuracy']:>18.1%}{u.get('reward/rm:rm', float('nan')):>14.4f}"
          f"{u.get('reward/judge', float('nan')):>14.4f}{u.get('verifier_accuracy', float('nan')):>18.1%}")
PY
