#!/usr/bin/env bash
# RLVR on math word problems (the `math` task): sft on the data's train split -> freeze-ref -> eval ->
# ROUNDS x (rollout | score-ref | update; eval on the held-out questions) -> report. It is recipes/rlvr.sh
# with the math task and its defaults, so every rlvr.sh knob works here too (ALGO, LR, BETA, SEED, ...).
# On the embedded tiny model (a 0.8M-parameter character-level model trained for seconds) held-out accuracy
# stays near zero: the recipe shows that the whole path works. Swap in your model and data, e.g.
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct DATA=openai/gsm8k:main@train MAX_NEW_TOKENS=256 bash recipes/math.sh
# Knobs (environment), defaults in brackets, besides rlvr.sh's:
#   MODEL [tiny]  DATA [the ~50 problems shipped in rlkit/tasks/data_files/math_sample.jsonl]: .jsonl/.parquet or datasets spec
#   QUESTION [question] ANSWER [answer] its columns (answers: "... #### 42", a \boxed{} solution, or bare)
#   SOLUTION [] a separate solution column for SFT targets  TEST [] a held-out file instead of the hash split
#   VERIFIER [math-verify] or last-integer   RUNS [runs/math]  SFT_EXAMPLES [4000]  PROMPTS [48]  MAX_NEW_TOKENS [96]
# TASK, when set, replaces the spec built from DATA..VERIFIER (a path or spec must not contain a comma).
set -euo pipefail

opts="question=${QUESTION:-question},answer=${ANSWER:-answer},verifier=${VERIFIER:-math-verify}"
[ -n "${DATA:-}" ] && opts="data=$DATA,$opts"
[ -n "${TEST:-}" ] && opts="test=$TEST,$opts"
[ -n "${SOLUTION:-}" ] && opts="$opts,solution=$SOLUTION"
export TASK="${TASK:-math:$opts}"
export RUNS="${RUNS:-runs/math}" SFT_EXAMPLES="${SFT_EXAMPLES:-4000}" PROMPTS="${PROMPTS:-48}"
export MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-96}" MODEL="${MODEL:-tiny}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/rlvr.sh"
