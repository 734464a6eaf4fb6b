#!/usr/bin/env bash
# On-policy distillation on the embedded tiny model: the SFT checkpoint (the student) samples, a stronger
# teacher scores every sampled token (score-ref --teacher), and `update --algo distill` descends the reverse KL
# to the teacher on the student's own samples. Held-out accuracy after every round, greedy and sampled (T=1),
# beside the teacher's and, when this recipe made the teacher, beside RL from the verifier at the same samples.
# Without TEACHER the teacher is made first: recipes/rlvr.sh's RL rounds from the same SFT checkpoint.
# Knobs (environment), defaults in brackets:
#   RUNS [runs/distill]  SEED [0]  TASK [arithmetic]  EVAL_NUM [300]  MAX_NEW_TOKENS [16]
#   TEACHER [] a teacher checkpoint (same tokenizer as STUDENT); empty: $RUNS/teacher/round-$TEACHER_ROUNDS
#   STUDENT [] the SFT checkpoint to distil into; empty: the one recipes/rlvr.sh makes under $RUNS/teacher
#   TEACHER_ROUNDS [3]  TEACHER_PROMPTS [512]  TEACHER_N [8]  SFT_EXAMPLES [24000] (rlvr.sh's, making the teacher)
#   ROUNDS [3]  PROMPTS [512] prompts per round  N [8] samples per prompt (distill needs no group: 1 works)
#   COEF [1] --teacher-coef  LR [5e-5]  EPOCHS [2]  MINIBATCH [128]  TEMPERATURE [1.0]
#   SAMPLED_N [8] samples per held-out prompt for the sampled accuracy (0: greedy only)
# A rerun skips every stage whose output is up to date with its inputs and settings.
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

defaults RUNS=runs/distill SEED=0 TASK=arithmetic EVAL_NUM=300 MAX_NEW_TOKENS=16 TEACHER_ROUNDS=3 TEACHER_PROMPTS=512
defaults TEACHER_N=8 ROUNDS=3 PROMPTS=512 N=8 COEF=1 LR=5e-5 EPOCHS=2 MINIBATCH=128 TEMPERATURE=1.0 SAMPLED_N=8
HERE=$(cd "$(dirname "$0")" && pwd)

mkdir -p "$RUNS"
made_teacher=0
if [ -z "${TEACHER:-}" ]; then
  # the teacher: RL from the verifier, TEACHER_ROUNDS rounds of recipes/rlvr.sh (its own figures in $RUNS/teacher)
  RUNS="$RUNS/teacher" SEED="$SEED" TASK="$TASK" EVAL_NUM="$EVAL_NUM" ROUNDS="$TEACHER_ROUNDS" \
    PROMPTS="$TEACHER_PROMPTS" N="$TEACHER_N" MAX_NEW_TOKENS="$MAX_NEW_TOKENS" SFT_EXAMPLES="${SFT_EXAMPLES:-24000}" \
    LR="$LR" EPOCHS="$EPOCHS" MINIBATCH="$MINIBATCH" TEMPERATURE="$TEMPERATURE" bash "$HERE/rlvr.sh" >&2
  TEACHER="$RUNS/teacher/round-$TEACHER_ROUNDS"
  STUDENT=${STUDENT:-$RUNS/teacher/sft}
  made_teacher=1
fi
if [ -z "${STUDENT:-}" ]; then
  echo "distill.sh: with TEACHER given, name the SFT checkpoint to distil into: STUDENT=DIR" >&2
  exit 2
fi

heldout="$RUNS/heldout.arrow"
[ "$SAMPLED_N" -gt 0 ] && rlkit prompts --task "$TASK" --split heldout --num-prompts "$EVAL_NUM" --seed "$SEED" --out "$heldout"
evaluate() {  # evaluate POLICY LABEL: greedy held-out accuracy into $RUNS/eval-LABEL.json, sampled into sampled-LABEL.arrow
  local out="$RUNS/eval-$2.json"
  if [ ! -s "$out" ] || [ "$1" -nt "$out" ]; then
    into "$out" rlkit eval --policy "$1" --task "$TASK" --num-prompts "$EVAL_NUM" --max-new-tokens "$MAX_NEW_TOKENS" \
      --label "$2" --json --metrics "$RUNS/metrics.jsonl"
  fi
  if [ "$SAMPLED_N" -gt 0 ]; then
    rlkit rollout --policy "$1" --task "$TASK" --prompts "$heldout" --n "$SAMPLED_N" --max-new-tokens "$MAX_NEW_TOKENS" \
      --temperature "$TEMPERATURE" --seed "$SEED" --out "$RUNS/sampled-$2.arrow"
  fi
}
evaluate "$STUDENT" student
evaluate "$TEACHER" teacher
if [ "$made_teacher" = 1 ]; then
  for i in $(seq 1 "$TEACHER_ROUNDS"); do evaluate "$RUNS/teacher/round-$i" "rl-round-$i"; done
