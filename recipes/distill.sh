#!/usr/bin/env bash
# On-policy distillation on the embedded tiny model: the SFT checkpoint (the student) samples, a stronger
# teacher scores every sampled token (score-ref --teacher), and `update --algo distill` descends the reverse KL
# to the teacher on the student's own samples; held-out accuracy after every round, beside the teacher's.
# Without TEACHER the teacher is made first: recipes/rlvr.sh's RL rounds from the same SFT checkpoint.
# Knobs (environment), defaults in brackets:
#   RUNS [runs/distill]  SEED [0]  TASK [arithmetic]  EVAL_NUM [300]  MAX_NEW_TOKENS [16]
#   TEACHER [] a teacher checkpoint (same tokenizer as STUDENT); empty: $RUNS/teacher/round-$TEACHER_ROUNDS
#   STUDENT [] the SFT checkpoint to distil into; empty: the one recipes/rlvr.sh makes under $RUNS/teacher
#   TEACHER_ROUNDS [3]  SFT_EXAMPLES [24000] (rlvr.sh's, when it makes the teacher)
#   ROUNDS [3]  PROMPTS [512] prompts per round  N [1] samples per prompt (no group baseline is needed)
#   COEF [1] --teacher-coef  LR [5e-5]  EPOCHS [2]  MINIBATCH [128]  TEMPERATURE [1.0]
# A rerun skips every stage whose output is up to date with its inputs and settings.
set -euo pipefail

RUNS=${RUNS:-runs/distill}
SEED=${SEED:-0}
TASK=${TASK:-arithmetic}
EVAL_NUM=${EVAL_NUM:-300}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-16}
TEACHER_ROUNDS=${TEACHER_ROUNDS:-3}
ROUNDS=${ROUNDS:-3}
PROMPTS=${PROMPTS:-512}
N=${N:-1}
COEF=${COEF:-1}
LR=${LR:-5e-5}
EPOCHS=${EPOCHS:-2}
MINIBATCH=${MINIBATCH:-128}
TEMPERATURE=${TEMPERATURE:-1.0}
HERE=$(cd "$(dirname "$0")" && pwd)

mkdir -p "$RUNS"
if [ -z "${TEACHER:-}" ]; then
  # the teacher: RL from the verifier, TEACHER_ROUNDS rounds of recipes/rlvr.sh (its figures in $RUNS/teacher)
  RUNS="$RUNS/teacher" SEED="$SEED" TASK="$TASK" EVAL_NUM="$EVAL_NUM" ROUNDS="$TEACHER_ROUNDS" \
    MAX_NEW_TOKENS="$MAX_NEW_TOKENS" SFT_EXAMPLES="${SFT_EXAMPLES:-24000}" bash "$HERE/rlvr.sh" >&2
  TEACHER="$RUNS/teacher/round-$TEACHER_ROUNDS"
  STUDENT=${STUDENT:-$RUNS/teacher/sft}
fi
if [ -z "${STUDENT:-}" ]; then
  echo "distill.sh: with TEACHER given, name the SFT checkpoint to distil into: STUDENT=DIR" >&2
  exit 2
fi

evaluate() {  # evaluate POLICY LABEL: held-out accuracy into $RUNS/eval-LABEL.json (kept while up to date)
  local out="$RUNS/eval-$2.json"
  if [ ! -s "$out" ] || [ "$1" -nt "$out" ]; then
    rlkit eval --policy "$1" --task "$TASK" --num-prompts "$EVAL_NUM" --max-new-tokens "$MAX_NEW_TOKENS" --label "$2" \
      --json --metrics "$RUNS/metrics.jsonl" > "$out.tmp"
    mv "$out.tmp" "$out"
  fi
}
evaluate "$STUDENT" student
evaluate "$TEACHER" teacher

knobs="student=$STUDENT teacher=$TEACHER task=$TASK prompts=$PROMPTS n=$N max_new=$MAX_NEW_TOKENS coef=$COEF lr=$LR epochs=$EPOCHS mb=$MINIBATCH temp=$TEMPERATURE seed=$SEED"
policy="$STUDENT"
for i in $(seq 1 "$ROUNDS"); do
  out="$RUNS/round-$i"
  if [ "$(cat "$out.knobs" 2>/dev/null)" = "$knobs" ] && rlkit inspect "$out" --check 2>/dev/null; then
    echo "round $i: $out is up to date; skipping" >&2
  else
    rm -f "$out.knobs"
    rlkit rollout --policy "$policy" --task "$TASK" --num-prompts "$PROMPTS" --n "$N" --max-new-tokens "$MAX_NEW_TOKENS" \
        --temperature "$TEMPERATURE" --seed "$((SEED * 1000 + i))" \
      | rlkit score-ref --teacher "$TEACHER" \
      | rlkit update --policy "$policy" --out "$out" --algo distill --teacher-coef "$COEF" --lr "$LR" \
          --epochs "$EPOCHS" --minibatch-size "$MINIBATCH" --seed "$SEED" --metrics "$RUNS/metrics.jsonl"
    echo "$knobs" > "$out.knobs"
  fi
  policy="$out"
  evaluate "$out" "round-$i"
done

python3 - "$RUNS" "$ROUNDS" "$((PROMPTS * N))" <<'PY'
import json, sys
runs, rounds, per_round = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
acc = lambda label: json.load(open(f"{runs}/eval-{label}.json"))["accuracy"]
kl = {}
for line in open(f"{runs}/metrics.jsonl"):
    row = json.loads(line)
    if row.get("stage") == "update" and "teacher_kl" in row:
        kl[row["out"]] = row["teacher_kl"]
student, teacher = acc("student"), acc("teacher")
print(f"\n{'':22}{'samples':>9}{'held-out accuracy':>19}{'teacher_kl':>12}{'share of the gap closed':>25}")
print(f"{'student (SFT)':22}{0:>9}{student:>19.1%}{'':>12}{'':>25}")
for i in range(1, rounds + 1):
    a = acc(f"round-{i}")
    closed = (a - student) / (teacher - student) if teacher != student else float("nan")
    k = kl.get(f"{runs}/round-{i}")
    print(f"{'distilled, round ' + str(i):22}{i * per_round:>9}{a:>19.1%}{'' if k is None else f'{k:.4f}':>12}{closed:>25.0%}")
print(f"{'teacher':22}{'':>9}{teacher:>19.1%}")
PY
