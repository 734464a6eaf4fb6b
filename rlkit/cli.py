"""The `rlkit` command: every stage registered in one place.

Stage modules import only typer and the standard library at top level (torch and transformers load
inside `run`), so `rlkit --help` stays instant. Errors print as one line; `--debug` (anywhere on the
command line) or RLKIT_DEBUG=1 shows the traceback instead. A bad command line gets click's own usage
message and exit 2, and so does NaN or inf given to any float option (`command()`).
"""

from __future__ import annotations

import errno
import functools
import math
import os
import signal
import sys
import typing

import typer

from rlkit import __version__, config_file
from rlkit.errors import DownstreamClosed, RlkitError
from rlkit.options import ConfigFile, LogLevel, Quiet, modernize
from rlkit.stages import (
    build_prefs,
    cat,
    freeze_ref,
    inspect,
    plan,
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

# the commands in `rlkit --help`'s order: a stage's command is its module's `command`
for _stage in (prompts, sft, build_prefs, train_rm, freeze_ref, rollout, score_ref, update, eval_stage, inspect, report,
               cat):
    app.command(_stage.__name__.rpartition(".")[2].replace("_", "-"))(_stage.command)
# the stage's own options pass through to it (parsed by the stage's command)
app.command("plan", context_settings={"ignore_unknown_options": True})(plan.command)


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
    - every integer option without a range of its own refuses values beyond INT_LIMIT (a 23-digit --n would
      otherwise reach torch and overflow there, after the model has loaded);
    - every command takes `--config FILE` (rlkit.config_file): the file's values become the command's
      defaults (click's `default_map`), so the command line wins over the file; and `--log-level`, `-q`;
      an error about a value from the file names the file;
    - every command records its options, as given or defaulted, in the manifests it writes;
    - the options are grouped in --help by the panel each declares (options.PANELS); a flag shows no
      `<bool>` value, and help texts print as written (rich would read `rlkit[track]` as markup and drop it)."""
    global _COMMAND
    if _COMMAND is None:
        group = typer.main.get_command(app)
        config, log_level, quiet = _shared_options()
        for cmd in getattr(group, "commands", {}).values():
            if not any("--config" in getattr(p, "opts", ()) for p in cmd.params):  # inspect's own --config flag
                cmd.params.insert(0, config)
            cmd.params += [log_level, quiet]
            cmd.callback = _recording(cmd)
        seen: set[int] = set()  # the shared options are one object in every command
        for cmd in (group, *getattr(group, "commands", {}).values()):
            _plain_help(cmd)
            for p in cmd.params:
                if id(p) not in seen:
                    seen.add(id(p))
                    _harden(p)
        _COMMAND = group
    return _COMMAND


# The largest integer an option takes unless it declares its own range: every count, size and seed fits
# (torch, numpy and vLLM take 32-bit values in places), and click refuses more before anything runs.
INT_LIMIT = 2**31 - 1


def _harden(p) -> None:
    """One click parameter: its value checks (finite floats, bounded integers), its errors naming the
    --config file a value came from, no `<bool>` metavar on a flag, its help text printed as written."""
    floats, ints = _takes(p, float), _takes(p, int)
    if floats or ints:
        high = getattr(p, "max", None) if hasattr(p, "max") else getattr(getattr(p, "type", None), "max", None)
        low = getattr(p, "min", None) if hasattr(p, "min") else getattr(getattr(p, "type", None), "min", None)
        p.callback = _checked(p.callback, ints and high is None, ints and low is None)
    p.process_value = _naming_the_file(p, p.process_value)
    if getattr(p, "is_flag", False) and getattr(p, "metavar", None) is None:
        p.metavar = ""  # typer >= 0.2x shows `<bool>` for a flag, as if it took a value
    if getattr(p, "help", None):
        p.help = _escaped(p.help)


def _plain_help(cmd) -> None:
    """`cmd`'s own help and that of its --help option, printed as written, the flag without `<bool>`."""
    for attr in ("help", "short_help"):
        if getattr(cmd, attr, None):
            setattr(cmd, attr, _escaped(getattr(cmd, attr)))
    try:
        h = cmd.get_help_option(typer.Context(cmd))  # created once and kept by typer's click
    except Exception:  # noqa: BLE001 (only for how --help looks)
        h = None
    if h is not None and getattr(h, "metavar", None) is None:
        h.metavar = ""


def _escaped(text: str) -> str:
    """`text` with rich's markup escaped where typer renders help as rich markup: `pip install 'rlkit[track]'`
    and `NAME[:CONFIG][@SPLIT]` print as written."""
    if "[" not in text or getattr(app, "rich_markup_mode", None) != "rich":
        return text
    from rich.markup import escape

    return escape(text)


def _naming_the_file(param, process_value):
    """`param.process_value`, whose usage error says which --config file the value came from, when it did."""

    def process(ctx, value):
        try:
            return process_value(ctx, value)
        except _raised("UsageError") as e:
            source = ctx.get_parameter_source(param.name) if param.name else None
            path = ctx.meta.get(config_file.META_KEY)
            if path and getattr(source, "name", "") == "DEFAULT_MAP" and hasattr(e, "message"):
                e.message = f"{e.message} (from --config {path})"
            raise

    return process


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
        from rlkit.io.manifests import command_options  # pyarrow: loaded when a stage runs, not for --help

        try:
            with command_options({keys.get(k, k): v for k, v in kwargs.items()}):
                return inner(**kwargs)
        except OSError as e:  # click's main would make a closed pipe a silent exit 1
            if e.errno == errno.EPIPE:
                raise PipeClosed(str(e)) from e
            raise
        except SystemExit as e:  # a library's sys.exit() inside the stage: not a silent exit with its code
            raise StageExit(f"sys.exit({e.code!r}) was called inside the stage") from e

    return run


class PipeClosed(Exception):  # noqa: N818 (a signal, not a failure)
    """The reader of our output exited (EPIPE), carried past click's main as something other than OSError."""


class StageExit(Exception):  # noqa: N818
    """SystemExit raised by code a stage called (a library), carried to `_main` to be reported in one line."""


def _takes(param, kind: type) -> bool:
    """Whether `param`'s value is (or holds) a `kind` (float or int)."""
    desc = getattr(param, "type_descriptor", None)  # typer >= 0.2x: the annotation (`float | None` reads float)
    if desc is not None:
        return _has(desc.annotation, kind)
    t = getattr(param, "type", None)  # typer on click's own types: FLOAT, FloatRange, a Tuple of them
    name = {float: "float", int: "integer"}[kind]
    return any(getattr(x, "name", "").startswith(name) for x in (t, *getattr(t, "types", ())))


def _has(annotation, kind: type) -> bool:
    return annotation is kind or any(_has(a, kind) for a in typing.get_args(annotation))


def _checked(callback, high: bool, low: bool):
    """A parameter callback (click calls it with the converted value) that refuses NaN and inf, and an
    integer above INT_LIMIT (`high`) or below -INT_LIMIT - 1 (`low`), then runs the parameter's own
    `callback`, if any."""

    def check(ctx, param, value):
        for v in _flat(value):
            if isinstance(v, float) and not math.isfinite(v):
                raise typer.BadParameter(f"'{v}' is not a finite number", ctx=ctx, param=param)
            if isinstance(v, int) and not isinstance(v, bool):
                if high and v > INT_LIMIT:
                    raise typer.BadParameter(f"{v} is larger than {INT_LIMIT}, the largest integer it takes",
                                             ctx=ctx, param=param)
                if low and v < -INT_LIMIT - 1:
                    raise typer.BadParameter(f"{v} is smaller than {-INT_LIMIT - 1}, the smallest integer it takes",
                                             ctx=ctx, param=param)
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
    if errors and isinstance(getattr(e, "message", None), str):  # pydantic prefixes a validator's own words
        e.message = e.message.replace("Value error, ", "", 1)
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
    from rlkit import startup

    startup.pause(_command_name(sys.argv[1:] if argv is None else argv))  # until the stage's model is loaded
    try:
        rc = _main(argv)
    finally:
        startup.finish()
    if rc and _rank() is not None:
        _exit_now(rc)  # a failed rank: its peers may be stuck in a collective that tearing down would wait on
    _leave_process_group()
    if _rank() is not None:
        # a torchrun rank whose stage has finished (its outputs written, the ranks past their last barrier): leave
        # without the interpreter's teardown, whose C++ destructors (the process group's and FSDP's threads) can
        # abort a rank ("terminate called without an active exception", exit -6) after a successful stage
        _exit_now(rc)
    _exit_if_reader_blocked(rc)
    if argv is None:  # the process's own command line (the `rlkit` command, `python -m rlkit`)
        _exit_without_teardown(rc)
    return rc


def _command_name(args: list[str]) -> str | None:
    """The command a command line runs (its first word that is not an option), or None."""
    return next((a for a in args if not a.startswith("-")), None)


def _exit_without_teardown(rc: int) -> None:
    """End a stage process that loaded torch without the interpreter's teardown: its outputs are written and
    closed by now, and freeing the ~2,500 modules torch and transformers bring, one object at a time, takes a
    second or more of CPU (more while a pipe's other stages share the cores). What an exit does for others still
    happens: the `atexit` handlers run (trackers, logging, temporary directories, vLLM's shutdown), every file still
    open for writing is flushed (a user's reward function may leave one open, which a teardown would flush), then
    stdout and stderr. A process with a thread that a normal exit would wait for (not a daemon) exits normally."""
    import atexit
    import gc
    import io
    import threading

    if "torch" not in sys.modules:
        return  # a light command: its teardown is quick
    main_thread = threading.main_thread()
    if any(t is not main_thread and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()
    # by type alone: isinstance() would read `__class__` of every object, which some (deprecated torch names) warn on
    files = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for f in gc.get_objects():
        if issubclass(type(f), files):
            try:
                if not f.closed:
                    f.flush()
            except (OSError, ValueError):
                pass
    _exit_now(rc)


def _rank() -> int | None:
    """This process's rank when a launcher (torchrun) started it as one of several (WORLD_SIZE > 1), else None;
    read from the environment, without torch."""
    try:
        return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    except ValueError:
        return None


def _exit_now(rc: int) -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    if "rlkit.io.streams" in sys.modules:
        sys.modules["rlkit.io.streams"].flush_stdout_sink()
    os._exit(rc)


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
    from rlkit.io import streams

    streams.flush_stdout_sink()
    os._exit(rc)


def _main(argv: list[str] | None = None) -> int:
    from rlkit import startup

    args = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("RLKIT_DEBUG", "") not in ("", "0") or "--debug" in args
    args = [a for a in args if a != "--debug"]
    rank = _rank()  # under torchrun every rank runs this same command line; rank 0 alone talks
    if rank:
        from rlkit import console

        console.silence()
    args = modernize(args, lambda line: None if rank else print(line, file=sys.stderr))
    signal.signal(signal.SIGTERM, _on_sigterm)
    if _command_name(args) != "update":  # update sets its own, from its options
        startup.threads()  # OpenMP's wait policy, before torch loads
    err = sys.stderr
    has_out = any(a == "--out" or a.startswith("--out=") for a in args)  # a command that writes nothing says less
    interrupted = "rlkit: interrupted" + ("; nothing half-written was left at --out" if has_out else "")
    try:
        rv = command().main(args=args, prog_name="rlkit", standalone_mode=False)
        rv = rv if isinstance(rv, int) else 0
        if rv == 130 and not rank:  # typer turns Ctrl-C (and our SIGTERM) into Exit(130), which click returns
            print(interrupted, file=err)
        return rv
    except _raised("Exit") as e:
        return e.exit_code
    except _raised("ClickException") as e:
        return _fail(e.exit_code, "Error: ", e.format_message(), rank, show=functools.partial(_show_usage_error, e))
    except (KeyboardInterrupt, *_raised("Abort")):
        if debug:
            raise
        if not rank:
            print(interrupted, file=err)
        return 130
    except DownstreamClosed:
        # a --follow stage whose reader ended (e.g. `update --follow --max-steps`): the run's normal end
        from rlkit.io.streams import drop_stdout_sink

        drop_stdout_sink()
        print("rlkit: the downstream stage ended; stopping", file=err)
        return 0
    except (BrokenPipeError, PipeClosed):
        # The downstream stage exited: stop, with the shell's code for SIGPIPE, and keep Python from
        # complaining at exit about what is still buffered for the closed pipe.
        if "rlkit.io.streams" in sys.modules:
            sys.modules["rlkit.io.streams"].drop_stdout_sink()
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("rlkit: output pipe closed by the downstream stage", file=err)
        return 141
    except RlkitError as e:
        if debug:
            raise
        return _fail(e.exit_code, "rlkit: error: ", str(e), rank)
    except StageExit as e:
        if debug:
            raise
        return _fail(1, "rlkit: unexpected exit: ", f"{e} (rerun with --debug for the traceback)", rank)
    except Exception as e:
        if debug:
            raise
        from rlkit import devices

        if devices.is_out_of_memory(e):
            oom = devices.out_of_memory(*_stage_params(args), e)
            return _fail(oom.exit_code, "rlkit: error: ", str(oom), rank)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return _fail(1, f"rlkit: unexpected {type(e).__name__}: ", f"{msg} (rerun with --debug for the traceback)", rank)


def _fail(code: int, head: str, text: str, rank: int | None, show=None) -> int:
    """Print `head + text` on stderr (or call `show`, which prints it in full: click's usage message) and
    return `code`. Under torchrun (`rank` not None) the ranks that fail together agree first
    (distributed.agree_on_failure): rank 0 alone prints, and every rank returns the same code, so that no
    rank's exit ends another (torchrun stops the rest at the first exit); a rank failing alone prints its
    own line, marked with its rank."""
    own = head + text
    if rank is not None:
        # a peer's exit makes torchrun send SIGTERM to this rank: let it finish reporting first
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        from rlkit.training import distributed

        code, line = distributed.agree_on_failure(code, head, text)
    else:
        line = own
    if line is not None and show is not None and line == own:
        show()
    elif line is not None:
        print(line, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
