#!/usr/bin/env bash
# Code RLVR (the `code` task): sft -> freeze-ref -> eval -> ROUNDS x (rollout | score-ref | update; eval on held-out
# problems) -> report. Every response is a program run against its problem's unit tests in a bubblewrap sandbox
# (no network, read-only system, a private tmpfs, its own PID namespace, resource limits, a wall-clock timeout):
# the reward is 1 when every test passes. It is recipes/rlvr.sh with the code task and its defaults, so every
# rlvr.sh knob works here too (ROUNDS, PROMPTS, N, ALGO, LR, BETA, SEED, ...).
# Default: the generated task the embedded tiny model learns (`# f(x): +3, *2, -1` -> `def f(x): return (x+3)*2-1`,
# tested on seven integers). Your model and data, e.g. APPS/TACO-style rows (question + input_output JSON):
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct DATA=my_problems.jsonl MAX_NEW_TOKENS=512 bash recipes/code.sh
# Knobs (environment), defaults in brackets, besides rlvr.sh's:
#   MODEL [tiny]  DATA [] a .jsonl/.parquet/.arrow or datasets spec (sample: the ~20 problems shipped with rlkit)
#   QUESTION [question] TESTS [input_output, else tests] SOLUTION [solutions] its columns
#   REWARD [all] or fraction (of tests passed)   TIMEOUT [10] seconds per program   MEMORY [1024] MB per program
#   SANDBOX [bwrap] or none (UNSAFE: model code runs as you)   SANDBOX_WORKERS [CPU count]
#   RUNS [runs/code]  SFT_EXAMPLES [12000]  PROMPTS [256]  MAX_NEW_TOKENS [40]
# TASK, when set, replaces the spec built from DATA..MEMORY (a path or spec must not contain a comma).
set -euo pipefail

opts="reward=${REWARD:-all},timeout=${TIMEOUT:-10},memory=${MEMORY:-1024}"
if [ -n "${DATA:-}" ]; then
  opts="data=$DATA,question=${QUESTION:-question},$opts"
  [ -n "${TESTS:-}" ] && opts="$opts,tests=$TESTS"
  [ -n "${SOLUTION:-}" ] && opts="$opts,solution=$SOLUTION"
fi
export TASK="${TASK:-code:$opts}"
export RUNS="${RUNS:-runs/code}" SFT_EXAMPLES="${SFT_EXAMPLES:-12000}" PROMPTS="${PROMPTS:-256}"
export MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-40}" MODEL="${MODEL:-tiny}"
export SANDBOX="${SANDBOX:-bwrap}"  # rlvr.sh passes SANDBOX and SANDBOX_WORKERS to sft, eval and rollout
exec bash "$(dirname "${BASH_SOURCE[0]}")/rlvr.sh"
