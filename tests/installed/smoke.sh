#!/usr/bin/env bash
# rlkit as a user installs it: checks the `rlkit` and `python3` first on PATH (an installed wheel, never a
# checkout) in the folder DIR (default: the current one), which must be outside any checkout:
#   bash tests/installed/smoke.sh [DIR]
# tests/e2e/test_installed_wheel.py runs it in a fresh virtual environment (`make test`, `make test-wheel`), and
# the Dockerfile's build in the image. It exits non-zero, naming the step, at the first wrong outcome.
# Knobs (environment): SANDBOX [bwrap] or none (where the code task's programs run: none where bubblewrap
# cannot, as in `docker build`), SFT_EXAMPLES [300], EVAL_NUM [20].
# It needs recipes/quickstart.sh at ../../recipes from here, as in the checkout and the image.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
quickstart="$here/../../recipes/quickstart.sh"
SANDBOX=${SANDBOX:-bwrap}
mkdir -p "${1:-.}"
cd "${1:-.}"
work=$PWD
fail() { echo "smoke: FAILED: $*" >&2; exit 1; }
step() { echo "smoke: [${SECONDS}s] $*" >&2; }
# run LOG CMD...: CMD's stderr into LOG.log, shown when CMD fails
run() { local log=$1.log rc=0; shift; "$@" 2> "$log" || rc=$?; [ $rc -eq 0 ] || { cat "$log" >&2; fail "$* (exit $rc)"; }; }

step "the installed package"
python3 - <<'PY' || fail "importing rlkit from the installed wheel (see above)"
import importlib, pathlib, site, sys, sysconfig
import rlkit
places = [pathlib.Path(p).resolve() for p in [sysconfig.get_paths()["purelib"], *site.getsitepackages()]]
where = pathlib.Path(rlkit.__file__).resolve()
assert any(where.is_relative_to(p) for p in places), f"rlkit imports from {where}, not from {places}"
for m in ("rlkit.cli", "rlkit.stages.sft", "rlkit.sandbox", "rlkit.sandbox.bwrap", "rlkit.tasks.code", "rlkit.planner"):
    importlib.import_module(m)
print(f"smoke: rlkit from {where.parent}", file=sys.stderr)
PY

step "rlkit --help"
run help rlkit --help > help.txt
for c in sft rollout score-ref update eval plan; do grep -q "$c" help.txt || fail "rlkit --help lists no '$c'"; done

step "recipes/quickstart.sh (SFT_EXAMPLES=${SFT_EXAMPLES:-300}, EVAL_NUM=${EVAL_NUM:-20})"
RUNS="$work/quickstart" SFT_EXAMPLES=${SFT_EXAMPLES:-300} EVAL_NUM=${EVAL_NUM:-20} run quickstart bash "$quickstart" > quickstart.out
sft="$work/quickstart/sft"
python3 - "$work/quickstart" "${EVAL_NUM:-20}" <<'PY' || fail "quickstart's outputs (see above)"
import json, pathlib, sys
runs, n = pathlib.Path(sys.argv[1]), int(sys.argv[2])
for d, kind in (("sft", "model"), ("ref", "reference")):
    assert (runs / d / "model.safetensors").stat().st_size > 0, f"no weights in {runs / d}"
    assert json.loads((runs / d / "rlkit.json").read_text())["kind"] == kind, d
(row,) = [json.loads(x) for x in (runs / "metrics.jsonl").read_text().splitlines()]
assert row["stage"] == "eval" and row["n"] == n and row["label"] == "sft", row
PY

step "the code task on its shipped sample, programs in the sandbox ($SANDBOX)"
run code rlkit eval --policy "$sft" --task code:data=sample,heldout=0.5 --num-prompts 4 --sandbox "$SANDBOX" --json > code.json
python3 - "$SANDBOX" <<'PY' || fail "the code task (see above)"
import json, sys
from rlkit.sandbox import Sandbox
from rlkit.tasks import get_task
from rlkit.tasks.code import SAMPLE

ev = json.load(open("code.json"))
assert ev["n"] == 4 and sum(ev["verdicts"].values()) == 4, ev  # every response ran against its tests
rows = [json.loads(x) for x in SAMPLE.read_text().splitlines()][:4]
task, box = get_task("code:data=sample"), Sandbox(sys.argv[1], workers=2)
good = task.score_batch([json.loads(r["solutions"])[0] for r in rows], [r["input_output"] for r in rows], box)
bad = task.score_batch(["print('no')"] * len(rows), [r["input_output"] for r in rows], box)
assert good.values == [1.0] * 4 and good.reasons == ["passed"] * 4, good
assert bad.values == [0.0] * 4 and bad.reasons == ["wrong_answer"] * 4, bad
PY

step "rlkit plan on a shipped model config"
run plan rlkit plan update --policy qwen2.5-0.5b --json > plan.json
python3 - <<'PY' || fail "rlkit plan (see above)"
import json
p = json.load(open("plan.json"))
assert p["stage"] == "update" and p["fits"] is True and 1 < p["peak_gib"] < p["gpu_memory_gib"], p
assert p["plans"][0]["parts"]["weights"] > 0.9e9, p  # 0.5B parameters: the shipped config, not the tiny model
PY

step "the math task on its shipped sample"
run math rlkit eval --policy "$sft" --task math --num-prompts 4 --json > math.json
python3 - <<'PY' || fail "the math task (see above)"
import json
ev = json.load(open("math.json"))
assert ev["n"] == ev["n_scored"] == 4 and ev["task"].startswith("math:"), ev
assert all(s["prompt"].startswith("Question: ") for s in ev["samples"]), ev["samples"]
PY
step "an optional extra not installed: one line naming its install command, nothing written"
for probe in "prompts --task reasoning-gym:dataset=gcd|rlkit[reasoning-gym]" \
             "rollout --policy $sft --env textarena:game=GuessTheNumber-v0|rlkit[textarena]"; do
  args=${probe%|*} extra=${probe#*|} rc=0
  python3 -c "import reasoning_gym, textarena" 2>/dev/null && break  # installed here (the image's extras): nothing to show
  rlkit $args --out extra.arrow 2> extra.err || rc=$?
  [ $rc -eq 2 ] && [ ! -e extra.arrow ] && [ "$(wc -l < extra.err)" -eq 1 ] && grep -qF "pip install '$extra'" extra.err \
    || { cat extra.err >&2; fail "rlkit $args without its extra (exit $rc)"; }
done

step "all passed"
