"""The tests' fork server (tests/zygote.py): a command started through it is the command a fresh
interpreter runs (output, exit code, the one error line), dies with its client, and a command whose
environment differs in a variable torch or transformers read as they load runs in a fresh interpreter
instead. SIGINT and SIGTERM through it: test_cli's interrupt test."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from pyarrow import ipc

from conftest import fast_rlkit_cmd, fork_server_ready, rlkit_cmd, run_cli


def test_a_command_through_it_is_a_fresh_interpreters(tmp_path):
    fork_server_ready()
    log = tmp_path / "fallbacks.log"
    env = {"RLKIT_TEST_ZYGOTE_FALLBACKS": str(log)}
    args = ["prompts", "--num-prompts", "7", "--task", "arithmetic:terms=2-3"]
    fast = run_cli(*args, env=env)
    real = subprocess.run([*rlkit_cmd(), *args], input=b"", capture_output=True, env={**os.environ, **env})
    assert fast.returncode == real.returncode == 0 and fast.stderr == real.stderr
    tf, tr = (ipc.open_stream(r.stdout).read_all() for r in (fast, real))
    assert tf.num_rows == 7 and tf.equals(tr)
    mf, mr = (json.loads(t.schema.metadata[b"rlkit"]) for t in (tf, tr))
    assert mf.pop("created") <= mr.pop("created") and mf == mr  # the same manifest, a moment apart
    bad = ["inspect", str(tmp_path / "nosuch.arrow")]
    fast, real = run_cli(*bad, env=env), subprocess.run([*rlkit_cmd(), *bad], input=b"", capture_output=True,
                                                        env={**os.environ, "RLKIT_DEBUG": "0", **env})
    assert fast.returncode == real.returncode != 0 and fast.stderr == real.stderr
    assert fast.stderr.decode().startswith("rlkit: error:")
    assert not log.exists(), log.read_text()  # neither fast run fell back to a fresh interpreter


def test_an_import_time_variable_that_differs_runs_a_fresh_interpreter(tmp_path):
    fork_server_ready()
    log = tmp_path / "fallbacks.log"
    r = run_cli("prompts", "--num-prompts", "2", env={"RLKIT_TEST_ZYGOTE_FALLBACKS": str(log),
                                                      "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "") + "1"})
    assert r.returncode == 0 and r.stdout
    assert log.read_text().startswith("HF_HUB_OFFLINE differs: rlkit prompts")


def _in(d: Path) -> list[int]:
    """The processes whose working directory is `d`."""
    found = []
    for e in Path("/proc").iterdir():
        if e.name.isdigit():
            try:
                if os.readlink(e / "cwd") == str(d):
                    found.append(int(e.name))
            except OSError:
                pass
    return found


def test_a_client_killed_with_sigkill_takes_its_command_along(tmp_path):
    fork_server_ready()
    work = tmp_path / "work"
    work.mkdir()
    p = subprocess.Popen([*fast_rlkit_cmd(), "prompts", "--num-prompts", "3000000", "--out", "big.arrow"], cwd=work,
                         stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and not any(n.startswith(".big.arrow.tmp") for n in os.listdir(work)):
        time.sleep(0.05)
    assert len(_in(work)) == 2  # the client and its command
    p.kill()
    p.wait()
    deadline = time.time() + 30
    while _in(work) and time.time() < deadline:
        time.sleep(0.05)
    assert _in(work) == [] and not (work / "big.arrow").exists()
