# The recipes' common steps, sourced by each of them (`. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"`): the knobs'
# defaults, the wall-time log, a round skipped when it is up to date, a JSON written whole, the multi-turn rounds
# and the summaries' shared Python. It defines functions and runs nothing itself; it ships beside the recipes.

# defaults NAME=VALUE...: each NAME keeps the value the environment gives it (when not empty), else takes VALUE
defaults() {
  local kv name
  for kv in "$@"; do
    name=${kv%%=*}
    [ -n "${!name:-}" ] || printf -v "$name" '%s' "${kv#*=}"
  done
}

# the wall times: start_times empties $RUNS/times.tsv ($TIMES); `timed LABEL CMD...` runs CMD and appends
# "LABEL<TAB>seconds" (processes in a pipe overlap); `log_time LABEL T0` appends the seconds since T0 (`now`)
now() { printf '%s' "$EPOCHREALTIME"; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.2f", b-a}'; }
start_times() {
  TIMES="$RUNS/times.tsv"
  : > "$TIMES"
}
log_time() { printf '%s\t%s\n' "$1" "$(since "$2")" >> "$TIMES"; }
timed() {
  local label=$1 t0 rc=0
  shift
  t0=$(now)
  "$@" || rc=$?
  log_time "$label" "$t0"
  return $rc
}

# into FILE CMD...: CMD's standard output into FILE, whole or not at all (written to FILE.tmp, then renamed)
into() {
  "${@:2}" > "$1.tmp"
  mv "$1.tmp" "$1"
}

# up_to_date OUT [FILE...]: OUT was made with these $knobs (OUT.knobs), every FILE is there, and OUT checks out
up_to_date() {
  local out=$1 f
  shift
  [ "$(cat "$out.knobs" 2>/dev/null)" = "$knobs" ] || return 1
  for f in "$@"; do [ -s "$f" ] || return 1; done
  rlkit inspect "$out" --check 2>/dev/null
}

# round LABEL OUT CMD...: skipped (said on stderr) when OUT is up to date with $knobs; else CMD (the round: its
# pipe writes OUT) runs, and OUT.knobs records the knobs it ran with
round() {
  local label=$1 out=$2
  shift 2
  if up_to_date "$out"; then
    echo "$label: $out is up to date; skipping" >&2
    return 0
  fi
  rm -f "$out.knobs"
  "$@"
  echo "$knobs" > "$out.knobs"
}

# env_rounds MAX_TURNS: ROUNDS x (rollout --env $ENV | score-ref | update), each round's games kept in
# $RUNS/rollouts-I.arrow and its wall time in $TIMES; $policy is the last round's checkpoint after it
env_rounds() {
  local i out t0
  policy="$RUNS/sft"
  for i in $(seq 1 "$ROUNDS"); do
    out="$RUNS/round-$i"
    if up_to_date "$out" "$RUNS/rollouts-$i.arrow"; then
      echo "round $i: $out is up to date; skipping" >&2
    else
      rm -f "$out.knobs"
      t0=$(now)
      rlkit rollout --policy "$policy" --env "$ENV" --max-turns "$1" --num-prompts "$PROMPTS" --n "$N" \
          --temperature "$TEMPERATURE" --seed "$((SEED * 1000 + i))" \
        | tee "$RUNS/rollouts-$i.arrow" \
        | rlkit score-ref --ref "$RUNS/ref" \
        | rlkit update --policy "$policy" --out "$out" --algo "$ALGO" --lr "$LR" --epochs "$EPOCHS" \
            --minibatch-size "$MINIBATCH" --beta "$BETA" --kl-estimator "$KL" --seed "$SEED" --metrics "$RUNS/metrics.jsonl"
      log_time "round-$i" "$t0"
      echo "$knobs" > "$out.knobs"
    fi
    policy="$out"
  done
}

# inspect_rollouts: each $RUNS/rollouts-*.arrow's figures (rlkit inspect --json) beside it, as rollouts-*.json
inspect_rollouts() {
  local f
  for f in "$RUNS"/rollouts-*.arrow; do
    rlkit inspect "$f" --json > "${f%.arrow}.json"
  done
}

# summary ARGS... <<'PY' ... PY: python3 runs the helpers below, then the recipe's own lines, sys.argv[1:] = ARGS
summary() { python3 -c "$SUMMARY_PY"$'\n'"$(cat)" "$@"; }
IFS= read -r -d '' SUMMARY_PY <<'PY' || true
import json, os, sys
from collections import defaultdict


def wall_times(runs):
    """times.tsv: label -> seconds, summed over the lines of a label"""
    times = defaultdict(float)
    for line in open(f"{runs}/times.tsv"):
        label, secs = line.rstrip("\n").split("\t")
        times[label] += float(secs)
    return times


def accuracy_table(runs, after_label):
    """held-out accuracy and mean tokens of eval-sft.json and eval-final.json; (before, after)"""
    before = json.load(open(f"{runs}/eval-sft.json"))
    after = json.load(open(f"{runs}/eval-final.json"))
    print(f"\n{'':24}{'held-out accuracy':>18}{'mean tokens':>13}")
    print(f"{'SFT checkpoint':24}{before['accuracy']:>18.1%}{before['mean_response_tokens']:>13.2f}")
    print(f"{after_label:24}{after['accuracy']:>18.1%}{after['mean_response_tokens']:>13.2f}")
    return before, after


def gain(before, after):
    return f"gain: {100 * (after['accuracy'] - before['accuracy']):+.1f} points"


def steps_line(runs, n_rounds):
    """the last n_rounds updates: step, lag and (importance-weighted) effective sample size"""
    steps = [json.loads(l) for l in open(f"{runs}/metrics.jsonl") if '"stage": "update"' in l]
    print("steps: " + ", ".join(f"{m['step']} (lag {m.get('lag_max', 0)}, ESS {m['is_ess']:.3f})" if m.get("is_ess")
                                else f"{m['step']} (lag {m.get('lag_max', 0)})" for m in steps[-n_rounds:]))


def games_table(width):
    print(f"\n{'games of':{width}}{'policy':>10}{'success':>10}{'mean turns':>12}{'games':>7}{'wall s':>8}")


def games_row(label, width, policy, fig, wall):
    print(f"{label:{width}}{policy:>10}{fig['mean_reward_env']:>10.1%}{fig['mean_turns']:>12.2f}{fig['trajectories']:>7}"
          f"{wall:>8}")


PY
