"""Every module imports; `rlkit --help` imports no torch/transformers; ruff is clean."""

import importlib
import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rlkit
import rlkit.stages

from conftest import REPO


def _modules():
    for pkg in (rlkit, rlkit.stages):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not m.name.endswith("__main__"):
                yield m.name


def _imports() -> dict[str, set[str]]:
    """module -> the rlkit modules it imports, at top level or inside a function (a lazy import is an arrow too),
    read from the source with `ast`: `from rlkit.io import claims` names rlkit.io.claims."""
    import ast
    import importlib.util

    names = set(_modules()) | {"rlkit", "rlkit.stages"}
    graph: dict[str, set[str]] = {}
    for name in sorted(names):
        spec = importlib.util.find_spec(name)
        tree = ast.parse(Path(spec.origin).read_text())
        package = name if spec.submodule_search_locations else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names}
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_rlkit_io_is_a_layer_without_circles():
    """rlkit.io (artifacts on disk: schemas, manifests, fingerprints, atomic writes, claims, streams, checkpoints,
    the LoRA format) imports nothing above it (training, algorithms, engines, tasks, stages, the CLI), and no
    import circle runs through it."""
    graph = _imports()
    above = ("rlkit.training", "rlkit.algorithms", "rlkit.engines", "rlkit.tasks", "rlkit.stages", "rlkit.cli")
    up = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("rlkit.io")
                for t in ts if t.startswith(above))
    assert not up, up
    circles = [c for c in _cycles(graph) if any(m.startswith("rlkit.io") for m in c)]
    assert not circles, circles
    assert {"rlkit.io.claims", "rlkit.io.streams"} <= set(graph["rlkit.stages.update"] | graph["rlkit.stages.rollout"])


def test_no_import_circles():
    """No import circle anywhere in rlkit or its stages: every module's rlkit imports, lazy ones included, form a
    graph without a strongly connected component of more than one module (a package's `__init__` and the
    submodules it imports count as separate modules)."""
    graph = _imports()
    assert {"rlkit.engines.hf", "rlkit.engines.base"} <= graph["rlkit.engines"]  # the walk saw the arrows
    circles = _cycles(graph)
    for c in circles:
        print("import circle:", " <-> ".join(c))
    assert not circles, circles


