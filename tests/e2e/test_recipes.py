"""End to end as a user runs it: real subprocesses on the real tiny model."""

import json
import os
from pathlib import Path

import pytest

from conftest import REPO, rlkit_path, run_cli

pytestmark = pytest.mark.slow


def test_sft_freeze_ref_eval_inspect(tmp_path):
    sft, ref = tmp_path / "sft", tmp_path / "ref"
    r = run_cli("sft", "--out", str(sft), "--num-examples", "4000", "--eval-num", "50", "--batch-tokens", "512",
                "--metrics", str(tmp_path / "m.jsonl"))
    assert r.returncode == 0, r.stderr
    assert b"held-out accuracy" in r.stderr
    man = json.loads((sft / "rlkit.json").read_text())
    assert man["metrics"]["train_loss"] < 2.0  # from ~4.6 (ln 100) at init
    row = json.loads((tmp_path / "m.jsonl").read_text())
    assert row["stage"] == "sft" and row["heldout_accuracy"] == man["metrics"]["heldout_accuracy"]

    r = run_cli("freeze-ref", "--policy", str(sft), "--out", str(ref))
    assert r.returncode == 0, r.stderr

    r = run_cli("eval", "--policy", str(sft), "--num-prompts", "50", "--json", "--metrics", str(tmp_path / "m.jsonl"))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["n"] == 50 and res["accuracy"] == man["metrics"]["heldout_accuracy"]  # same greedy eval, same set
    assert res["samples"] and all(s["prompt"].startswith("<") for s in res["samples"])

    r = run_cli("eval", "--policy", str(ref), "--num-prompts", "20")  # a reference is a policy too (bf16 weights)
    assert r.returncode == 0, r.stderr
    assert b"held-out accuracy" in r.stderr

    r = run_cli("inspect", str(ref), "--json", "--verify")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["weights_verified"] and info["dtypes"] == ["BF16"]
    assert info["lineage"][0]["path"] == str(sft) and info["lineage"][0]["changed_since"] is False
    assert info["lineage"][1]["path"] == "tiny"

    r = run_cli("prompts", "--num-prompts", "30", "--out", str(tmp_path / "p.arrow"))
    assert r.returncode == 0, r.stderr
    r = run_cli("inspect", str(tmp_path / "p.arrow"), "--json")
    info = json.loads(r.stdout)
    assert info["kind"] == "prompts" and info["rows"] == 30 and len(info["first_rows"]) == 5


def test_sft_from_a_data_file_with_mapped_columns(tmp_path):
    rows = [{"q": f"<{a}+{b}>=", "a": str(a + b)} for a in range(10) for b in range(10)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "sft"
    r = run_cli("sft", "--data", str(data), "--prompt-column", "q", "--completion-column", "a", "--out", str(out),
                "--epochs", "2")
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "rlkit.json").read_text())
    assert m["config"]["task"] is None and m["inputs"]["data"].startswith("sha256:")
    assert m["metrics"]["examples"] == 100
    # rerun after editing the data file: not up to date any more
    r = run_cli("sft", "--data", str(data), "--prompt-column", "q", "--completion-column", "a", "--out", str(out),
                "--epochs", "2")
    assert b"up to date" in r.stderr
    data.write_text("\n".join(json.dumps(r) for r in rows[:50]))
    r = run_cli("sft", "--data", str(data), "--prompt-column", "q", "--completion-column", "a", "--out", str(out),
                "--epochs", "2")
    assert r.returncode == 0 and b"up to date" not in r.stderr
    assert json.loads((out / "rlkit.json").read_text())["metrics"]["examples"] == 50


# rlvr-follow.sh: see the rlvr.sh case; rlvr-fleet.sh: its own test, with its Slurm form; quickstart.sh runs from the
# installed wheel (tests/installed/smoke.sh, tests/e2e/test_installed_wheel.py), as a new user first runs it
OWN_TESTS = ("rlvr-follow.sh", "rlvr-fleet.sh", "quickstart.sh")
SHARED = "lib.sh"  # the recipes' common steps, sourced by each: not a recipe
RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.sh") if p.name not in (*OWN_TESTS, SHARED))


