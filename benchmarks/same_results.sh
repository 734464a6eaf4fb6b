#!/usr/bin/env bash
# Same results, old against new: every recipe, scaled down the way tests/e2e/test_recipes.py runs it, in two trees;
# the sha256 of every table (.arrow) and weights (.safetensors) file each run writes, compared; one line a recipe:
#   rlvr.sh              identical (14 files)
#   rlhf.sh              differs: ppo-round-1/model.safetensors, rollouts-1.arrow
#
#   bash benchmarks/same_results.sh OLD NEW [RECIPE...]      e.g. bash benchmarks/same_results.sh 95e73ab .
# OLD, NEW: a git revision of this repository (checked out into a temporary worktree) or a checkout's folder.
# RECIPE: names under recipes/ (default: every recipe). Knobs: WORK [a temporary folder] where the runs are made,
# KEEP [0] 1: leave WORK and the worktrees (kept anyway when a recipe fails or differs: its logs and files are there;
# remove WORK and run `git worktree prune` when done); RLKIT_PYTHON [python3 on PATH] the interpreter with rlkit's dependencies;
# CONTROL [0] 1: a recipe that differs runs in OLD once more, to tell which files differ between two runs of one tree.
# Each tree runs with PYTHONPATH at it (its rlkit; `rlkit/stages` linked to its `stages/` when missing) and its
# recipes copied to WORK/recipes, in the same folder WORK/cwd/runs (emptied first), so the paths recorded in the
# files are the same, and with the manifests' clock pinned (below): a manifest's "created" and the fingerprints made
# from it would otherwise change with the time a stage ran. A recipe that fails in either tree says so (its log in
# WORK). A file that differs is named with what differs in it: tensors, or a table's columns and manifest entries.
# Known to differ between two runs of one tree (CONTROL=1 shows it): optimizer.safetensors' rng/torch, and a
# table's policy_fingerprint (the hash of the policy's rlkit.json, which records its stage's wall times).
set -euo pipefail

[ $# -ge 2 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
OLD=$1 NEW=$2
shift 2
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${RLKIT_PYTHON:-$(command -v python3)}
WORK=${WORK:-$(mktemp -d /tmp/rlkit-same-XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
trees=()
cleanup() {
  local t
  if [ "${KEEP:-0}" != 1 ]; then
    for t in "${trees[@]}"; do git -C "$REPO" worktree remove --force "$t" >/dev/null 2>&1 || true; done
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT

# tree REV|DIR NAME: the folder of that tree (a revision is checked out into WORK/NAME)
tree() {
  if [ -d "$1" ]; then
    (cd "$1" && pwd)
  else
    git -C "$REPO" worktree add --detach "$WORK/$2" "$1" >/dev/null 2>&1
    echo "$WORK/$2"
  fi
}
old=$(tree "$OLD" old)
trees+=("$WORK/old")
new=$(tree "$NEW" new)
trees+=("$WORK/new")
for t in "$old" "$new"; do
  [ -e "$t/rlkit/stages" ] || ln -s ../stages "$t/rlkit/stages"
done

# the sizes tests/e2e/test_recipes.py runs each recipe at (rlaif: its own judge, from JUDGE_EXAMPLES judgments;
# rlvr-follow and rlvr-fleet: lag 0, so that the steps' weights do not depend on the processes' timing)
base=(SFT_EXAMPLES=3000 EVAL_NUM=20 ROUNDS=2 PROMPTS=16 N=4 PREF_PROMPTS=64 MAX_NEW_TOKENS=16)
knobs() {
  case "$1" in
    reward-hacking.sh) echo ROUNDS=1 BETAS="'0.05 0'" ;;
    rlhf.sh) echo ROUNDS=1 ;;
    math.sh) echo ROUNDS=1 SFT_EXAMPLES=200 N=2 ;;
    config.sh) echo ROUNDS=1 SFT_EXAMPLES=200 PROMPTS=8 N=2 ;;
    code.sh) echo ROUNDS=1 SFT_EXAMPLES=300 PROMPTS=8 N=2 EVAL_NUM=12 SANDBOX_WORKERS=2 ;;
    guess.sh) echo ROUNDS=1 SFT_EXAMPLES=300 PROMPTS=8 N=4 TURNS=4 ;;
    tools.sh | reasoning-gym.sh) echo ROUNDS=1 SFT_EXAMPLES=300 PROMPTS=8 N=2 EVAL_NUM=12 ;;
    textarena.sh) echo ROUNDS=1 SFT_GAMES=100 PROMPTS=4 N=4 FINAL=6 ;;
    rlaif.sh) echo ROUNDS=1 SFT_EXAMPLES=300 EVAL_NUM=12 PREF_PROMPTS=48 PROMPTS=8 N=2 JUDGE_EXAMPLES=600 ;;
    distill.sh) echo ROUNDS=1 TEACHER_ROUNDS=1 SFT_EXAMPLES=300 TEACHER_PROMPTS=8 TEACHER_N=4 PROMPTS=8 N=2 EVAL_NUM=12 \
      SAMPLED_N=2 ;;
    rlvr-follow.sh) echo LAG=0 ;;
    rlvr-fleet.sh) echo SFT_EXAMPLES=1500 PROMPTS=8 N=4 WORKERS=2 NPROC=2 LAG=0 ;;
    quickstart.sh) echo SFT_EXAMPLES=300 ;;
  esac
}

