"""`rlkit update`'s defaults, rendered from the algorithm registry (`rlkit.algorithms.REGISTRY`) and
`RLConfig`, so that what the docs and `--help` say cannot drift from what is trained:

- `table()`: the markdown of docs/algorithms.md's "Defaults at a glance", which holds it between the
  two marker comments below (`tests/unit/test_algorithm_defaults.py` fails when the doc differs);
- `phrase(field)`: the per-algorithm default in a flag's help, e.g. --beta's "0.01 for most; gspo 0;
  cispo 0; dpo 0.1".

Imports no torch (`rlkit --help` builds the phrases). From a source checkout:

    python -m rlkit.algorithms.defaults_table           # print the table
    python -m rlkit.algorithms.defaults_table --write   # put it into docs/algorithms.md
    python -m rlkit.algorithms.defaults_table --check   # exit 1 when docs/algorithms.md's differs
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from rlkit.algorithms import REGISTRY, Entry
from rlkit.algorithms.config import DEFAULT_FOLLOW_TIS_CAP, DEFAULT_KL_ESTIMATOR, RLConfig

BEGIN = "<!-- BEGIN defaults table: generated from rlkit/algorithms by `python -m rlkit.algorithms.defaults_table --write`; edit the registry, not this table -->"
END = "<!-- END defaults table -->"
# the fields an algorithm that trains on preference pairs has no use for (no ratio, no per-token loss,
# no separate KL term): shown as "-" and left out of the help's phrases
_RATIO_FIELDS = ("kl_in", "kl_estimator", "loss_agg", "clip_low", "clip_high", "teacher_coef")


def doc_path() -> Path:
    """docs/algorithms.md of the source checkout this module is in."""
    return Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def num(v: float | None) -> str:
    """A default as the docs write it: 3, 0.28, 5e-5, none."""
    if v is None:
        return "none"
    if v == int(v):
        return str(int(v))
    if abs(v) < 1e-3:
        mantissa, _, exp = f"{v:e}".partition("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"
    return f"{v:g}"


def _value(e: Entry, field: str) -> str:
    d = e.defaults
    if field == "kl_estimator":
        return d.kl_estimator or DEFAULT_KL_ESTIMATOR[d.kl_in]
    v = getattr(d, field)
    return v if isinstance(v, str) else num(v)


def _uses(e: Entry, field: str) -> bool:
    return e.reads == "rollouts" or field not in _RATIO_FIELDS


def phrase(field: str) -> str:
    """The registered default of `field` (an `AlgoDefaults` field, or kl_estimator) over the algorithms
    that use it: the value most of them have, then the others by name ("0.01 for most; gspo 0; cispo 0; dpo 0.1")."""
    values = {name: _value(e, field) for name, e in REGISTRY.items() if _uses(e, field)}
    common = Counter(values.values()).most_common(1)[0][0]
    others = [f"{name} {v}" for name, v in values.items() if v != common]
    return "; ".join([f"{common} for most" if others else common, *others])


def table() -> str:
    """docs/algorithms.md's defaults tables (markdown, no markers): one row per algorithm, then the flags
    every algorithm shares."""
    cfg = RLConfig()
    offline = [name for name, e in REGISTRY.items() if e.reads != "rollouts"]
    rl = f"all but {', '.join(offline)}" if offline else "all"
    out = ["| `--algo` | trains on | `--beta` | `--kl-in` | `--kl-estimator` | `--loss-agg` | `--clip-low` / `--clip-high` "
           "| `--teacher-coef` |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, e in REGISTRY.items():
        cell = {f: _value(e, f) if _uses(e, f) else "-" for f in ("beta", *_RATIO_FIELDS)}
        trains_on = f"scored {e.reads}" if e.reads != "rollouts" or e.defaults.beta > 0 else "rollouts"
        if e.defaults.teacher_coef > 0:
            trains_on += " + teacher"
        clips = f"{cell['clip_low']} / {cell['clip_high']}" if _uses(e, "clip_low") else "-"
        out.append(f"| {name}{' (default)' if name == cfg.algo else ''} | {trains_on} | {cell['beta']} | {cell['kl_in']} "
                   f"| {cell['kl_estimator']} | {cell['loss_agg']} | {clips} | {cell['teacher_coef']} |")
    out += ["",
            "*scored*: piped through `score-ref`, which adds the reference's log-probs (`--beta 0` needs no reference);",
            "*+ teacher*: `score-ref --teacher DIR` adds the teacher's log-probs (any policy-gradient `--algo` reads them",
            "with `--teacher-coef` > 0);",
            "-: does not apply. With `--kl-in` given, `--kl-estimator` defaults to "
            + ", ".join(f"{k} in the {where}" for where, k in DEFAULT_KL_ESTIMATOR.items()) + ".",
            "",
            "| flag | default | applies to |",
            "| --- | --- | --- |"]
    pairs = f" ({' and '.join(offline)}: pairs)" if offline else ""
    rows = [
        ("`--lr`", f"{num(cfg.lr)} (suits the tiny model; about 1e-6 for 1B+ models)", "all"),
        ("`--epochs` / `--minibatch-size`", f"{cfg.epochs} / {cfg.minibatch_size} sequences{pairs}", "all"),
        ("`--dual-clip`", f"{num(cfg.dual_clip)} (0: off)", rl),
        ("`--drop-degenerate`", "on" if cfg.drop_degenerate else "off", rl),
        ("`--grad-clip` / `--warmup-steps` / `--seed`", f"{num(cfg.grad_clip)} / {cfg.warmup_steps} / {cfg.seed}", "all"),
        ("`--old-logprobs` / `--tis-cap`",
         f"{cfg.old_logprobs} / {num(cfg.tis_cap)} ({num(DEFAULT_FOLLOW_TIS_CAP)} for lagged rows under `--follow`)", rl),
        ("`--gamma` / `--lam` / `--vf-clip`", f"{num(cfg.gamma)} / {num(cfg.lam)} / {num(cfg.vf_clip)}", "ppo"),
        ("`--critic-lr` / `--critic-init` / `--target-kl`",
         f"{'2 x `--lr`' if cfg.critic_lr is None else num(cfg.critic_lr)} / {cfg.critic_init} / {num(cfg.target_kl)}", "ppo"),
    ]
    out += [f"| {flag} | {default} | {where} |" for flag, default, where in rows]
    return "\n".join(out)


def _span(doc: str) -> tuple[int, int]:
    """Where the generated text sits in `doc`: between the BEGIN line and the END line."""
    begin, end = doc.find(BEGIN), doc.find(END)
    if begin < 0 or end < begin:
        raise ValueError(f"the doc has no {BEGIN!r} ... {END!r} markers")
    return begin + len(BEGIN), end


def in_doc(doc: str) -> str:
    """The table as the doc holds it."""
    a, b = _span(doc)
    return doc[a:b].strip("\n")


def with_table(doc: str) -> str:
    """`doc` with the generated table between its markers."""
    a, b = _span(doc)
    return f"{doc[:a]}\n{table()}\n{doc[b:]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlkit.algorithms.defaults_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="replace the table between the markers in --doc")
    p.add_argument("--check", action="store_true", help="exit 1 when --doc's table differs from the registry's")
    p.add_argument("--doc", type=Path, default=doc_path(), help="default: docs/algorithms.md of this checkout")
    a = p.parse_args(argv)
    if not (a.write or a.check):
        print(table())
        return 0
    doc = a.doc.read_text(encoding="utf-8")
    if a.check:
        same = in_doc(doc) == table()
        print(f"{a.doc}: the defaults table is {'up to date' if same else 'stale: run with --write'}", file=sys.stderr)
        return 0 if same else 1
    a.doc.write_text(with_table(doc), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
