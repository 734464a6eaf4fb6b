"""The `rlkit` command: every stage registered in one place.

Stage modules import only typer and the standard library at top level (torch and transformers load
inside `run`), so `rlkit --help` stays instant. Errors print as one line; `--debug` (anywhere on the
command line) or RLKIT_DEBUG=1 shows the traceback instead. A bad command line gets click's own usage
message and exit 2, and so does NaN or inf given to any float option (`command()`).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import typing

import typer

from rlkit import __version__
from rlkit.errors import DownstreamClosed, RlkitError
from rlkit.options import HELP_PANELS_FROM, PANEL_OF, ConfigFile, LogLevel, Quiet, modernize
from rlkit.stages import (
    build_prefs,
    cat,
    freeze_ref,
    inspect,
    prompts,
    report,
    rollout,
    score_ref,
    sft,
    train_rm,
    update,
)
from rlkit.stages import eval as eval_stage

app = typer.Typer(
    name="rlkit",
    help="Composable stages for RL post-training of language models. Tables are Arrow streams; "
    "models are Hugging Face directories; stages chain over pipes.",
    no_args_is_help=True,
    add_completion=True,  # rlkit --install-completion [bash|zsh|fish|powershell]
    pretty_exceptions_enable=False,
)

app.command("prompts")(prompts.command)
app.command("sft")(sft.command)
app.command("build-prefs")(build_prefs.command)
app.command("train-rm")(train_rm.command)
app.command("freeze-ref")(freeze_ref.command)
app.command("rollout")(rollout.command)
app.command("score-ref")(score_ref.command)
app.command("update")(update.command)
app.command("eval")(eval_stage.command)
app.command("inspect")(inspect.command)
app.command("report")(report.command)
app.command("cat")(cat.command)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"rlkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks (also RLKIT_DEBUG=1; may go anywhere on the line)."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """rlkit: SFT, reward models and PPO/GRPO-family RL as shell-scriptable jobs."""


_COMMAND = None


def command():
    """The click command tree of `app`, built once, in which
    - every float option (a float in a list or tuple too) refuses NaN and inf with click's usage error,
      before any stage starts: a NaN passes every `x < 0` range check, and no option gives NaN or inf a meaning;
    - every command takes `--config FILE` (rlkit.config_file): the file's values become the command's
      defaults (click's `default_map`), so the command line wins over the file; and `--log-level`, `-q`;
    - every command records its options, as given or defaulted, in the manifests it writes;
    - the options of a command with many are grouped in --help (options.PANELS)."""
    global _COMMAND
    if _COMMAND is None:
        group = typer.main.get_command(app)
        for cmd in (group, *getattr(group, "commands", {}).values()):
            for p in cmd.params:
                if _takes_floats(p):
                    p.callback = _finite(p.callback)
        config, log_level, quiet = _shared_options()
        for cmd in getattr(group, "commands", {}).values():
            if not any("--config" in getattr(p, "opts", ()) for p in cmd.params):  # inspect's own --config flag
                cmd.params.insert(0, config)
            cmd.params += [log_level, quiet]
            cmd.callback = _recording(cmd)
            if len(cmd.params) > HELP_PANELS_FROM:
                for p in cmd.params:
                    if getattr(p, "rich_help_panel", None) is None and p.name in PANEL_OF and p not in (config, log_level, quiet):
                        p.rich_help_panel = PANEL_OF[p.name]
        _COMMAND = group
    return _COMMAND


def _shared_options() -> list:
    """The options every command takes, built by typer once and shared: `--config FILE` (options.ConfigFile:
    eager, read before every other option, whose defaults it sets), `--log-level` and `-q/--quiet`."""
    template = typer.Typer(add_completion=False)

    @template.command()
    def _c(_config: ConfigFile = None, _log_level: LogLevel = "info", _quiet: Quiet = False):
        pass

    return typer.main.get_command(template).params


def _recording(cmd):
    """`cmd`'s callback, run with its options recorded for the manifests it writes (keyed by the long
    option's name: `in`, `minibatch_size`)."""
    keys = {p.name: next((o[2:].replace("-", "_") for o in getattr(p, "opts", ()) if o.startswith("--")), p.name)
            for p in cmd.params if p.name}
    inner = cmd.callback

    def run(**kwargs):
        from rlkit.io.artifacts import command_options  # pyarrow: loaded when a stage runs, not for --help

        with command_options({keys.get(k, k): v for k, v in kwargs.items()}):
            return inner(**kwargs)

    return run


def _takes_floats(param) -> bool:
    desc = getattr(param, "type_descriptor", None)  # typer >= 0.2x: the annotation (`float | None` reads float)
    if desc is not None:
        return _has_float(desc.annotation)
    t = getattr(param, "type", None)  # typer on click's own types: FLOAT, FloatRange, a Tuple of them
    return any(getattr(x, "name", "").startswith("float") for x in (t, *getattr(t, "types", ())))


def _has_float(annotation) -> bool:
    return annotation is float or any(_has_float(a) for a in typing.get_args(annotation))


def _finite(callback):
    """A parameter callback (click calls it with the converted value) that refuses NaN and inf, then
    runs the parameter's own `callback`, if any."""

    def check(ctx, param, value):
        for v in _flat(value):
            if isinstance(v, float) and not math.isfinite(v):
                raise typer.BadParameter(f"'{v}' is not a finite number", ctx=ctx, param=param)
        return callback(ctx, param, value) if callback is not None else value

    return check


def _flat(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)
    else:
        yield value


def _raised(name: str) -> tuple[type, ...]:
    """Exception class `name` (ClickException, Exit, Abort) of each click that is loaded: typer >= 0.2x
    raises those of its vendored copy (`typer._click`; Exit and Abort are typer's own), older typer
    click's own. Looked up while an error is handled, so startup imports nothing for it."""
    mods = ("typer._click.exceptions", "typer.exceptions", "click.exceptions")
    found = (getattr(sys.modules.get(m), name, None) for m in mods)
    return tuple(dict.fromkeys(c for c in found if isinstance(c, type)))


def _stage_params(args: list[str]) -> tuple[str, dict]:
    """(the stage's name, its parameters as given or defaulted) from the command line: for an error that
    names the sizes in force (an out-of-memory one), read back through click without running anything."""
    group = command()
    for i, a in enumerate(args):
        sub = group.commands.get(a) if hasattr(group, "commands") else None
        if sub is not None:
            try:
                with sub.make_context(a, list(args[i + 1:]), resilient_parsing=True) as ctx:
                    return a, dict(ctx.params)
            except Exception:  # noqa: BLE001 (only for a message: fall back to the name alone)
                return a, {}
    return "rlkit", {}


def _show_usage_error(e) -> None:
    """click's message: usage, the `Try 'rlkit CMD --help'` hint, the error naming the option. typer's
    copy of click lists close matches as "(Possible options: ...)" in alphabetical order; this asks "Did you
    mean" the closest, as click does for one, and a value typer's pydantic coercion refused is quoted."""
    close = getattr(e, "possibilities", None)
    if close and "Did you mean" not in e.format_message():  # difflib's order: the closest first
        also = f" (also close: {', '.join(close[1:])})" if len(close) > 1 else ""
        e.message, e.possibilities = f"{e.message}. Did you mean {close[0]}?{also}", None
    errors = e.__cause__.errors() if callable(getattr(e.__cause__, "errors", None)) else None  # pydantic's
    if errors and isinstance(errors[0].get("input"), str):
        e.message = f"{e.message} (got {errors[0]['input']!r})"
    e.show()


def _on_sigterm(signum, frame):
    """SIGTERM ends a stage as Ctrl-C does: an exception that unwinds it, removing any half-written --out.
    Python swallows an exception raised inside a finalizer (`__del__`: "Exception ignored in ..."), and
    the stage would run on: there the signal is sent again a moment later, when the finalizer is done."""
    f = frame
    while f is not None:
        if f.f_code.co_name == "__del__":
            import threading

            threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
            return
        f = f.f_back
    raise KeyboardInterrupt("terminated")


def main(argv: list[str] | None = None) -> int:
    rc = _main(argv)
    _leave_process_group()
    _exit_if_reader_blocked(rc)
    return rc


def _leave_process_group() -> None:
    """Under torchrun: destroy the process group before the interpreter exits. Left to interpreter exit, the
    group's communication threads are torn down in no set order and a rank can abort ("terminate called
    without an active exception", exit -6) after its stage has finished."""
    if "torch.distributed" not in sys.modules:
        return
    try:
        from rlkit.training import distributed

        distributed.shutdown()
    except Exception:  # noqa: BLE001 (the stage's result is decided; nothing here may change the exit code)
        pass


def _exit_if_reader_blocked(rc: int) -> None:
    """A `--follow` stage can finish while its input is still open (update reached --max-steps, the
    downstream stage ended): its reader thread then sits in a blocking read of stdin, and interpreter
    shutdown would abort on it. Flush what we wrote and leave at once instead."""
    import threading

    if not any(t.name in ("rlkit-open", "rlkit-prefetch") and t.is_alive() for t in threading.enumerate()):
        return
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    from rlkit.io import artifacts

    artifacts.flush_stdout_sink()
    os._exit(rc)


def _main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("RLKIT_DEBUG", "") not in ("", "0") or "--debug" in args
    args = [a for a in args if a != "--debug"]
    args = modernize(args, lambda line: print(line, file=sys.stderr))
    signal.signal(signal.SIGTERM, _on_sigterm)
    # Stages in a pipe share the cores: idle OpenMP threads must sleep, not spin (before torch loads).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    err = sys.stderr
    try:
        rv = command().main(args=args, prog_name="rlkit", standalone_mode=False)
        rv = rv if isinstance(rv, int) else 0
        if rv == 130:  # typer turns Ctrl-C (and our SIGTERM) into Exit(130), which click returns
            print("rlkit: interrupted; nothing half-written was left at --out", file=err)
        return rv
    except _raised("Exit") as e:
        return e.exit_code
    except _raised("ClickException") as e:
        _show_usage_error(e)
        return e.exit_code
    except (KeyboardInterrupt, *_raised("Abort")):
        if debug:
            raise
        print("rlkit: interrupted; nothing half-written was left at --out", file=err)
        return 130
    except DownstreamClosed:
        # a --follow stage whose reader ended (e.g. `update --follow --max-steps`): the run's normal end
        from rlkit.io.artifacts import drop_stdout_sink

        drop_stdout_sink()
        print("rlkit: the downstream stage ended; stopping", file=err)
        return 0
    except BrokenPipeError:
        # The downstream stage exited: stop quietly, non-zero, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("rlkit: output pipe closed by the downstream stage", file=err)
        return 141
    except RlkitError as e:
        if debug:
            raise
        print(f"rlkit: error: {e}", file=err)
        return e.exit_code
    except Exception as e:
        if debug:
            raise
        from rlkit import devices

        if devices.is_out_of_memory(e):
            oom = devices.out_of_memory(*_stage_params(args), e)
            print(f"rlkit: error: {oom}", file=err)
            return oom.exit_code
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"rlkit: unexpected {type(e).__name__}: {msg} (rerun with --debug for the traceback)", file=err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
