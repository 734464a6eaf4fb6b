#!/usr/bin/env bash
# RLVR on the embedded tiny model as a fleet on one machine: recipes/rlvr-follow.sh's run with WORKERS rollout
# workers feeding one update through a spool directory (docs/scale-out.md, "A fleet"):
#   sft -> freeze-ref -> eval ->
#     WORKERS x in the background: rollout --follow DIR --shard I/WORKERS | score-ref --spool SPOOL
#     in the foreground:           update --follow --in SPOOL --out DIR --max-steps ROUNDS (NPROC processes, torchrun)
#   -> eval of every step -> report
# Each batch's PROMPTS prompts are cut into chunks of PROMPTS/WORKERS, one worker's share each; step b+1 trains
# batch b of every worker in worker order, so the weights are those of one worker sampling with
# --chunk-prompts PROMPTS/WORKERS (under torchrun: up to float summation order). With BETA=0 a worker is
# `rollout --spool SPOOL` alone (no reference to score). The workers' logs: $RUNS/logs/worker-I.log.
# Knobs (environment), defaults in brackets, as in recipes/rlvr-follow.sh:
#   RUNS [runs/rlvr-fleet]  SEED [0]  TASK [arithmetic]  SFT_EXAMPLES [24000]  EVAL_NUM [300]
#   ROUNDS [3] steps  PROMPTS [512] prompts a step  N [8] samples a prompt  MAX_NEW_TOKENS [16]  TEMPERATURE [1.0]
#   ALGO [grpo]  LR [5e-5]  EPOCHS [2]  MINIBATCH [128]  BETA [0.01]  KL [k3+]  DROP_DEGENERATE [0]  DUAL_CLIP [3]
#   LAG [1] the policy lag bound (the workers' and update's --max-lag)  ENGINE [auto] the workers' rollout engine
#   plus WORKERS [2] rollout workers (PROMPTS >= WORKERS)
#        NPROC [2] update processes under torchrun (1: a plain `rlkit update`)
#        WORKER_TIMEOUT [600] seconds a worker may give no sign of life before update trains on the others' files
#        PYTHON [python] the interpreter with rlkit and torch, which runs torchrun
# Sized for a CPU. On a GPU machine every process sees every GPU: the update's ranks take cuda:0..NPROC-1 (NPROC at
# most the GPUs) and every worker cuda:0, where vLLM takes a fixed share of the memory per worker (docs/gpu.md): use
# ENGINE=hf there, or the Slurm form's layout, one GPU a worker (recipes/slurm/rlvr-fleet.sbatch).
# A rerun with the same knobs resumes an unfinished run from its newest snapshot (the workers skip the batches they
# already wrote) and skips a finished one; other knobs start DIR and the spool afresh.
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

defaults RUNS=runs/rlvr-fleet SEED=0 TASK=arithmetic SFT_EXAMPLES=24000 EVAL_NUM=300 ROUNDS=3 PROMPTS=512 N=8
defaults MAX_NEW_TOKENS=16 ALGO=grpo LR=5e-5 EPOCHS=2 MINIBATCH=128 BETA=0.01 KL=k3+ TEMPERATURE=1.0
defaults DROP_DEGENERATE=0 DUAL_CLIP=3 LAG=1 ENGINE=auto WORKERS=2 NPROC=2 WORKER_TIMEOUT=600 PYTHON=python
drop_flag=()
[ "$DROP_DEGENERATE" = 1 ] && drop_flag=(--drop-degenerate)
if [ "$WORKERS" -lt 1 ] || [ "$NPROC" -lt 1 ] || [ "$PROMPTS" -lt "$WORKERS" ]; then
  echo "rlvr-fleet: WORKERS ($WORKERS) and NPROC ($NPROC) must be >= 1 and PROMPTS ($PROMPTS) >= WORKERS" >&2
  exit 2
fi
CHUNK=$((PROMPTS / WORKERS))  # a worker's share of every batch: one chunk (more where WORKERS does not divide PROMPTS)

mkdir -p "$RUNS/logs"
start_times

timed sft rlkit sft --task "$TASK" --num-examples "$SFT_EXAMPLES" --eval-num "$EVAL_NUM" --seed "$SEED" --out "$RUNS/sft"
timed freeze-ref rlkit freeze-ref --policy "$RUNS/sft" --out "$RUNS/ref" --dtype bf16
timed eval-sft rlkit eval --policy "$RUNS/sft" --task "$TASK" --num-prompts "$EVAL_NUM" --max-new-tokens "$MAX_NEW_TOKENS" \
  --label sft --json --metrics "$RUNS/metrics.jsonl" > "$RUNS/eval-sft.json"

CKPTS="$RUNS/ckpts"
SPOOL="$RUNS/spool"
knobs="task=$TASK prompts=$PROMPTS n=$N max_new=$MAX_NEW_TOKENS algo=$ALGO lr=$LR epochs=$EPOCHS mb=$MINIBATCH beta=$BETA kl=$KL temp=$TEMPERATURE drop=$DROP_DEGENERATE dual=$DUAL_CLIP seed=$SEED lag=$LAG engine=$ENGINE workers=$WORKERS"
if [ "$(cat "$CKPTS.knobs" 2>/dev/null)" != "$knobs" ]; then
  rm -rf "$CKPTS" "$SPOOL" "$RUNS"/eval-step-*.json
  echo "$knobs" > "$CKPTS.knobs"
