#!/usr/bin/env bash
# RLVR on a reasoning-gym generator (the `reasoning-gym` task, extra rlkit[reasoning-gym]): sft on the generator's
# gold answers -> freeze-ref -> eval -> ROUNDS x (rollout | score-ref | update; eval on held-out questions) ->
# report. It is recipes/rlvr.sh with the reasoning-gym task and its defaults, so every rlvr.sh knob works here too
# (ALGO, LR, BETA, SEED, ...); held-out accuracy is the library's scorer, strict (full score only).
# The default generator suits the embedded tiny model (a character-level model trained for a minute): the
# sums of two or three one-digit numbers, `Question: Calculate 7 + 2 + 5.\nAnswer:` (1,100 questions, a fifth of
# them held out). At the defaults on 2 CPU cores (about 3 minutes), held-out accuracy by the strict scorer: SEED 0
# 42.5% after SFT -> 46.0% after 3 RL rounds, SEED 1 51.5% -> 60.5%. Any other generator and config: DATASET and
# CONFIG, or a whole TASK spec, e.g.
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct DATASET=simple_equations CONFIG= ANSWER_TAGS=1 MAX_NEW_TOKENS=256 bash recipes/reasoning-gym.sh
# Knobs (environment), defaults in brackets, besides rlvr.sh's:
#   DATASET [basic_arithmetic]  CONFIG [min_terms=2,max_terms=3,max_digits=1,operators=+,allow_parentheses=0,allow_negation=0]
#   HELDOUT [0.2] the held-out share of questions  ANSWER_TAGS [0] read the answer from <answer></answer> tags
#   RUNS [runs/reasoning-gym]  SFT_EXAMPLES [16000]  EVAL_NUM [200]  PROMPTS [256]  MAX_NEW_TOKENS [16]
# TASK, when set, replaces the spec built from DATASET..ANSWER_TAGS.
set -euo pipefail

config=${CONFIG-min_terms=2,max_terms=3,max_digits=1,operators=+,allow_parentheses=0,allow_negation=0}
spec="reasoning-gym:dataset=${DATASET:-basic_arithmetic}${config:+,$config},heldout=${HELDOUT:-0.2}"
[ "${ANSWER_TAGS:-0}" = 1 ] && spec="$spec,answer_tags=1"
export TASK="${TASK:-$spec}"
export RUNS="${RUNS:-runs/reasoning-gym}" SFT_EXAMPLES="${SFT_EXAMPLES:-16000}" PROMPTS="${PROMPTS:-256}"
export EVAL_NUM="${EVAL_NUM:-200}" MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-16}" MODEL="${MODEL:-tiny}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/rlvr.sh"