# hashes DIR: "sha256  path" of every .arrow and .safetensors file under DIR
hashes() {
  "$PY" - "$1" <<'PY'
import hashlib, sys
from pathlib import Path

root = Path(sys.argv[1])
for p in sorted(list(root.rglob("*.arrow")) + list(root.rglob("*.safetensors"))):
    if p.is_file():
        print(hashlib.sha256(p.read_bytes()).hexdigest(), p.relative_to(root))
PY
}

# the manifests' clock, pinned: every rlkit process of both trees finds this sitecustomize on its PYTHONPATH, which
# makes time.gmtime() (with no argument: the manifests' "created") a fixed instant, so that the fingerprints made
# from manifests (a checkpoint's, a table's) do not change with the time a stage ran
mkdir -p "$WORK/clock"
cat > "$WORK/clock/sitecustomize.py" <<'PY'
import time

_gmtime = time.gmtime
time.gmtime = lambda secs=None: _gmtime(1_700_000_000 if secs is None else secs)
PY

# run TREE SIDE RECIPE: the recipe from TREE, in WORK/cwd with RUNS=WORK/cwd/runs (as the test runs it); its files'
# hashes into WORK/SIDE-RECIPE.sha256, the files themselves moved to WORK/SIDE-RECIPE.runs
run() {
  local t=$1 side=$2 r=$3 runs="$WORK/cwd/runs" rc=0
  rm -rf "$WORK/recipes" "$WORK/cwd"
  cp -r "$t/recipes" "$WORK/recipes"
  mkdir -p "$WORK/cwd"
  (cd "$WORK/cwd" && eval "env ${base[*]} $(knobs "$r") RUNS='$runs' PYTHONPATH='$t:$WORK/clock' PATH='$(dirname "$PY"):$PATH' \
    RLKIT_REQUIRE_SANDBOX=1 bash '$WORK/recipes/$r'") > "$WORK/$side-${r%.sh}.log" 2>&1 || rc=$?
  if [ -d "$runs" ]; then
    hashes "$runs" > "$WORK/$side-${r%.sh}.sha256"
    rm -rf "$WORK/$side-${r%.sh}.runs"
    mv "$runs" "$WORK/$side-${r%.sh}.runs"  # for a look at what differs
  fi
  return $rc
}

# columns OLD NEW: what differs between two .arrow tables: their columns, and the manifest's entries (dotted keys)
columns() {
  "$PY" - "$1" "$2" <<'PY'
import json, sys
import pyarrow as pa

def read(path):
    with pa.OSFile(path) as f:
        try:
            return pa.ipc.open_stream(f).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_file(path).read_all()

def keys(a, b, at=""):
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for n in sorted(set(a) | set(b)) for k in keys(a.get(n), b.get(n), f"{at}{n}.")]
    return [] if a == b else [at[:-1]]

