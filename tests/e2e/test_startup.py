"""A stage process's start and end (`rlkit.startup`, `rlkit.cli._exit_without_teardown`), seen from a real
`rlkit rollout` process through a user reward function (`--reward-fn`, imported in the stage's own process):

- the cyclic garbage collector is paused while the stage imports (the reward function's module is imported before
  the engine starts) and back on, with the start-up's objects frozen, once the model is loaded (the function is
  called while sampling);
- rollout's idle OpenMP threads sleep at once (OMP_WAIT_POLICY=PASSIVE, unless the user set one);
- the process ends without the interpreter's teardown but does what an exit does for others: atexit handlers run,
  a file the user's code left open is flushed, stdout is complete; a thread a normal exit would wait for (not a
  daemon) makes it a normal exit, which waits."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pyarrow as pa

from tests.conftest import rlkit_cmd

PROBE = textwrap.dedent('''
    import atexit, gc, json, os, threading, time

    OUT = os.environ["PROBE_OUT"]
    seen = {"import": {"gc_enabled": gc.isenabled()}}
    LOG = open(OUT + ".log", "w")  # left open, written without a flush: the process's end must flush it

    def probe(completion):
        LOG.write(completion + "\\n")
        if "call" not in seen:
            seen["call"] = {"gc_enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
        return 0.0

    def _at_exit():
        with open(OUT + ".json", "w") as f:
            json.dump(seen, f)

    atexit.register(_at_exit)

    if os.environ.get("PROBE_THREAD"):  # a non-daemon thread still working when the stage is done
        def _late():
            time.sleep(1.5)
            with open(OUT + ".thread", "w") as f:
                f.write("done")
        threading.Thread(target=_late, daemon=False).start()
''')


def _rollout(tmp_path, sft_dir, *, env=None, out=None):
    fn = tmp_path / "probe.py"
    fn.write_text(PROBE)
    args = [*rlkit_cmd(), "rollout", "--policy", str(sft_dir), "--num-prompts", "4", "--n", "2", "--seed", "3",
            "--reward-fn", f"probe={fn}:probe"]
    if out is not None:
        args += ["--out", str(out)]
    e = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    e.update({"PROBE_OUT": str(tmp_path / "probe"), "RLKIT_DEBUG": "0", **(env or {})})
    return subprocess.run(args, capture_output=True, env=e, timeout=300)


def test_stage_start_and_end_seen_from_inside(tmp_path, sft_dir):
    r = _rollout(tmp_path, sft_dir)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    # stdout is the whole table (its end marker too: a truncated stream fails to read)
    t = pa.ipc.open_stream(r.stdout).read_all()
    assert t.num_rows == 8 and t.column("reward/probe").to_pylist() == [0.0] * 8
    seen = json.loads((tmp_path / "probe.json").read_text())  # written by an atexit handler
    assert seen["import"] == {"gc_enabled": False}  # loaded before the engine starts: the collector is paused
    assert seen["call"]["gc_enabled"] is True and seen["call"]["frozen"] > 10_000
    assert seen["call"]["omp_wait_policy"] == "PASSIVE"
    assert (tmp_path / "probe.log").read_text().splitlines() == t.column("completion").to_pylist()


def test_a_users_omp_wait_policy_is_kept_and_a_live_thread_is_waited_for(tmp_path, sft_dir):
    out = tmp_path / "r.arrow"
    r = _rollout(tmp_path, sft_dir, env={"OMP_WAIT_POLICY": "ACTIVE", "PROBE_THREAD": "1"}, out=out)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert pa.ipc.open_stream(pa.OSFile(str(out))).read_all().num_rows == 8
    seen = json.loads((tmp_path / "probe.json").read_text())
    assert seen["call"]["omp_wait_policy"] == "ACTIVE"
    assert (tmp_path / "probe.thread").read_text() == "done"  # the process waited for the thread to finish
