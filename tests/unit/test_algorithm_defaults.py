"""`rlkit update`'s defaults are written once, in the algorithm registry and RLConfig: docs/algorithms.md's
table, its sections' "Defaults:" lines, the docs' lists of algorithms and the flags' help all follow them."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from rlkit import algorithms
from rlkit.algorithms import defaults_table
from rlkit.algorithms.config import RLConfig, resolve

from conftest import REPO

ALGORITHMS_MD = REPO / "docs" / "algorithms.md"


def test_the_docs_defaults_table_is_the_registrys():
    assert defaults_table.doc_path() == ALGORITHMS_MD
    doc = ALGORITHMS_MD.read_text(encoding="utf-8")
    assert defaults_table.in_doc(doc) == defaults_table.table(), (
        "docs/algorithms.md's defaults table differs from the registry: run "
        "`python -m rlkit.algorithms.defaults_table --write`")
    for name in algorithms.names():  # one row per algorithm
        assert re.search(rf"^\| {re.escape(name)}( \(default\))? \|", defaults_table.table(), re.M), name


def test_check_and_write_regenerate_a_stale_table(tmp_path):
    doc = tmp_path / "algorithms.md"
    text = ALGORITHMS_MD.read_text(encoding="utf-8")
    doc.write_text(text.replace("| gspo | rollouts | 0 |", "| gspo | rollouts | 0.01 |"), encoding="utf-8")
    assert defaults_table.main(["--check", "--doc", str(doc)]) == 1
    assert defaults_table.main(["--write", "--doc", str(doc)]) == 0
    assert doc.read_text(encoding="utf-8") == text  # everything outside the markers untouched
    assert defaults_table.main(["--check", "--doc", str(doc)]) == 0
    doc.write_text("# no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="markers"):
        defaults_table.main(["--check", "--doc", str(doc)])


def test_the_table_says_what_resolve_trains_with():
    """Each algorithm's row against `resolve` (what `update` trains with and records) and its class."""
    cells = [r.strip("| ").split(" | ") for r in defaults_table.table().splitlines() if r.startswith("| ")]
    rows = {c[0].split(" ")[0]: c for c in cells if c[0].split(" ")[0] in algorithms.REGISTRY}
    assert set(rows) == set(algorithms.names())
    for name, row in rows.items():
        cls = algorithms.get(name)  # its module: the registered name and input kind are the class's
        rl = resolve(RLConfig(algo=name))
        _, trains_on, beta, kl_in, estimator, agg, clips, teacher = row
        assert float(beta) == rl.beta, name
        assert trains_on.split(" + ")[0].split()[-1] in cls.input.kinds, name
        assert ("+ teacher" in trains_on) == (rl.teacher_coef > 0), name
        if teacher != "-":
            assert float(teacher) == rl.teacher_coef, name
        if kl_in != "-":
            assert (kl_in, estimator, agg) == (rl.kl_in, rl.kl_estimator, rl.loss_agg), name
            assert [float(c) for c in clips.split(" / ")] == [rl.clip_low, rl.clip_high], name


def test_the_sections_defaults_lines_agree_with_the_registry():
    """Every `--flag VALUE` on an algorithm section's "- Defaults:" line is what that --algo resolves to."""
    doc = ALGORITHMS_MD.read_text(encoding="utf-8")
    seen = set()
    for section in doc.split("\n## ")[1:]:
        m = re.match(r"[^\n]*\n\n`--algo ([a-z-]+)`", section)
        if not m:
            continue
        name = m.group(1)
        line = re.search(r"^- Defaults:(.*?)(?=\n- |\n\n|\Z)", section, re.M | re.S)
        assert line, f"the {name} section has no '- Defaults:' line"
        rl = resolve(RLConfig(algo=name))
        for flag, value in re.findall(r"--([a-z-]+) ([^\s`]+)", line.group(1)):
            want = getattr(rl, flag.replace("-", "_"))
            got = float(value) if isinstance(want, float) else int(value) if isinstance(want, int) else value
            assert got == want, f"docs/algorithms.md, {name}: --{flag} {value}, but the registry's default is {want}"
        seen.add(name)
    assert seen == set(algorithms.names())  # a section for every algorithm


def test_every_registered_algorithm_is_in_the_docs_lists():
    names = algorithms.names()
    intro = ALGORITHMS_MD.read_text(encoding="utf-8").split("\n\n")[1]
    pipeline = (REPO / "docs" / "pipeline.md").read_text(encoding="utf-8")
    listed = re.search(r"`--algo (grpo(?: \| [a-z-]+)+)`", pipeline)
    readme_row = next(r for r in (REPO / "README.md").read_text(encoding="utf-8").splitlines()
                      if r.startswith("| [docs/algorithms.md]"))
    for name in names:
        assert f"`{name}`" in intro, f"docs/algorithms.md's introduction does not name {name}"
        assert listed and name in listed.group(1).split(" | "), f"docs/pipeline.md's --algo list lacks {name}"
        assert re.search(rf"\b{re.escape(name)}\b", readme_row), f"README.md's docs/algorithms.md row lacks {name}"


def test_the_help_quotes_the_registry():
    from rlkit.cli import app

    out = CliRunner().invoke(app, ["update", "--help"], env={"COLUMNS": "400"}).output
    text = " ".join(out.replace("│", " ").split())
    for field in ("beta", "kl_in", "loss_agg", "clip_low", "clip_high"):
        assert f"Default: per --algo ({defaults_table.phrase(field)})" in text, field
    assert defaults_table.phrase("beta") == "0.01 for most; gspo 0; cispo 0; distill 0; dpo 0.1"  # what the docs say
    assert defaults_table.phrase("kl_in") == "loss for most; ppo reward"  # dpo has none: left out


@pytest.mark.parametrize(("value", "text"), [(3e-4, "3e-4"), (5e-5, "5e-5"), (1.5e-4, "1.5e-4"), (0.28, "0.28"),
                                              (3.0, "3"), (0.0, "0"), (None, "none")])
def test_numbers_are_written_as_the_docs_write_them(value, text):
    assert defaults_table.num(value) == text


def test_the_aggregation_table_names_each_algorithms_default():
    """docs/algorithms.md's "Loss aggregation" table: the "used by default by" column is the registry's."""
    doc = ALGORITHMS_MD.read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([a-z-]+)` \| .* \| ([a-z, -]*) \|$", doc.split("## Loss aggregation")[1].split("\n## ")[0], re.M)
    from rlkit.ops.losses import AGGREGATIONS

    assert [mode for mode, _ in rows] == list(AGGREGATIONS)  # a row per mode
    for mode, users in rows:
        want = {n for n in algorithms.names() if algorithms.REGISTRY[n].reads == "rollouts"
                and algorithms.defaults(n).loss_agg == mode}
        assert {u.strip() for u in users.split(",") if u.strip()} == want, mode
