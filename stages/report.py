"""`rlkit report`: pictures of one or more runs' metrics files, and a summary table on the terminal.

Reads the JSON-lines files that `update --metrics` and `eval --metrics` append to (one row per
update or evaluation, keyed by the policy step) and draws one panel per figure against the step:
reward (every component), held-out accuracy, KL to the reference, mean response length, entropy,
clip fraction and weight drift; for multi-turn runs (`rollout --env`, `eval --env`), the held-out mean
trajectory reward, the turns and tool calls per trajectory (training rollouts and held-out) and the
environment's share of completion tokens, where the rows hold them. Several files are overlaid, one colour per run, for sweeps (name
them `NAME=FILE`). A panel whose figure no file holds is left out; the rest still render. Writes a
PNG/SVG/PDF, or an HTML page with the picture and the table embedded; matplotlib draws headless.
A rerun that appended rows for steps already in the file replaces them: the last row per
(stage, step) counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlkit import stage_options
from rlkit.options import output_path
from rlkit.stage_options import argument, option

FORMATS = (".png", ".svg", ".pdf", ".html")


@dataclass(frozen=True)
class Panel:
    title: str
    stage: str  # which rows hold the figure: update or eval
    # figures drawn in this panel; "reward/*" means every reward component; "eval:KEY" a figure of the eval rows
    keys: tuple[str, ...]
    ylabel: str = ""


PANELS = (
    Panel("reward (each component)", "update", ("reward_mean", "reward/*"), "mean reward"),
    Panel("held-out accuracy", "eval", ("accuracy",), "greedy accuracy"),
    # eval --env: the mean trajectory reward, whatever the environment's reward is (a 0/1 verdict or not)
    Panel("held-out mean reward (environment)", "eval", ("mean_reward",), "mean trajectory reward (greedy)"),
    Panel("KL to the reference", "update", ("kl_per_seq",), "nats per sequence"),
    Panel("mean response length", "update", ("mean_response_tokens",), "tokens (sampled)"),
    Panel("entropy", "update", ("entropy",), "nats per token"),
    Panel("clip fraction", "update", ("clip_fraction",), "fraction of tokens"),
    Panel("weight drift from the reference", "update", ("drift",), "relative L2"),
    # multi-turn rollouts only (rows without these figures draw neither panel)
    Panel("turns and tool calls per trajectory", "update",
          ("mean_turns", "mean_tool_calls", "eval:mean_turns", "eval:mean_tool_calls"), "mean per trajectory"),
    Panel("environment tokens", "update", ("environment_token_fraction",), "share of completion tokens"),
)


@dataclass(frozen=True)
class ReportConfig:
    metrics: tuple[str, ...] = argument(help="Metrics files (JSON lines from update/eval --metrics), each FILE or NAME=FILE.", show_default=False)
    out: Path = option(..., "--out", "-o", parser=output_path, panel="Output & tracking", help="Picture to write: .png, .svg, .pdf, or .html (picture and summary table in one page).")
    title: str | None = option(None, panel="Output & tracking", help="Title over the panels.")


@dataclass
class Run:
    name: str
    path: Path
    rows: dict[str, dict[int, dict]]  # stage -> step -> last row

    def series(self, stage: str, key: str) -> tuple[list[int], list[float]]:
        pts = [(s, r[key]) for s, r in sorted(self.rows.get(stage, {}).items())
               if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        return [p[0] for p in pts], [float(p[1]) for p in pts]

    def keys(self, stage: str) -> set[str]:
        return {k for r in self.rows.get(stage, {}).values() for k in r}


def parse_runs(specs: tuple[str, ...]) -> list[tuple[str, Path]]:
    """NAME=FILE or FILE -> (name, path); unnamed files are named by their stem, or their folder when stems clash."""
    from rlkit.errors import RlkitError

    pairs = []
    for s in specs:
        name, eq, path = s.partition("=")
        pairs.append((name, Path(path)) if eq and name and path else (None, Path(s)))
    stems = [p.stem for n, p in pairs if n is None]
    out = []
    for n, p in pairs:
        if n is None:
            n = p.stem if stems.count(p.stem) == 1 else f"{p.parent.name}/{p.stem}"
        out.append((n, p))
    names = [n for n, _ in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise RlkitError(f"two runs are both named {dup!r}; name them NAME=FILE")
    return out


EXPECTED = "expected the JSON-lines file written by `rlkit update --metrics` / `rlkit eval --metrics`"


def _not_metrics(path: Path) -> str | None:
    """What `path` is when it is plainly not a metrics file (a directory, an rlkit artifact, a binary file, a
    device), in words; None when it may be one (a file of text, a pipe: `rlkit report <(...)`)."""
    import stat

    from rlkit.io import manifests

    if path.is_dir():
        m = manifests.read_manifest(path)
        return "a directory" + (f" (an rlkit {m.get('kind')} checkpoint)" if m else "")
    if not path.exists():
        return "missing"
    if not path.is_file():
        return None if stat.S_ISFIFO(path.stat().st_mode) else "a device or socket"
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    m = manifests.read_manifest(path) if head.startswith(b"\xff\xff\xff\xff") else None
    if m is not None:
        return f"an Arrow table (an rlkit '{m.get('kind')}' table)"
    if head.startswith(b"\xff\xff\xff\xff"):
        return "an Arrow table"
    if b"\0" in head:
        return "a binary file"
    return None


def load_run(name: str, path: Path) -> Run:
    from rlkit.errors import RlkitError

    what = _not_metrics(path)
    if what == "missing":
        raise RlkitError(f"metrics file {path} does not exist; {EXPECTED}")
    if what is not None:
        raise RlkitError(f"{path} is {what}, not a metrics file; {EXPECTED}")
    rows: dict[str, dict[int, dict]] = {}
    with open(path, encoding="utf-8", errors="strict") as f:
        lines = enumerate(f, 1)
        while True:
            try:
                i, line = next(lines)
            except StopIteration:
                break
            except UnicodeDecodeError:
                raise RlkitError(f"{path} is not UTF-8 text (a binary file?), not a metrics file; {EXPECTED}") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise RlkitError(f"{path} line {i}: not JSON ({e.msg}); expected one JSON object per line") from None
            if not isinstance(row, dict):
                raise RlkitError(f"{path} line {i}: expected a JSON object, got {type(row).__name__}")
            step = row.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                raise RlkitError(f"{path} line {i}: no integer 'step'; every metrics row carries the policy step")
            rows.setdefault(str(row.get("stage", "update")), {})[step] = row
    if not rows:
        raise RlkitError(f"metrics file {path} has no rows")
    return Run(name, path, rows)


def panel_lines(panel: Panel, run: Run) -> list[tuple[str, list[int], list[float]]]:
    """(label, steps, values) for every figure of the panel this run has."""
    keys = []
    for k in panel.keys:
        keys += sorted(x for x in run.keys(panel.stage) if x.startswith("reward/")) if k == "reward/*" else [k]
    out = []
    for k in keys:
        stage, _, key = k.rpartition(":") if k.startswith("eval:") else (panel.stage, "", k)
        xs, ys = run.series(stage, key)
        if xs:
            out.append((f"held-out {key}" if stage != panel.stage else k, xs, ys))
    if panel.keys[0] == "reward_mean" and out and out[0][0] == "reward_mean":
        # the optimised reward is one component (weight 1; float32 vs float64 means): one line, named after it
        same = [c for c in out[1:] if c[1] == out[0][1] and all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(c[2], out[0][2], strict=True))]
        if same:
            out = [(f"reward = {same[0][0].removeprefix('reward/')}", out[0][1], out[0][2])] + \
                  [c for c in out[1:] if c is not same[0]]
    return out


def summary(runs: list[Run]) -> list[dict]:
    """One row per run: first -> last of the figures that tell reward hacking apart from learning."""

    def first_last(run: Run, stage: str, key: str):
        xs, ys = run.series(stage, key)
        return (ys[0], ys[-1]) if ys else None

    out = []
    for r in runs:
        steps = sorted({s for st in r.rows.values() for s in st})
        out.append({
            "run": r.name, "steps": f"{steps[0]}-{steps[-1]}",
            "reward": first_last(r, "update", "reward_mean"),
            "accuracy": first_last(r, "eval", "accuracy"),
            "best_accuracy": max(r.series("eval", "accuracy")[1], default=None),
            "mean_reward": first_last(r, "eval", "mean_reward"),
            "kl_per_seq": first_last(r, "update", "kl_per_seq"),
            "length": first_last(r, "update", "mean_response_tokens"),
            "drift": first_last(r, "update", "drift"),
            "turns": first_last(r, "update", "mean_turns"),
            "tool_calls": first_last(r, "update", "mean_tool_calls"),
        })
    return out


def _fmt(v, pct: bool = False) -> str:
    if v is None:
        return "-"
    if isinstance(v, tuple):
        return f"{_fmt(v[0], pct)} → {_fmt(v[1], pct)}"
    return f"{v:.1%}" if pct else f"{v:.3g}"


SUMMARY_COLUMNS = (("run", "run", False), ("steps", "steps", False), ("reward", "reward", False),
                   ("held-out accuracy", "accuracy", True), ("best accuracy", "best_accuracy", True),
                   ("KL / seq", "kl_per_seq", False), ("tokens", "length", False), ("drift", "drift", False))
MULTI_TURN_COLUMNS = (("held-out mean reward", "mean_reward", False), ("turns", "turns", False),
                      ("tool calls", "tool_calls", False))


def summary_columns(rows: list[dict]) -> tuple[tuple[str, str, bool], ...]:
    """The summary's columns: the multi-turn ones only when some run has them (multi-turn rollouts)."""
    return SUMMARY_COLUMNS + tuple(c for c in MULTI_TURN_COLUMNS if any(r.get(c[1]) is not None for r in rows))


