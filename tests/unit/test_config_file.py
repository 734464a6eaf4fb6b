"""--config FILE (TOML/YAML) on every command, and `rlkit inspect PATH --config` writing it back."""

from __future__ import annotations

import json
import re

import pytest

from rlkit import config_file
from rlkit.cli import command
from rlkit.io import manifests, streams

from conftest import run_cli, stage

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _params(name: str) -> list:
    return command().commands[name].params


def test_every_command_but_inspect_takes_config_and_inspect_has_its_flag():
    group = command()
    for name, cmd in group.commands.items():
        opts = [p for p in cmd.params if "--config" in getattr(p, "opts", ())]
        assert len(opts) == 1, name
        assert opts[0].is_flag == (name == "inspect"), name


def test_keys_by_name_or_option_spelling_and_command_tables():
    others = {n: c.params for n, c in command().commands.items() if n != "update"}
    data = {"minibatch-size": 8, "in": "r.arrow", "seed": 3, "num_prompts": 64,  # num_prompts: rollout's
            "update": {"lr": 0.5, "reward": ["verifier=1"]}, "rollout": {"n": 2}}
    got = config_file.defaults_for(data, "update", _params("update"), others)
    # as the command line gives them: strings, converted and checked by click as typed ones
    assert got == {"minibatch_size": "8", "inp": "r.arrow", "seed": "3", "lr": "0.5", "reward": ["verifier=1"]}


def test_trackers_from_a_file_as_a_list_or_a_string_reach_the_stage(tmp_path, monkeypatch):
    """report_to as TRL's configs write it (a list) or as the flag takes it; a top-level tracker setting is
    skipped by the commands that report to none (one file for a pipeline)."""
    from rlkit.stages import eval as eval_stage

    others = {n: c.params for n, c in command().commands.items() if n != "update"}
    got = config_file.defaults_for({"report_to": ["wandb", "tensorboard"], "project": "p", "run_name": "r"}, "update",
                                   _params("update"), others)
    assert got == {"report_to": "wandb,tensorboard", "project": "p", "run_name": "r"}
    assert config_file.defaults_for({"report_to": "mlflow", "project": "p"}, "rollout", _params("rollout"),
                                    {n: c.params for n, c in command().commands.items() if n != "rollout"}) == {}
    seen = []
    f = tmp_path / "c.yaml"
    f.write_text("report_to:\n  - tensorboard\n  - mlflow\nproject: p\n")
    monkeypatch.setattr(eval_stage, "run", lambda cfg: seen.append(cfg))
    stage("eval", "--policy", str(tmp_path), "--config", str(f), "--run-name", "cli")
    assert seen[0].tracking.report_to == ("tensorboard", "mlflow")
    assert (seen[0].tracking.project, seen[0].tracking.run_name) == ("p", "cli")


@pytest.mark.parametrize(("data", "message"), [
    ({"minibatch": 8}, "unknown key 'minibatch': `rlkit update` has no option --minibatch; did you mean 'minibatch_size'?"),
    ({"update": {"num_prompts": 8}}, "unknown key '[update] num_prompts'"),  # in the command's own table: strict
    ({"updte": {"lr": 1}}, "[updte] is not a command's table"),
    ({"update": {"lr": {"x": 1}}}, "key '[update] lr': expected a value, not a table"),
])
def test_an_unknown_key_names_itself_and_the_closest_option(data, message):
    others = {n: c.params for n, c in command().commands.items() if n != "update"}
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        config_file.defaults_for(data, "update", _params("update"), others)


def test_read_toml_and_yaml_and_refuse_the_rest(tmp_path):
    (tmp_path / "a.toml").write_text('lr = 0.5\nreward = ["a=1"]\n')
    (tmp_path / "a.yaml").write_text("lr: 0.5\nreward: [a=1]\n")
    assert config_file.read(tmp_path / "a.toml") == config_file.read(tmp_path / "a.yaml") == {"lr": 0.5, "reward": ["a=1"]}
    (tmp_path / "bad.toml").write_text("lr = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        config_file.read(tmp_path / "bad.toml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="expected a table"):
        config_file.read(tmp_path / "list.yaml")
    (tmp_path / "a.json").write_text("{}")
    with pytest.raises(ValueError, match="expected a .toml, .yaml or .yml file"):
        config_file.read(tmp_path / "a.json")