@pytest.mark.parametrize("name", sorted(_modules()))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_the_reward_combination_imports_no_torch():
    """rollout, sft's rejection sampling and update add their reward components through one torch-free module."""
    code = ("import sys\n"
            "from rlkit.rewards import combine_rewards\n"
            "totals, used = combine_rewards({'a': [0.1, 1], 'b': [0.2, 2]}, None)\n"
            "assert totals == [0.1 + 0.2, 3.0] and used == {'a': 1.0, 'b': 1.0}, (totals, used)\n"
            "assert 'torch' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_help_imports_no_heavy_libraries():
    code = (
        "import sys\n"
        "from rlkit.cli import main\n"
        "rc = main(['--help'])\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'pyarrow') if m in sys.modules]\n"
        "assert rc == 0 and not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "400"})
    assert r.returncode == 0, r.stderr
    for cmd in ("sft", "freeze-ref", "eval", "inspect", "prompts"):
        assert cmd in r.stdout
    # the commands' lines name what they take now: environments, teachers and judges
    line = {w[1]: " ".join(w[2:]) for w in (x.split() for x in r.stdout.splitlines()) if len(w) > 2}
    assert "trajectories against an environment (--env)" in line["rollout"]
    assert "a teacher's (--teacher" in line["score-ref"] and "LLM judges' (--judge)" in line["score-ref"]
    assert "an LLM judge's labels (--judge)" in line["build-prefs"] and "with --env: mean trajectory reward" in line["eval"]


def test_every_command_has_help_for_every_option():
    import typer

    from rlkit.cli import app

    group = typer.main.get_command(app)
    options = 0
    for name, cmd in group.commands.items():
        assert cmd.help, name
        for p in cmd.params:
            if p.param_type_name == "option":
                options += 1
                assert p.help, f"{name} {p.opts} has no help"
    assert options > 100  # the walk saw the options (an isinstance check on another click's class sees none)


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed (it is in the dev extra)")
    r = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


# The floors, lowest first: a module imports only from its own floor or lower ones, at top level or inside a
# function. A module not named here is a leaf module at the top of rlkit/ (errors, console, devices, tiny,
# startup, config_file, rewards, plugins' own leaf helpers): the lowest floor.
FLOORS = (
    ("rlkit.io",),
    ("rlkit.sandbox", "rlkit.ops"),
    ("rlkit.engines",),
    ("rlkit.plugins",),
    ("rlkit.tasks",),
    ("rlkit.envs",),
    ("rlkit.sampling",),
    ("rlkit.scorers",),
    ("rlkit.training",),
    ("rlkit.algorithms",),
    ("rlkit.follow", "rlkit.planner"),
    ("rlkit.options", "rlkit.stage_options", "rlkit.stages", "rlkit.cli", "rlkit.__main__"),
)


def _floor(module: str) -> int:
    for i, names in enumerate(FLOORS, start=1):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return 0


def _package(module: str) -> str:
    """rlkit.io.claims -> rlkit.io; rlkit.errors -> rlkit.errors (a top-level module is a package of its own)."""
    return ".".join(module.split(".")[:2])


def test_every_import_runs_down_the_floors():
    """No module imports from a floor above its own (`FLOORS`), lazy imports inside functions included: the
    layering docs/architecture.md draws is this list."""
    graph = _imports()
    assert {"rlkit.sampling.driver", "rlkit.stages.rollout"} <= set(graph)  # the walk saw the modules
    up = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if _floor(t) > _floor(m))
    assert not up, "imports running up the floors:\n" + "\n".join(up)


def test_no_private_name_crosses_a_package():
    """`from rlkit.X import _name` and `module._name` on an rlkit module of another package are refused: what
    one package uses of another is public."""
    import ast
    import importlib.util

    found = []
    for name in sorted(set(_modules()) | {"rlkit", "rlkit.stages"}):
        spec = importlib.util.find_spec(name)
        tree = ast.parse(Path(spec.origin).read_text())
        package = name if spec.submodule_search_locations else name.rpartition(".")[0]
        aliases = {}  # a local name -> the rlkit module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("rlkit"):
                        aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                if not base.startswith("rlkit"):
                    continue
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and _package(base) != _package(name):
                        found.append(f"{name} imports {base}.{a.name}")
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in aliases):
                target = aliases[node.value.id]
                if _package(target) != _package(name):
                    found.append(f"{name} reads {target}.{node.attr}")
        for part in (n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("rlkit")):
            private = [p for p in part.module.split(".")[1:] if p.startswith("_") and not p.startswith("__")]
            if private and _package(part.module) != _package(name):
                found.append(f"{name} imports the private module {part.module}")
    assert not found, "private names across packages:\n" + "\n".join(sorted(set(found)))


def test_every_package_init_is_a_face():
    """A package's `__init__.py` holds its face only: a docstring, imports, `__all__` (and rlkit's `__version__`);
    the code lives in the modules a newcomer finds by name."""
    import ast

    found = []
    for init in sorted((REPO / "rlkit").rglob("__init__.py")):
        tree = ast.parse(init.read_text())
        for node in tree.body:
            face = isinstance(node, (ast.Import, ast.ImportFrom)) or (
                isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) or (
                isinstance(node, ast.Assign) and all(getattr(t, "id", "") in ("__all__", "__version__")
                                                      for t in node.targets))
            if not face:
                found.append(f"{init.relative_to(REPO)}:{node.lineno} {type(node).__name__}")
    assert len(found) == 0, "code in a package's face:\n" + "\n".join(found)


def test_a_stage_module_stays_thin():
    """A stage is a config, a `run(cfg)` and its command: at most 350 lines, the library work below it."""
    long = {p.name: n for p in sorted((REPO / "stages").glob("*.py"))
            if (n := len(p.read_text().splitlines())) > 350}
    assert not long, long