a, b = read(sys.argv[1]), read(sys.argv[2])
cols = [c for c in dict.fromkeys(a.column_names + b.column_names)
        if c not in a.column_names or c not in b.column_names or a.column(c) != b.column(c)]
meta = keys(*(json.loads((t.schema.metadata or {}).get(b"rlkit", b"{}")) for t in (a, b)))
print(" ".join(cols + [f"manifest {k}" for k in meta]) or "layout")
PY
}

# tensors OLD NEW: the names of the tensors that differ between two .safetensors files (their headers aside)
tensors() {
  "$PY" - "$1" "$2" <<'PY'
import sys
from safetensors import safe_open

a, b = (safe_open(p, "np") for p in sys.argv[1:3])
names = sorted(set(a.keys()) | set(b.keys()))
print(" ".join(n for n in names if n not in a.keys() or n not in b.keys()
               or a.get_tensor(n).tobytes() != b.get_tensor(n).tobytes()) or "header")
PY
}

recipes=("$@")
if [ ${#recipes[@]} -eq 0 ]; then
  for f in "$REPO"/recipes/*.sh; do
    [ "$(basename "$f")" = lib.sh ] || recipes+=("$(basename "$f")")
  done
fi
echo "old: $OLD ($(git -C "$old" rev-parse --short HEAD 2>/dev/null || echo "$old"))  new: $NEW" \
  "($(git -C "$new" rev-parse --short HEAD 2>/dev/null || echo "$new")$(git -C "$new" diff --quiet HEAD 2>/dev/null || echo ', uncommitted changes'))"
same=0
for r in "${recipes[@]}"; do
  failed=()
  run "$old" old "$r" || failed+=("old (log: $WORK/old-${r%.sh}.log)")
  run "$new" new "$r" || failed+=("new (log: $WORK/new-${r%.sh}.log)")
  if [ ${#failed[@]} -gt 0 ]; then
    KEEP=1
    printf '%-20s failed in %s\n' "$r" "${failed[*]}"
    continue
  fi
  n=$(wc -l < "$WORK/old-${r%.sh}.sha256")
  if [ "${CONTROL:-0}" = 1 ] && ! cmp -s "$WORK/old-${r%.sh}.sha256" "$WORK/new-${r%.sh}.sha256"; then
    run "$old" again "$r" || true
    unstable=$(diff <(sort -k2 "$WORK/old-${r%.sh}.sha256") <(sort -k2 "$WORK/again-${r%.sh}.sha256") \
                 | awk '/^[<>]/{print $3}' | sort -u | paste -sd' ' - || true)
    [ -n "$unstable" ] && echo "  (OLD run twice: ${unstable// /, } differ between its own two runs)"
  fi
  if cmp -s "$WORK/old-${r%.sh}.sha256" "$WORK/new-${r%.sh}.sha256"; then
    printf '%-20s identical (%s files)\n' "$r" "$n"
    same=$((same + 1))
  else
    KEEP=1
    diffs=()
    while read -r f; do
      if [ -f "$WORK/old-${r%.sh}.runs/$f" ] && [ -f "$WORK/new-${r%.sh}.runs/$f" ]; then
        if [[ $f == *.safetensors ]]; then
          f="$f [$(tensors "$WORK/old-${r%.sh}.runs/$f" "$WORK/new-${r%.sh}.runs/$f")]"
        else
          f="$f [$(columns "$WORK/old-${r%.sh}.runs/$f" "$WORK/new-${r%.sh}.runs/$f")]"
        fi
      fi
      diffs+=("$f")
    done < <(diff <(sort -k2 "$WORK/old-${r%.sh}.sha256") <(sort -k2 "$WORK/new-${r%.sh}.sha256") \
               | awk '/^[<>]/{print $3}' | sort -u)
    printf '%-20s differs: %s\n' "$r" "$(printf '%s, ' "${diffs[@]}" | sed 's/, $//')"
  fi
done
echo "$same of ${#recipes[@]} recipes identical"
[ "$same" = "${#recipes[@]}" ]