fi

knobs="student=$STUDENT teacher=$TEACHER task=$TASK prompts=$PROMPTS n=$N max_new=$MAX_NEW_TOKENS coef=$COEF lr=$LR epochs=$EPOCHS mb=$MINIBATCH temp=$TEMPERATURE seed=$SEED"
# one round: rollout | score-ref --teacher | update --algo distill into $out
distill_round() {
  rlkit rollout --policy "$policy" --task "$TASK" --num-prompts "$PROMPTS" --n "$N" --max-new-tokens "$MAX_NEW_TOKENS" \
      --temperature "$TEMPERATURE" --seed "$((SEED * 1000 + i))" \
    | rlkit score-ref --teacher "$TEACHER" \
    | rlkit update --policy "$policy" --out "$out" --algo distill --teacher-coef "$COEF" --lr "$LR" \
        --epochs "$EPOCHS" --minibatch-size "$MINIBATCH" --seed "$SEED" --metrics "$RUNS/metrics.jsonl"
}
policy="$STUDENT"
for i in $(seq 1 "$ROUNDS"); do
  out="$RUNS/round-$i"
  round "round $i" "$out" distill_round
  policy="$out"
  evaluate "$out" "round-$i"
done

summary "$RUNS" "$ROUNDS" "$((PROMPTS * N))" "$made_teacher" "$TEACHER_ROUNDS" "$((TEACHER_PROMPTS * TEACHER_N))" <<'PY'
import pyarrow as pa

runs, rounds, per_round, made, t_rounds, t_per_round = sys.argv[1], *map(int, sys.argv[2:])


def greedy(label):
    return json.load(open(f"{runs}/eval-{label}.json"))["accuracy"]


def sampled(label):
    path = f"{runs}/sampled-{label}.arrow"
    if not os.path.exists(path):
        return None
    with pa.OSFile(path) as f:
        v = pa.ipc.open_stream(f).read_all().column("reward/verifier").to_pylist()
    return sum(v) / len(v)


kl = {}
for line in open(f"{runs}/metrics.jsonl"):
    row = json.loads(line)
    if row.get("stage") == "update" and "teacher_kl" in row:
        kl[os.path.basename(row["out"])] = row["teacher_kl"]
fmt = lambda x: "" if x is None else f"{x:.1%}"  # noqa: E731
print(f"\n{'':28}{'samples':>9}{'greedy held-out':>17}{'sampled held-out':>18}{'teacher_kl':>12}")
print(f"{'student (SFT)':28}{0:>9}{greedy('student'):>17.1%}{fmt(sampled('student')):>18}")
for i in range(1, rounds + 1):
    k = kl.get(f"round-{i}")
    print(f"{'distilled, round ' + str(i):28}{i * per_round:>9}{greedy(f'round-{i}'):>17.1%}"
          f"{fmt(sampled(f'round-{i}')):>18}{'' if k is None else f'{k:.4f}':>12}")
if made:
    for i in range(1, t_rounds + 1):
        print(f"{'RL from the verifier, round ' + str(i):28}{i * t_per_round:>9}{greedy(f'rl-round-{i}'):>17.1%}"
              f"{fmt(sampled(f'rl-round-{i}')):>18}")
print(f"{'teacher':28}{'':>9}{greedy('teacher'):>17.1%}{fmt(sampled('teacher')):>18}")
s0, st, sl = sampled("student"), sampled("teacher"), sampled(f"round-{rounds}")
if None not in (s0, st, sl) and st != s0:
    print(f"distillation closed {(sl - s0) / (st - s0):.0%} of the student-teacher gap in sampled held-out accuracy "
          f"({rounds} rounds, {rounds * per_round} samples)")
PY