def draw(runs: list[Run], title: str | None):
    """A matplotlib Figure with one panel per figure some run has; None when no run has any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [(p, [(r, panel_lines(p, r)) for r in runs]) for p in PANELS]
    panels = [(p, lines) for p, lines in panels if any(ls for _, ls in lines)]
    if not panels:
        return None
    cols = 2 if len(panels) > 1 else 1
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.4 * cols, 3.4 * nrows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("-", "--", ":", "-.")
    for ax, (panel, lines) in zip(axes.flat, panels, strict=False):
        for ri, (run, ls) in enumerate(lines):
            for ki, (key, xs, ys) in enumerate(ls):
                label = run.name if len(ls) == 1 else f"{run.name}: {key}"
                ax.plot(xs, ys, styles[ki % len(styles)], marker="o", markersize=3, color=colours[ri % len(colours)],
                        label=label)
        ax.set_title(panel.title)
        ax.set_xlabel("policy step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _html(png: bytes, rows: list[dict], runs: list[Run], title: str) -> str:
    import base64
    import html

    columns = summary_columns(rows)
    head = "".join(f"<th>{html.escape(h)}</th>" for h, _, _ in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r[k], pct) if k not in ('run', 'steps') else r[k])}</td>"
                                    for _, k, pct in columns) + "</tr>" for r in rows)
    files = "".join(f"<li>{html.escape(r.name)}: <code>{html.escape(str(r.path))}</code></li>" for r in runs)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><table><tr>{head}</tr>{body}</table><ul>{files}</ul>"
            f"<img alt='metrics panels' src='data:image/png;base64,{base64.b64encode(png).decode()}'></body></html>\n")


def run(cfg: ReportConfig) -> Path:
    from rlkit.io import claims

    inputs = {"metrics": [p for _, p in parse_runs(cfg.metrics)]}
    with claims.claim_out(cfg.out, "file", inputs):
        return _run(cfg)


def _run(cfg: ReportConfig) -> Path:
    import io

    from rich.table import Table

    from rlkit import console
    from rlkit.errors import RlkitError
    from rlkit.io import atomic

    if cfg.out.suffix.lower() not in FORMATS:
        raise RlkitError(f"--out {cfg.out}: unknown format {cfg.out.suffix or '(none)'!r}; expected one of "
                         + ", ".join(FORMATS))
    if cfg.out.is_dir():
        raise RlkitError(f"--out {cfg.out} is a directory; expected a file path ending in one of " + ", ".join(FORMATS))
    if not cfg.metrics:
        raise RlkitError("no metrics files given; expected METRICS.jsonl [MORE.jsonl ...]")
    runs = [load_run(n, p) for n, p in parse_runs(cfg.metrics)]
    title = cfg.title or "rlkit report: " + ", ".join(r.name for r in runs)
    fig = draw(runs, cfg.title)
    if fig is None:
        keys = list(dict.fromkeys(k.removeprefix("eval:") for p in PANELS for k in p.keys if k != "reward/*"))
        raise RlkitError(f"none of the metrics files has a figure to plot ({', '.join(keys[:-1])} or {keys[-1]})")
    rows = summary(runs)
    buf = io.BytesIO()
    fmt = "png" if cfg.out.suffix.lower() == ".html" else cfg.out.suffix.lower()[1:]
    fig.savefig(buf, format=fmt, dpi=110)
    data = buf.getvalue()
    if cfg.out.suffix.lower() == ".html":
        data = _html(data, rows, runs, title).encode()
    with atomic.atomic_file(cfg.out) as tmp:
        tmp.write_bytes(data)
    t = Table(title=title)
    columns = summary_columns(rows)
    for h, _, _ in columns:
        t.add_column(h, justify="left" if h == "run" else "right")
    for r in rows:
        t.add_row(*(r[k] if k in ("run", "steps") else _fmt(r[k], pct) for _, k, pct in columns))
    console.print_wide(t)
    console.info(f"report: {len(runs)} run(s) -> {cfg.out}")
    return cfg.out


command = stage_options.command(
    ReportConfig, "Plot reward, held-out accuracy, KL, length, entropy, clip fraction and drift per step (multi-turn: "
    "held-out mean reward, turns and tool calls); runs overlaid.")