def _run_recipe(name: str, runs: Path, **knobs: str):
    import subprocess

    env = {**os.environ, "SFT_EXAMPLES": "3000", "EVAL_NUM": "20", "ROUNDS": "2", "PROMPTS": "16", "N": "4",
           "PREF_PROMPTS": "64", "MAX_NEW_TOKENS": "16", "RUNS": str(runs),
           "PATH": rlkit_path(os.environ["PATH"]), **knobs}
    return subprocess.run(["bash", str(REPO / "recipes" / name)], capture_output=True, env=env, timeout=600,
                          cwd=runs.parent)


def test_every_recipe_is_tested():
    assert set(RECIPES) == {"rlvr.sh", "rlhf.sh", "reward-hacking.sh", "math.sh", "config.sh", "code.sh",
                            "guess.sh", "tools.sh", "reasoning-gym.sh", "textarena.sh", "distill.sh", "rlaif.sh",
                            "code-agent.sh"}, \
        "a new recipe needs a test here"
    assert {p.name for p in (REPO / "recipes").glob("*.sh")} - set(RECIPES) == {*OWN_TESTS, SHARED}
    assert {p.name for p in (REPO / "recipes" / "slurm").iterdir()} == {"rlvr-fleet.sbatch"}, "a Slurm form needs a test"
    assert 'bash "$quickstart"' in (REPO / "tests" / "installed" / "smoke.sh").read_text()


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_runs_scaled_down(recipe, tmp_path, request):
    """Users run recipes in their own CI; ours runs each one end to end with its small-size knobs, in its own RUNS."""
    runs = tmp_path / "runs"
    # one round is enough to check the plumbing; math: a short SFT too
    # rlhf: one round; reward-hacking: one round of two of its beta runs
    knobs = {"reward-hacking.sh": {"ROUNDS": "1", "BETAS": "0.05 0"}, "rlhf.sh": {"ROUNDS": "1"},
             "math.sh": {"ROUNDS": "1", "SFT_EXAMPLES": "200", "N": "2"}, "config.sh": {"ROUNDS": "1", "SFT_EXAMPLES": "200", "PROMPTS": "8", "N": "2"},
             "code.sh": {"ROUNDS": "1", "SFT_EXAMPLES": "300", "PROMPTS": "8", "N": "2", "EVAL_NUM": "12",
                         "SANDBOX_WORKERS": "2"},
             "guess.sh": {"ROUNDS": "1", "SFT_EXAMPLES": "300", "PROMPTS": "8", "N": "4", "TURNS": "4"},
             "tools.sh": {"ROUNDS": "1", "SFT_EXAMPLES": "300", "PROMPTS": "8", "N": "2", "EVAL_NUM": "12"},
             "code-agent.sh": {"ROUNDS": "1", "SFT_EXAMPLES": "300", "PROMPTS": "8", "N": "2", "EVAL_NUM": "12",
                               "ENV_WORKERS": "2"},
             "reasoning-gym.sh": {"ROUNDS": "1", "SFT_EXAMPLES": "300", "PROMPTS": "8", "N": "2", "EVAL_NUM": "12"},
             "textarena.sh": {"ROUNDS": "1", "SFT_GAMES": "100", "PROMPTS": "4", "N": "4", "FINAL": "6"},
             "rlaif.sh": {"ROUNDS": "1", "SFT_EXAMPLES": "300", "EVAL_NUM": "12", "PREF_PROMPTS": "48", "PROMPTS": "8",
                          "N": "2"},
             "distill.sh": {"ROUNDS": "1", "TEACHER_ROUNDS": "1", "SFT_EXAMPLES": "300", "TEACHER_PROMPTS": "8",
                            "TEACHER_N": "4", "PROMPTS": "8", "N": "2", "EVAL_NUM": "12", "SAMPLED_N": "2"}}
    # rlvr.sh: with an experiment tracker (the whole recipe one run: eval and update continue sft's)
    knobs["rlvr.sh"] = {"REPORT_TO": "tensorboard", "PROJECT": "recipe"}
    if recipe == "rlaif.sh":  # a judge trained at this size would tie on every pair: one with a learned preference
        knobs["rlaif.sh"]["JUDGE"] = str(request.getfixturevalue("shorter_judge"))
    r = _run_recipe(recipe, runs, **knobs.get(recipe, {}))
    assert r.returncode == 0, f"{recipe}: {r.stderr.decode()[-2000:]}"
    # every RL recipe leaves one metrics file with held-out accuracy after every round, and its report
    metrics = {"rlvr.sh": "metrics.jsonl", "rlhf.sh": "rlhf-metrics.jsonl", "math.sh": "metrics.jsonl",
               "config.sh": "metrics.jsonl", "code.sh": "metrics.jsonl", "tools.sh": "metrics.jsonl",
               "reasoning-gym.sh": "metrics.jsonl", "rlaif.sh": "metrics.jsonl"}.get(recipe)
    if metrics:
        rows = [json.loads(x) for x in (runs / metrics).read_text().splitlines()]
        rounds = int(knobs.get(recipe, {}).get("ROUNDS", 2))
        assert [r["step"] for r in rows if r["stage"] == "eval"][-rounds - 1:] == list(range(rounds + 1))
        assert (runs / "report.png").read_bytes()[:4] == b"\x89PNG"
    if recipe == "math.sh":  # the math task on the shipped sample, end to end; the tiny model scores ~0
        sft = json.loads((runs / "sft" / "rlkit.json").read_text())
        assert sft["config"]["task"] == "math:question=question,answer=answer,verifier=math-verify,heldout=0.1"
        assert sft["inputs"]["task"].startswith("sha256:") and sft["metrics"]["heldout_n"] >= 3
        ev = json.loads((runs / "eval-round-1.json").read_text())
        assert ev["n"] == sft["metrics"]["heldout_n"] and ev["samples"][0]["prompt"].startswith("Question: ")
        assert "after RL (1 rounds)" in r.stdout.decode()
    if recipe == "reasoning-gym.sh":  # a reasoning-gym generator, scored strictly by its own scorer
        from importlib.metadata import version

        sft = json.loads((runs / "sft" / "rlkit.json").read_text())
        assert sft["config"]["task"].startswith("reasoning-gym:dataset=basic_arithmetic,min_terms=2,max_terms=3")
        assert sft["inputs"]["task"] == f"reasoning-gym=={version('reasoning-gym')}"
        ev = json.loads((runs / "eval-round-1.json").read_text())
        assert ev["n"] == 12 and ev["samples"][0]["prompt"].startswith("Question: Calculate ")
        assert "after RL (1 rounds)" in r.stdout.decode()
        # build-prefs takes the task too: pairs of the policy's own right and wrong answers (no integer answer to
        # make near misses of)
        b = run_cli("build-prefs", "--policy", str(runs / "round-1"), "--task", sft["config"]["task"],
                    "--num-prompts", "32", "--n", "8", "--out", str(runs / "prefs.arrow"))
        assert b.returncode == 0 and "by kind: sampled" in b.stderr.decode(), b.stderr.decode()[-2000:]
    if recipe == "rlaif.sh":  # the judge's labels, its direct score and the verifier side by side every round
        import pyarrow as pa

        with pa.OSFile(str(runs / "prefs.arrow")) as f:
            judged = json.loads(pa.ipc.open_stream(f).schema.metadata[b"rlkit"])["judge"]
        assert judged["fingerprint"].startswith("sha256:") and judged["pairs_judged"] >= judged["pairs_kept"] > 0
        u = [json.loads(x) for x in (runs / "metrics.jsonl").read_text().splitlines() if '"update"' in x]
        assert len(u) == 1 and {"reward/rm:rm", "reward/judge", "verifier_accuracy"} <= set(u[0])
        assert "the judge's agreement with the verifier on held-out problems" in r.stdout.decode()
    if recipe == "distill.sh":  # the student distilled from rlvr.sh's round-1 policy, scored by the teacher token by token
        import pyarrow as pa

        out = r.stdout.decode()
        assert "distilled, round 1" in out and "RL from the verifier, round 1" in out
        m = [json.loads(x) for x in (runs / "metrics.jsonl").read_text().splitlines() if '"update"' in x]
        assert len(m) == 1 and m[0]["teacher_kl"] != 0 and m[0]["sequences"] == 16
        cfg = json.loads((runs / "round-1" / "rlkit.json").read_text())["config"]["rl"]
        assert (cfg["algo"], cfg["teacher_coef"], cfg["beta"]) == ("distill", 1.0, 0.0)
        with pa.OSFile(str(runs / "sampled-round-1.arrow")) as f:
            assert pa.ipc.open_stream(f).read_all().num_rows == 12 * 2
    if recipe == "textarena.sh":  # textarena's GuessTheNumber: SFT games played through the adapter, RL rounds
        import pyarrow as pa

        games = [json.loads(x) for x in (runs / "sft-games.jsonl").read_text().splitlines()]
        assert len(games) == 100 and all(g["completion"].endswith("]\n") for g in games)
        with pa.OSFile(str(runs / "rollouts-1.arrow")) as f:
            t = pa.ipc.open_stream(f).read_all()
        assert t.num_rows == 4 * 4 and set(t.column("end_reason").to_pylist()) <= {"terminated", "max_turns"}
        assert set(t.column("reward/env").to_pylist()) <= {0.0, 1.0}
        out = r.stdout.decode()
        for who in ("sft", "final"):
            ev = json.loads((runs / f"eval-{who}.json").read_text())
            assert ev["n"] == 6 and 0 <= ev["mean_reward"] <= 1 and "accuracy" not in ev  # eval --env: a mean reward
            assert any(line.startswith("held-out (greedy)") and f"{ev['mean_reward']:.1%}" in line for line in out.splitlines())
        (line,) = [x for x in out.splitlines() if x.startswith("round 1 ")]
        assert f"{sum(t.column('reward/env').to_pylist()) / t.num_rows:.1%}" in line
    if recipe == "code.sh":  # programs run against their tests in the sandbox at every stage that verifies
        rows = [json.loads(x) for x in (runs / "metrics.jsonl").read_text().splitlines()]
        sft = json.loads((runs / "sft" / "rlkit.json").read_text())
        assert sft["config"]["task"].startswith("code:ops=2-3") and sft["config"]["sandbox"] == "bwrap"
        (upd,) = [r for r in rows if r["stage"] == "update"]
        fractions = {k: v for k, v in upd.items() if k.startswith("verdict/verifier/")}
        assert fractions and sum(fractions.values()) == pytest.approx(1.0)  # every row has its reason
        assert upd.get("verdict/verifier/passed", 0.0) == pytest.approx(upd["verifier_accuracy"])
        evals = [r for r in rows if r["stage"] == "eval"]
        assert all(sum(r["verdicts"].values()) == r["n_scored"] == 12 for r in evals)
        assert "verdicts of 16 responses" in r.stderr.decode() and "after RL (1 rounds)" in r.stdout.decode()
    if recipe == "guess.sh":  # multi-turn: each round's games kept, their success and turns printed per round
        import pyarrow as pa

        out = r.stdout.decode()
        for name, label in (("rollouts-1.arrow", "round 1"), ("rollouts-final.arrow", "final")):
            with pa.OSFile(str(runs / name)) as f:
                try:
                    t = pa.ipc.open_stream(f).read_all()
                except pa.ArrowInvalid:
                    t = pa.ipc.open_file(str(runs / name)).read_all()
            assert t.num_rows == 8 * 4 and set(t.column("end_reason").to_pylist()) == {"terminated"}
            turns = t.column("turns").to_pylist()
            assert all(1 <= k <= 4 for k in turns) and all(0 in m for m, k in zip(t.column("loss_mask").to_pylist(),
                                                                                 turns, strict=True) if k > 1)
            won = sum(t.column("reward/env").to_pylist()) / t.num_rows
            (line,) = [x for x in out.splitlines() if x.startswith(label + " ")]
            assert f"{won:.1%}" in line and f"{sum(turns) / len(turns):.2f}" in line, line
        rows = [json.loads(x) for x in (runs / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in rows if m["stage"] == "update"] == [1]
        assert json.loads((runs / "round-1" / "rlkit.json").read_text())["kind"] == "model"
    if recipe == "tools.sh":  # sft on tool-use transcripts, RL on trajectories against the calc environment
        sft = json.loads((runs / "sft" / "rlkit.json").read_text())
        assert sft["config"]["task"] == "calc:digits=2,heldout=0.1,tool=0.4"
        rows = [json.loads(x) for x in (runs / "metrics.jsonl").read_text().splitlines()]
        (upd,) = [r for r in rows if r["stage"] == "update"]
        assert upd["sequences"] == 8 * 2
        for label in ("sft", "round-1"):
            ev = json.loads((runs / f"eval-{label}.json").read_text())
            assert ev["n"] == 12 and 0 <= ev["mean_tool_calls"] <= 4 and 0 <= ev["mean_reward"] <= 1
        out = r.stdout.decode()
        assert "tool calls/answer" in out and "after RL (1 rounds)" in out
    if recipe == "code-agent.sh":  # sft on repair transcripts; feedback RL and single-turn RL at equal samples
        sft = json.loads((runs / "sft" / "rlkit.json").read_text())
        assert sft["config"]["task"].startswith("code-feedback:visible=2,fix=0.5,ops=2-3")
        rows = [json.loads(x) for x in (runs / "metrics.jsonl").read_text().splitlines()]
        fb, single = [r for r in rows if r["stage"] == "update"]
        assert single["sequences"] == 8 * 2  # one program a trajectory
        # credit=turn (the default): a row a program, so as many rows as the trajectories' programs
        assert 8 * 2 < fb["sequences"] <= 8 * 2 * 3 and fb["sequences"] == round(fb["mean_turns"] * 8 * 2)
        out = r.stdout.decode()
        for who, label in (("sft", "SFT checkpoint"), ("feedback", "feedback RL (1 rounds)"),
                           ("single", "single-turn RL (1 rounds)")):
            one, three = (json.loads((runs / f"eval-{who}-a{a}.json").read_text()) for a in (1, 3))
            assert one["n"] == three["n"] == 12 and one["mean_turns"] == 1 and 1 <= three["mean_turns"] <= 3
            (line,) = [x for x in out.splitlines() if x.startswith(label)]
            assert f"{one['mean_reward']:.1%}" in line and f"{three['mean_reward']:.1%}" in line, line
        assert "pass at attempt 3: feedback RL" in out
    if recipe == "config.sh":  # settings from recipes/rlvr.toml, the knobs' flags over them, written back
        opts = json.loads((runs / "round-1" / "rlkit.json").read_text())["options"]
        assert opts["lr"] == 5e-5 and opts["minibatch_size"] == 128 and opts["kl_estimator"] == "k3+"  # the file's
        rolled = json.loads((runs / "round-1" / "rlkit.json").read_text())["metrics"]["sequences"]
        assert rolled == 8 * 2  # PROMPTS x N from the command line, not the file's 512 x 8
        assert "[update]" in r.stdout.decode() and "minibatch_size = 128" in r.stdout.decode()
    if recipe == "reward-hacking.sh":  # beta runs from one SFT checkpoint, one report of them all
        for beta in ("0.05", "0"):
            rows = [json.loads(x) for x in (runs / f"beta-{beta}" / "metrics.jsonl").read_text().splitlines()]
            upd = [r for r in rows if r["stage"] == "update"]
            assert [r["step"] for r in upd] == [1] and all("reward/rm:lenbias" in r and "drift" in r for r in upd)
            assert [r["step"] for r in rows if r["stage"] == "eval"] == [0, 1]
        assert (runs / "report.png").stat().st_size > 50_000 and b"<img" in (runs / "report.html").read_bytes()
        rm = json.loads((runs / "rm-length-biased" / "rlkit.json").read_text())
        assert rm["sanity"]["length_bias_warning"] is True  # the sanity report flags the flawed reward model
    if recipe == "rlvr.sh":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (run,) = (runs.parent / "runs" / "recipe").iterdir()
        acc = EventAccumulator(str(run))
        acc.Reload()
        steps = {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
        assert steps["sft/heldout_accuracy"] == [0] and steps["update/reward_mean"] == [1, 2]
        assert sorted(steps["eval/accuracy"]) == [0, 1, 2]
    if recipe == "rlvr.sh":  # a rerun with nothing changed skips every stage and every round
        r = _run_recipe(recipe, runs)
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        err = r.stderr.decode()
        assert err.count("is up to date") >= 2 and "round 1: " in err and "round 2: " in err
        assert "after RL (2 rounds)" in r.stdout.decode()
        _follow_recipe_beside_rlvr(runs)


def _follow_recipe_beside_rlvr(runs: Path) -> None:
    """recipes/rlvr-follow.sh in the same RUNS (same SFT checkpoint and reference, skipped as up to date): at
    LAG=0 one persistent pipe gives the weights rlvr.sh's per-round pipes gave, evaluated live beside the pipe
    (EVAL_LIVE=1). Lag 1 is test_follow.py's test_k1 pipe."""
    import torch
    from safetensors.torch import load_file

    r = _run_recipe("rlvr-follow.sh", runs, LAG="0", EVAL_LIVE="1")
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    out = r.stdout.decode()
    assert "after RL (2 steps)" in out and "one persistent pipe, lag bound 0" in out
    a, b = load_file(str(runs / "ckpts/step-000002/model.safetensors")), load_file(str(runs / "round-2/model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    sft = load_file(str(runs / "sft/model.safetensors"))
    assert max(float((a[k] - sft[k]).abs().max()) for k in a) > 1e-4  # not two untouched copies of the SFT weights
    assert json.loads((runs / "eval-step-2.json").read_text())["accuracy"] == json.loads(
        (runs / "eval-round-2.json").read_text())["accuracy"]
    rows = [json.loads(x) for x in (runs / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows if m["stage"] == "update" and "lag_max" in m][-2:] == [1, 2]
    assert [m["step"] for m in rows if m["stage"] == "eval"][-1] == 2


def test_fleet_recipe_and_its_slurm_form(tmp_path):
    """recipes/rlvr-fleet.sh: 2 rollout workers in the background feed one update on 2 processes (torchrun, gloo)
    through a spool; step b+1 trains batch b of both workers, in worker order, and the trained files are deleted.
    Then recipes/slurm/rlvr-fleet.sbatch: its dry run prints the three sbatch lines, and a submission (a stand-in
    sbatch that records its arguments) chains their dependencies."""
    import shlex
    import subprocess

    runs = tmp_path / "runs"
    r = _run_recipe("rlvr-fleet.sh", runs, SFT_EXAMPLES="1500", PROMPTS="8", N="4", WORKERS="2", NPROC="2")
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    out = r.stdout.decode()
    assert "after RL (2 steps)" in out and "fleet: 2 workers, update on 2 processes, lag bound 1" in out
    assert os.readlink(runs / "ckpts" / "latest") == "step-000002"
    for step in (1, 2):
        follow = json.loads((runs / "ckpts" / f"step-{step:06d}" / "rlkit.json").read_text())["follow"]
        assert [b.split("-s")[0] for b in follow["batches"]] == [f"b{step - 1:06d}-w00of02", f"b{step - 1:06d}-w01of02"]
    spool = runs / "spool"
    assert not list(spool.rglob("*.arrow")) and (spool / "update.end").read_text().strip() == "2"
    assert {p.name for p in spool.glob("*.end")} == {"w00of02.end", "w01of02.end", "update.end"}
    rows = [json.loads(x) for x in (runs / "metrics.jsonl").read_text().splitlines()]
    upd = [m for m in rows if m["stage"] == "update"]
    assert [(m["step"], m["world_size"], m["sequences"]) for m in upd] == [(1, 2, 32), (2, 2, 32)]
    assert [m["step"] for m in rows if m["stage"] == "eval"] == [0, 1, 2]
    assert (runs / "report.png").read_bytes()[:4] == b"\x89PNG"

    # the Slurm form, with a stand-in sbatch first on PATH (it records its arguments and prints a job id)
    sbatch = REPO / "recipes" / "slurm" / "rlvr-fleet.sbatch"
    assert subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/bash\necho "$*" >> "$SBATCH_LOG"; echo $((999 + $(wc -l < "$SBATCH_LOG")))\n')
    (bin_dir / "sbatch").chmod(0o755)
    log = tmp_path / "sbatch.log"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SBATCH_LOG": str(log),
           "RUNS": str(tmp_path / "cluster"), "POLICY": str(runs / "sft"), "REF": str(runs / "ref"), "WORKERS": "2",
           "GPUS": "4", "PROMPTS": "8"}
    dry = subprocess.run(["bash", str(sbatch)], capture_output=True, env={**env, "DRY_RUN": "1"}, timeout=60)
    assert dry.returncode == 0, dry.stderr.decode()
    assert not log.exists() and not (tmp_path / "cluster").exists()  # nothing submitted, nothing made
    lines = dry.stdout.decode().splitlines()
    assert len(lines) == 3 and all(x.startswith("sbatch --parsable ") for x in lines)
    assert subprocess.run(["bash", "-n"], input=dry.stdout).returncode == 0
    workers, update, stop = (shlex.split(x) for x in lines)
    assert "--array=0-1" in workers and "--dependency=after:WORKERS_JOB_ID" in update
    wrap = workers[workers.index("--wrap") + 1]
    assert shlex.split(wrap)[:4] == ["bash", "-o", "pipefail", "-c"]
    # the worker's pipe, as array task 1 runs it (rlkit a stand-in that prints its arguments)
    (bin_dir / "rlkit").write_text('#!/bin/bash\necho "$*" >&2; cat > /dev/null\n')
    (bin_dir / "rlkit").chmod(0o755)
    w = subprocess.run(["sh", "-c", wrap], capture_output=True, env={**env, "SLURM_ARRAY_TASK_ID": "1"}, timeout=60)
    score, rollout = sorted(w.stderr.decode().splitlines(), reverse=True)  # the two print side by side
    cl = tmp_path / "cluster"
    assert "--shard 1/2 " in rollout + " " and "--chunk-prompts 4 " in rollout and "--engine vllm" in rollout
    assert score == f"score-ref --ref {runs / 'ref'} --device cuda --spool {cl / 'spool'}"
    upd_wrap = update[update.index("--wrap") + 1]
    assert upd_wrap.startswith("srun torchrun --nnodes 1 --nproc-per-node 4 --rdzv-backend c10d")
    assert f"-m rlkit update --follow --in {cl / 'spool'} " in upd_wrap and f"--out {cl / 'ckpts'} " in upd_wrap
    assert subprocess.run(["sh", "-n", "-c", upd_wrap]).returncode == 0
    assert stop[-2:] == ["--wrap", "scancel WORKERS_JOB_ID"] and "--dependency=afternotok:UPDATE_JOB_ID" in stop

    sub = subprocess.run(["bash", str(sbatch)], capture_output=True, env=env, timeout=60)
    assert sub.returncode == 0, sub.stderr.decode()
    calls = log.read_text().splitlines()  # one line a submission: its arguments
    assert len(calls) == 3 and (cl / "spool").is_dir() and (cl / "logs").is_dir()
    assert "--array=0-1 " in calls[0] and "--dependency=after:1000 " in calls[1]
    assert "--dependency=afternotok:1001 " in calls[2] and calls[2].endswith("--wrap scancel 1000")
    assert "workers 1000 (array 0-1), update 1001" in sub.stderr.decode()


def test_a_local_hugging_face_model_with_chat_data(tmp_path):
    """Not the tiny default: a Qwen2-architecture directory whose tokenizer has a chat template."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlkit.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    base = tmp_path / "qwen-like"
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                         bos_token_id=tok.bos_token_id))
    model.save_pretrained(base)
    tok.save_pretrained(base)
    rows = [{"messages": [{"role": "user", "content": f"<{a}+{b}>="}, {"role": "assistant", "content": str(a + b)}],
             "answer": str(a + b)} for a in range(10) for b in range(10)]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "sft"
    r = run_cli("sft", "--model", str(base), "--data", str(data), "--out", str(out), "--epochs", "3")
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "rlkit.json").read_text())
    assert m["config"]["tiny"] is None and m["inputs"]["model"].startswith("sha256:")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    # eval renders the same chat template over the messages column and scores the answer column
    r = run_cli("eval", "--policy", str(out), "--prompts", str(data), "--num-prompts", "20", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["n_scored"] == 20 and res["samples"][0]["prompt"] == "<user><0+0>=\n<assistant>"
