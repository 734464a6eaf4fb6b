"""What `rollout --env` tells its user, on the real tiny model through the real CLI: the closing line (trajectories,
turns, end reasons, tool calls, the environment's share of the wall), the warnings for a --max-turns below the
environment's own limit and for most trajectories cut there, each observation's length before the --max-env-tokens
cut (`observation_tokens`, which `inspect` marks), and text the tokenizer cannot encode."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlkit.io import streams

from conftest import run_cli_inproc

pytestmark = pytest.mark.slow

ENVS = '''
import time

from rlkit.envs.base import Step


class Talk:
    """Two turns of feedback, then the episode ends: `say` is the feedback's text (sleeping `wait` seconds a step)."""

    def __init__(self, say: str = "<tool>1234567890</tool>", wait: float = 0.0):
        self.say, self.wait = say, float(wait)

    def reset(self, example):
        self.n, self.tool_calls = 0, 0
        return example.prompt

    def step(self, action):
        time.sleep(self.wait)
        self.n += 1
        self.tool_calls += 1
        if self.n >= 3:
            return Step(None, 1.0, terminated=True)
        return Step(self.say, 0.0)
'''


@pytest.fixture(scope="module")
def envs(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("figures") / "talk.py"
    p.write_text(ENVS)
    return p


def _rollout(sft_dir: Path, out: Path, *args: str):
    return run_cli_inproc("rollout", "--policy", str(sft_dir), "--num-prompts", "4", "--n", "2", "--max-new-tokens",
                          "4", "--seed", "3", "--out", str(out), *args)


def test_the_closing_line_says_what_the_trajectories_did(sft_dir, envs, tmp_path):
    out = tmp_path / "r.arrow"
    r = _rollout(sft_dir, out, "--env", f"{envs}:Talk:wait=0.05", "--max-env-tokens", "3", "--env-workers", "1")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    line = next(x for x in err.splitlines() if "trajectories," in x)
    m = re.search(r"rollout: 8 trajectories, ([\d.]+) turns each; ended: terminated 8; 24 tool calls; the "
                  r"environment (\d+)% of the wall \(([\d.]+) s waited on it, of ([\d.]+) s\)", line)
    assert m, line
    assert float(m.group(1)) == 3.0
    # 8 trajectories x 3 steps of 0.05 s, one at a time: at least 1.2 s waited, within the wall
    assert 1.2 <= float(m.group(3)) <= float(m.group(4))
    assert "reached --max-turns" not in err and "below environment" not in err
    # each observation's tokens before the cut: "<tool>1234567890</tool>" is 23 characters, 23 tokens of the tiny
    # tokenizer's, 3 appended
    t, _ = streams.read_table(out, ["rollouts"])
    obs = t.column("observation_tokens").to_pylist()
    mask = t.column("loss_mask").to_pylist()
    assert obs == [[23, 23]] * 8
    for m_ in mask:  # two runs of 3 environment tokens
        runs = "".join(map(str, m_)).split("1")
        assert sorted(len(x) for x in runs if x) == [3, 3]
    # inspect marks the cut exactly
    err = run_cli_inproc("inspect", str(out), "--rows", "1", env={"COLUMNS": "200"}).stderr.decode()
    assert "[cut at 3 tokens]" in err, err


def test_max_turns_below_the_environments_limit_and_most_cut_there_are_warned(sft_dir, tmp_path):
    out = tmp_path / "g.arrow"
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--env", "guess:turns=6", "--max-turns", "1",
                       "--num-prompts", "4", "--n", "2", "--seed", "3", "--out", str(out))
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "--max-turns 1 is below environment GuessNumber's own limit of 6 turns" in err, err
    # an untrained player rarely wins on its first guess: most trajectories end at --max-turns
    ends = streams.read_table(out, ["rollouts"])[0].column("end_reason").to_pylist()
    cut = ends.count("max_turns")
    assert cut * 2 > len(ends)
    assert f"{cut} of {len(ends)} trajectories" in err and "reached --max-turns 1 and were truncated" in err
    # at the game's own limit: no warning that --max-turns is below it
    r = run_cli_inproc("rollout", "--policy", str(sft_dir), "--env", "guess:turns=2", "--max-turns", "2",
                       "--num-prompts", "2", "--n", "2", "--seed", "3", "--out", str(tmp_path / "g2.arrow"))
    assert r.returncode == 0 and "below environment" not in r.stderr.decode()


def test_text_the_tokenizer_cannot_encode_is_warned(sft_dir, envs, tmp_path):
    out = tmp_path / "u.arrow"
    r = _rollout(sft_dir, out, "--env", f"{envs}:Talk:say=caf\u00e9")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "8 trajectories were shown text the tokenizer cannot encode (the model saw its unknown token '<unk>' " \
           "there), first prompt " in err, err
    # plain ASCII: no warning
    r = _rollout(sft_dir, tmp_path / "a.arrow", "--env", f"{envs}:Talk:say=cafe")
    assert r.returncode == 0 and "cannot encode" not in r.stderr.decode()