fi
last_step() { local l; l=$(readlink "$CKPTS/latest" 2>/dev/null) || { echo 0; return 0; }; l=${l#step-}; echo $((10#$l)); }

# the held-out eval of one step, once (its JSON is the record that it was done)
eval_step() {
  local i=$1
  [ -s "$RUNS/eval-step-$i.json" ] && return 0
  into "$RUNS/eval-step-$i.json" rlkit eval --policy "$CKPTS/$(printf 'step-%06d' "$i")" --task "$TASK" \
    --num-prompts "$EVAL_NUM" --max-new-tokens "$MAX_NEW_TOKENS" --label "step-$i" --json --metrics "$RUNS/metrics.jsonl"
}

# worker I: its share of every batch, written into the spool; batch b samples the prompts
# `rollout --seed SEED*1000+b+1` does (round i of rlvr.sh), whichever worker samples them
worker() {
  local i=$1
  local roll=(rlkit rollout --follow "$CKPTS" --policy "$RUNS/sft" --task "$TASK" --shard "$i/$WORKERS"
              --chunk-prompts "$CHUNK" --batch-prompts "$PROMPTS" --n "$N" --max-new-tokens "$MAX_NEW_TOKENS"
              --temperature "$TEMPERATURE" --seed "$((SEED * 1000))" --max-lag "$LAG" --max-steps "$ROUNDS"
              --engine "$ENGINE")
  if awk -v b="$BETA" 'BEGIN{exit !(b + 0 == 0)}'; then
    "${roll[@]}" --spool "$SPOOL"
  else
    "${roll[@]}" | rlkit score-ref --ref "$RUNS/ref" --spool "$SPOOL"
  fi
}
pids=()
stop_workers() {  # the update failed or was interrupted; each worker is a process group of its own: end its pipe
  local p
  [ "${#pids[@]}" -gt 0 ] || return 0
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  echo "rlvr-fleet: the update did not finish; stopped the workers (their logs: $RUNS/logs/worker-*.log)" >&2
}

rl_start=$(now)
if [ "$(last_step)" -ge "$ROUNDS" ]; then
  echo "ckpts: $CKPTS already holds $ROUNDS steps with these knobs; skipping the fleet" >&2
  rl_secs=0
else
  mkdir -p "$SPOOL"
  # no worker or update runs now: the end markers of an earlier run (ended at a smaller ROUNDS) are stale
  rm -f "$SPOOL/update.end" "$SPOOL"/w*of*.end
  trap stop_workers EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  for i in $(seq 0 $((WORKERS - 1))); do
    set -m  # the worker's own process group (and Ctrl-C reaches it through the trap, not the terminal)
    timed "worker-$i" worker "$i" < /dev/null 2> "$RUNS/logs/worker-$i.log" &
    pids+=($!)
    set +m
  done
  upd=(update --follow --in "$SPOOL" --policy "$RUNS/sft" --out "$CKPTS" --max-steps "$ROUNDS" --max-lag "$LAG"
       --worker-timeout "$WORKER_TIMEOUT" --algo "$ALGO" --lr "$LR" --epochs "$EPOCHS" --minibatch-size "$MINIBATCH"
       --beta "$BETA" --kl-estimator "$KL" --dual-clip "$DUAL_CLIP" --seed "$SEED" "${drop_flag[@]}"
       --metrics "$RUNS/metrics.jsonl")
  if [ "$NPROC" = 1 ]; then
    timed update rlkit "${upd[@]}"
  else  # OMP_NUM_THREADS: torchrun's own default of 1 thread a process, unless set (without torchrun's warning)
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} timed update "$PYTHON" -m torch.distributed.run --standalone \
      --nproc-per-node "$NPROC" -m rlkit "${upd[@]}"
  fi
  # update has published step ROUNDS: every worker has written its last batch, or stops now
  failed=()
  for i in "${!pids[@]}"; do
    rc=0
    wait "${pids[$i]}" || rc=$?
    [ "$rc" = 0 ] || failed+=("worker $i/$WORKERS failed (exit $rc; its log: $RUNS/logs/worker-$i.log)")
  done
  pids=()
  trap - EXIT INT TERM
  if [ "${#failed[@]}" -gt 0 ]; then
    for f in "${failed[@]}"; do echo "rlvr-fleet: $f" >&2; done
    exit 1
  fi
  rl_secs=$(awk -v a="$rl_start" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}')
fi
for i in $(seq 1 "$ROUNDS"); do
  eval_step "$i"
done
cp "$RUNS/eval-step-$ROUNDS.json" "$RUNS/eval-final.json"
rlkit report "$RUNS/metrics.jsonl" --title "RLVR (fleet of $WORKERS, lag $LAG): $TASK" --out "$RUNS/report.png"

summary "$RUNS" "$rl_secs" "$ROUNDS" "$LAG" "$WORKERS" "$NPROC" <<'PY'
runs, rl_secs, n_rounds, lag, workers, nproc = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
times = wall_times(runs)
before, after = accuracy_table(runs, f"after RL ({n_rounds} steps)")
note = " (the run was complete; skipped)" if rl_secs == 0 else ""
print(f"{gain(before, after)}; RL phase wall time {rl_secs:.1f}s{note} (held-out evals not counted)")
print(f"fleet: {workers} workers, update on {nproc} process{'es' if nproc > 1 else ''}, lag bound {lag}\n")
if rl_secs:
    print(f"{'process':10}{'wall s':>8}   (they overlap)")
    for k in [f"worker-{i}" for i in range(workers)] + ["update"]:
        print(f"{k:10}{times[k]:>8.1f}")
    steps_line(runs, n_rounds)
PY