def test_options_toml_reads_back_as_the_same_values():
    opts = {"policy": "runs/sft", "in": "r \"1\".arrow", "lr": 5e-05, "epochs": 2, "follow": False, "reward": ["verifier=1", "rm:h=0.5"],
            "beta": None, "tis_cap": None, "lora_targets": None, "clip_high": 0.28}
    text = config_file.options_toml("update", opts, "ckpt")
    back = tomllib.loads(text)["update"]
    assert back == {k: v for k, v in opts.items() if v is not None}


def test_the_command_line_wins_over_the_file_and_inspect_writes_it_back(tmp_path):
    (tmp_path / "run.toml").write_text('task = "arithmetic"\nseed = 7\n[prompts]\nnum_prompts = 6\nsplit = "heldout"\n')
    a = tmp_path / "a.arrow"
    r = run_cli("prompts", "--config", str(tmp_path / "run.toml"), "--num-prompts", "4", "--out", str(a))
    assert r.returncode == 0, r.stderr
    m = manifests.read_manifest(a)
    assert "config" not in m["options"]  # the file's values are recorded, not the file
    assert m["options"]["num_prompts"] == 4 and m["options"]["seed"] == 7 and m["options"]["split"] == "heldout"
    t, _ = streams.read_table(a, ["prompts"])
    assert t.num_rows == 4

    r = run_cli("inspect", str(a), "--config")
    assert r.returncode == 0, r.stderr
    (tmp_path / "back.toml").write_text(r.stdout.decode())
    b = tmp_path / "b.arrow"
    r = run_cli("prompts", "--config", str(tmp_path / "back.toml"), "--out", str(b))
    assert r.returncode == 0, r.stderr
    tb, _ = streams.read_table(b, ["prompts"])
    assert tb.to_pylist() == t.to_pylist()

    r = run_cli("prompts", "--config", str(tmp_path / "nope.toml"), "--out", str(tmp_path / "c.arrow"))
    assert r.returncode == 2 and b"cannot read it" in r.stderr and not (tmp_path / "c.arrow").exists()
    (tmp_path / "typo.toml").write_text("num_promts = 3\n")
    r = run_cli("prompts", "--config", str(tmp_path / "typo.toml"), "--out", str(tmp_path / "c.arrow"))
    assert r.returncode == 2 and "did you mean 'num_prompts'?" in r.stderr.decode() and not (tmp_path / "c.arrow").exists()
    assert json.loads(run_cli("inspect", str(a), "--json").stdout)["manifest"]["options"]["num_prompts"] == 4


@pytest.mark.slow
def test_update_from_its_checkpoints_config_gives_the_same_weights(sft_dir, tmp_path):
    from safetensors.torch import load_file

    roll = tmp_path / "r.arrow"
    stage("rollout", "--policy", str(sft_dir), "--num-prompts", "8", "--n", "4", "--seed", "2", "--out", str(roll))
    u1, u2 = tmp_path / "u1", tmp_path / "u2"
    r = run_cli("update", "--policy", str(sft_dir), "--in", str(roll), "--out", str(u1), "--lr", "1e-3", "--beta", "0",
                "--minibatch-size", "8", "--seed", "5", "--length-penalty", "0.05")
    assert r.returncode == 0, r.stderr
    r = run_cli("inspect", str(u1), "--config")
    assert r.returncode == 0, r.stderr
    cfg = tmp_path / "run.toml"
    cfg.write_text(r.stdout.decode())
    assert tomllib.loads(cfg.read_text())["update"]["minibatch_size"] == 8
    r = run_cli("update", "--config", str(cfg), "--out", str(u2))
    assert r.returncode == 0, r.stderr
    a, b, w0 = (load_file(str(d / "model.safetensors")) for d in (u1, u2, sft_dir))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert any(not (a[k] == w0[k]).all() for k in a)  # it trained


def _defaults(command_name: str, data: dict) -> dict:
    others = {n: c.params for n, c in command().commands.items() if n != command_name}
    return config_file.defaults_for(data, command_name, _params(command_name), others)


@pytest.mark.parametrize(("cmd", "data", "message"), [
    ("rollout", {"n": True}, "key 'n': --n takes an integer, not true (a boolean)"),  # not --n 1
    ("rollout", {"n": 2.5}, "key 'n': --n takes an integer, not 2.5 (a float)"),
    ("rollout", {"rollout": {"n": [2, 4]}}, "key '[rollout] n': --n takes an integer, not a list ([2, 4])"),
    ("update", {"lr": True}, "key 'lr': --lr takes a number, not true (a boolean)"),
    ("update", {"lr": "fast"}, None),  # a string goes to click as typed: its own error, naming the file (below)
    ("update", {"force": "true"}, "key 'force': --force takes true or false (it is a flag), not \"true\" (a string)"),
    ("update", {"force": 1}, "key 'force': --force takes true or false (it is a flag), not 1 (an integer)"),
    ("update", {"algo": 3}, "key 'algo': --algo takes one of its choices (a string), not 3 (an integer) (quote it"),
    ("update", {"reward": ["verifier=1", 0.5]}, "key 'reward': --reward takes a string per list item, not 0.5 (a float)"),
    ("update", {"run_name": False}, "key 'run_name': --run-name takes a string, not false (a boolean)"),
    ("eval", {"label": 1.10}, "key 'label': --label takes a string, not 1.1 (a float) (quote it to give a string)"),
])
def test_a_value_whose_type_the_option_does_not_take_is_refused_naming_key_given_and_expected(cmd, data, message):
    if message is None:
        assert _defaults(cmd, data) == {"lr": "fast"}
        return
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        _defaults(cmd, data)


def test_values_the_option_takes_become_what_the_command_line_gives():
    got = _defaults("update", {"minibatch_size": "8", "lr": 1, "clip_high": 1e-5, "force": True, "follow": False,
                               "reward": "verifier=1", "run_name": 2024, "report_to": ["wandb", "mlflow"],
                               "tis_cap": None})
    assert got == {"minibatch_size": "8", "lr": "1", "clip_high": "1e-05", "force": True, "follow": False,
                   "reward": ["verifier=1"], "run_name": "2024", "report_to": "wandb,mlflow"}  # null: the default


@pytest.mark.parametrize(("name", "text", "message"), [
    ("int-key.yaml", "1: 2\n", "key 1 (an integer): expected an option or command name (a string)"),
    ("null-key.yaml", "~: 2\n", "key null (YAML's null): expected an option or command name"),
    ("table-key.yaml", "update:\n  true: 2\n", "key true in [update] (a boolean): expected an option or command name"),
    ("bomb.yaml", "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)) + "reward: *i\n",
     "more than 10,000 values, YAML aliases expanded"),
    ("loop.yaml", "reward: &r [*r]\n", "a YAML alias refers to a node that contains it"),
    ("long.toml", "reward = [" + '"a=1", ' * 10_001 + "]\n", "more than 10,000 values"),
    ("deep.toml", "reward = " + "[" * 50_000 + "]" * 50_000 + "\n", "nested too deeply"),
    ("big.toml", "# " + "x" * 2**20 + "\n", "larger than 1 MiB"),
    ("latin1.toml", b"label = \"caf\xe9\"\n", "not UTF-8 text"),
])
def test_read_refuses_odd_keys_and_files_too_large_to_be_option_files(tmp_path, name, text, message):
    f = tmp_path / name
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=re.escape(message)):
        config_file.read(f)


def test_a_few_yaml_aliases_still_share_settings(tmp_path):
    (tmp_path / "a.yaml").write_text("common: &c {seed: 3, n: 4}\nrollout: *c\nupdate:\n  <<: *c\n  lr: 0.1\n")
    assert config_file.read(tmp_path / "a.yaml")["update"] == {"seed": 3, "n": 4, "lr": 0.1}


def test_an_error_about_a_value_from_the_file_names_the_file(tmp_path, capfd):
    from rlkit.cli import _main

    (tmp_path / "c.toml").write_text('lr = "fast"\nminibatch_size = 99999999999999999999999\n')
    capfd.readouterr()
    assert _main(["update", "--policy", str(tmp_path), "--out", str(tmp_path / "o"), "--config",
                  str(tmp_path / "c.toml")]) == 2
    err = capfd.readouterr().err
    assert f"(from --config {tmp_path / 'c.toml'})" in err and "'--lr'" in err, err
    (tmp_path / "c.toml").write_text("minibatch_size = 99999999999999999999999\n")
    assert _main(["update", "--policy", str(tmp_path), "--out", str(tmp_path / "o"), "--config",
                  str(tmp_path / "c.toml")]) == 2
    err = capfd.readouterr().err
    assert "'--minibatch-size': 99999999999999999999999 is larger than 2147483647" in err, err
    assert not (tmp_path / "o").exists()


def test_a_config_written_back_leaves_the_runs_outputs_out(tmp_path, capfd):
    """`inspect CKPT --config > run.toml; update --config run.toml --out NEW` must not append to CKPT's
    --metrics or log into its TensorBoard folder or tracker run, and without --out it is the usual usage error
    (it would otherwise replace CKPT)."""
    from rlkit.cli import _main

    opts = {"policy": "runs/sft", "in": "r.arrow", "out": "runs/round-1", "metrics": "runs/m.jsonl", "lr": 1e-5,
            "tensorboard": "tb/round-1", "run_name": "round-1", "report_to": "tensorboard", "seed": 3}
    text = config_file.options_toml("update", opts, "runs/round-1")
    back = tomllib.loads(text)["update"]
    assert not set(back) & {"out", "metrics", "tensorboard", "run_name"}
    assert back == {"policy": "runs/sft", "in": "r.arrow", "lr": 1e-5, "report_to": "tensorboard", "seed": 3}
    assert '# out = "runs/round-1"' in text and '# metrics = "runs/m.jsonl"' in text  # shown, commented out
    assert "(--out, --metrics, --tensorboard, --run-name)" in text
    (tmp_path / "run.toml").write_text(text)
    capfd.readouterr()
    assert _main(["update", "--config", str(tmp_path / "run.toml")]) == 2
    assert "Missing option '--out'" in capfd.readouterr().err


@pytest.mark.parametrize(("cmd", "values", "given"), [
    ("update", {"algo": "distill", "teacher_coef": 0.5, "overlong_buffer": 4, "overlong_penalty": 0.5,
                "mask_truncated": True}, {"algo": "distill", "teacher_coef": "0.5", "overlong_buffer": "4",
                                          "overlong_penalty": "0.5", "mask_truncated": True}),
    ("rollout", {"min_informative_groups": 8, "max_refill_rounds": 2},
     {"min_informative_groups": "8", "max_refill_rounds": "2"}),
    ("sft", {"min_reward": 1.0, "best_of": True, "reward": ["verifier=1"]},
     {"min_reward": "1.0", "best_of": True, "reward": ["verifier=1"]}),
    ("score-ref", {"teacher": "runs/teacher", "judge": ["j=runs/judge:rubric=r.toml"]},
     {"teacher": "runs/teacher", "judge": ["j=runs/judge:rubric=r.toml"]}),
    ("build-prefs", {"judge": "runs/judge", "rubric": "r.toml"}, {"judge": "runs/judge", "rubric": "r.toml"}),
])
def test_the_algorithms_and_judges_options_round_trip_through_a_config_file(cmd, values, given):
    """Each option of distillation, CISPO's and DAPO's shaping, dynamic sampling, rejection-sampling SFT and the
    judges: written as a config file, read back the same, and given to the command as its flag would be."""
    back = tomllib.loads(config_file.options_toml(cmd, values, "ckpt"))[cmd]
    assert back == values
    assert _defaults(cmd, back) == given
