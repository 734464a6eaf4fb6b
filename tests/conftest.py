"""Shared fixtures: a real tiny SFT checkpoint (trained briefly, once per session) and CLI helpers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
from zygote import IMPORT_TIME

REPO = Path(__file__).resolve().parents[1]
# The verified-weights cache (rlkit.io.fingerprints.file_facts) of this test session, not the user's ~/.cache.
os.environ.setdefault("RLKIT_CACHE_DIR", tempfile.mkdtemp(prefix="rlkit-test-cache-"))


def rlkit_cmd() -> list[str]:
    """`rlkit` as a process of its own from a fresh interpreter: for tests about the process as such (its
    start-up, signals such as SIGKILL, its memory, its process tree)."""
    return [sys.executable, "-m", "rlkit"]


# The tests' fork server (tests/zygote.py): `rlkit` started from an interpreter that has imported torch and
# transformers already, about 4 of a stage's 5 seconds of start-up on a 2-core CPU. RLKIT_TEST_FORK_SERVER=0
# turns it off (every command a fresh interpreter).
ZYGOTE = Path(__file__).resolve().parent / "zygote.py"
_FORK_SERVER_BIN: list[Path] = []  # the directory of an `rlkit` that goes through it, while it runs


def fast_rlkit_cmd() -> list[str]:
    """`rlkit` through the fork server: a real process with its own stdin/stdout/stderr, exit code and signals
    (SIGTERM, SIGINT, SIGHUP handed on), for the tests that look at what a command does."""
    return [sys.executable, "-S", str(ZYGOTE)] if _FORK_SERVER_BIN else rlkit_cmd()


def fork_server_ready(timeout: float = 120) -> None:
    """Wait until the fork server answers (its imports take a few seconds; until then `fast_rlkit_cmd` starts
    fresh interpreters), for a test about the server itself; skip when it is turned off."""
    import time

    if not _FORK_SERVER_BIN:
        pytest.skip("RLKIT_TEST_FORK_SERVER=0: no fork server")
    sock = Path(os.environ["RLKIT_TEST_ZYGOTE"])
    deadline = time.monotonic() + timeout
    while not sock.exists():
        assert time.monotonic() < deadline, "the fork server never answered"
        time.sleep(0.1)


def rlkit_path(path: str) -> str:
    """PATH with the `rlkit` that `fast_rlkit_cmd` runs first: for recipes and scripts that call `rlkit`."""
    return os.pathsep.join([*(str(d) for d in _FORK_SERVER_BIN), str(Path(sys.executable).parent), path])


@pytest.fixture(scope="session", autouse=True)
def _fork_server():
    if os.environ.get("RLKIT_TEST_FORK_SERVER", "1") == "0":
        yield
        return
    import shutil

    d = Path(tempfile.mkdtemp(prefix="rlkit-zygote-"))
    sock = d / "socket"
    (d / "bin").mkdir()
    shim = d / "bin" / "rlkit"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{ZYGOTE}" "$@"\n')
    shim.chmod(0o755)
    r, w = os.pipe()
    with open(d / "server.log", "wb") as log:
        p = subprocess.Popen([sys.executable, str(ZYGOTE), "serve", str(sock), str(r)], pass_fds=(r,),
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    os.close(r)
    p.wait()  # the server forked away from it: it answers once its imports are done (until then, fresh ones)
    os.environ["RLKIT_TEST_ZYGOTE"] = str(sock)
    _FORK_SERVER_BIN.append(d / "bin")
    try:
        yield
    finally:
        _FORK_SERVER_BIN.clear()
        os.environ.pop("RLKIT_TEST_ZYGOTE", None)
        os.close(w)  # the server's lifeline: it ends
        shutil.rmtree(d, ignore_errors=True)


# The variables torch, transformers and the loader read as they start (zygote.IMPORT_TIME), as this session
# began. Importing vLLM in this process (an in-process engine) sets some for the process's subprocesses
# (PYTORCH_NVML_BASED_CUDA_CHECK, LD_PRELOAD from its CPU platform, LD_LIBRARY_PATH from OpenCV's import):
# they must not reach every later test's processes (nor send them past the fork server).
_IMPORT_ENV = {k: v for k, v in os.environ.items() if k.startswith(IMPORT_TIME)}


@pytest.fixture(autouse=True)
def _import_env_restored():
    yield
    for k in [k for k in os.environ if k.startswith(IMPORT_TIME) and k not in _IMPORT_ENV]:
        del os.environ[k]
    os.environ.update(_IMPORT_ENV)


def run_cli(*args: str, cwd: Path | None = None, input: bytes | None = None, env: dict | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real `rlkit` command in a subprocess (stdin is a pipe unless `input` is None), started by the
    fork server (`fast_rlkit_cmd`)."""
    e = {**os.environ, "RLKIT_DEBUG": "0", **(env or {})}
    return subprocess.run([*fast_rlkit_cmd(), *args], cwd=cwd, input=input if input is not None else b"",
                          capture_output=True, env=e, timeout=timeout)


def stage(*args: str) -> None:
    """Run one rlkit command in this process, through the CLI's own option parsing and defaults: for the
    inputs a test builds (rollouts, preferences, scored tables) but is not about. It saves a Python start
    and the torch/transformers imports, about 5 seconds a call; what a test checks runs in a subprocess."""
    from rlkit.cli import command

    rv = command().main(args=list(args), prog_name="rlkit", standalone_mode=False)
    assert rv in (None, 0), f"rlkit {' '.join(args)} exited {rv}"


# The Python warning filters of a fresh interpreter (taken before any test changes them), which an in-process
# run restores so that a warning the stage raises reaches its stderr as it would in a subprocess.
_PROCESS_WARNING_FILTERS = list(warnings.filters)


def run_cli_inproc(*args: str, input: bytes | None = None, env: dict | None = None,
                   cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run one `rlkit` command line in this process, through the CLI's own entry point and error handling
    (`rlkit.cli._main`: option parsing, the one `rlkit: error:` line, the exit code) with stdin, stdout and
    stderr on files of their own (file descriptors 0-2 and sys.stdin/stdout/stderr, so that C code's and
    children's output is caught too): a subprocess's result without a Python start and the torch imports,
    about 5 seconds a call. For bad-input cases; each test file keeps real subprocesses for what only a
    process shows (no traceback on its stderr, its exit status). `rlkit.cli.main` adds only what ends a
    process (`os._exit` under torchrun or with a --follow reader still blocked), which is why it is not
    called here; a reader thread left running fails the test instead.

    Nothing leaks from one call to the next: the environment, cwd, signal handlers, warning filters,
    logging, rlkit's console level and a claimed stdout are restored afterwards."""
    import io
    import logging
    import signal
    import threading

    from rlkit import cli, console
    from rlkit.io import streams

    e = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
         "RLKIT_DEBUG": "0", **(env or {})}
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    root = logging.getLogger()
    saved_log = (root.level, list(root.handlers))
    saved_console = (console._level, console.err, console._warnings)
    saved_sys = (sys.stdin, sys.stdout, sys.stderr)
    saved_fds = {fd: os.dup(fd) for fd in (0, 1, 2)}
    files = [tempfile.TemporaryFile() for _ in range(3)]
    files[0].write(input or b"")
    files[0].seek(0)
    try:
        for fd, f in enumerate(files):
            os.dup2(f.fileno(), fd)
        sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False))
        sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True)
        os.environ.clear()
        os.environ.update(e)
        if cwd is not None:
            os.chdir(cwd)
        with warnings.catch_warnings():
            warnings.resetwarnings()
            warnings.filters[:] = _PROCESS_WARNING_FILTERS
            warnings.showwarning = lambda m, c, f, n, file=None, line=None: sys.stderr.write(
                warnings.formatwarning(m, c, f, n, line))
            try:
                rc = cli._main(list(args))
                cli._leave_process_group()
            except SystemExit as x:
                rc = x.code if isinstance(x.code, int) else (0 if x.code is None else 1)
        # a stage that stopped early (a bad checkpoint) leaves its reader draining the rest of a file: it ends on
        # its own within moments (on a busy machine, after _main has returned); one still alive after 10 s is blocked
        readers = [t for t in threading.enumerate() if t.name in ("rlkit-open", "rlkit-prefetch")]
        deadline = time.monotonic() + 10
        for t in readers:
            t.join(max(0.0, deadline - time.monotonic()))
        blocked = [t.name for t in readers if t.is_alive()]
        assert not blocked, f"rlkit {' '.join(args)} left its reader thread running: {blocked}"
    finally:
        for f in (sys.stdout, sys.stderr):
            f.flush()
        if streams._STDOUT is not None:  # a claimed stdout: its descriptor is the stage's, not ours
            streams._STDOUT.close()
            streams._STDOUT = None
        sys.stdin, sys.stdout, sys.stderr = saved_sys
        for fd, d in saved_fds.items():
            os.dup2(d, fd)
            os.close(d)
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        for s, h in saved_signals.items():
            signal.signal(s, h)
        root.setLevel(saved_log[0])
        root.handlers[:] = saved_log[1]
        console._level, console.err, console._warnings = saved_console
    out = [(f.seek(0), f.read())[1] for f in files[1:]]
    for f in files:
        f.close()
    return subprocess.CompletedProcess(["rlkit", *args], rc, out[0], out[1])


def default_signals() -> None:
    """`preexec_fn` for a child a test will signal: SIGINT and SIGTERM at their defaults, whatever this
    process inherited (a suite started from a background job of a non-interactive shell runs with SIGINT
    ignored, and a Python child that inherits that installs no KeyboardInterrupt handler)."""
    import signal

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)


@contextlib.contextmanager
def tmpfs(d: Path, size: str):
    """A real file system of `size` (tmpfs, e.g. "4k") mounted at the new folder `d`, for out-of-space tests;
    skips the test where this process may not mount one (needs root with CAP_SYS_ADMIN)."""
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root with CAP_SYS_ADMIN")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """Bad input: non-zero exit, exactly one `rlkit: error:` line on stderr, no traceback."""
    lines = r.stderr.decode().strip().splitlines()
    assert r.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("rlkit: error:"), lines
    assert "Traceback" not in r.stderr.decode()
    return lines[0]


@pytest.fixture(scope="session")
def sft_dir(tmp_path_factory) -> Path:
    """A tiny policy after a short real SFT run (a few seconds)."""
    from rlkit.stages.sft import SftConfig, run

    out = tmp_path_factory.mktemp("ckpt") / "sft"
    run(SftConfig(out=out, num_examples=1500, eval_num=20, batch_tokens=512))
    return out


@pytest.fixture(scope="session")
def ref_dir(sft_dir, tmp_path_factory) -> Path:
    from rlkit.stages.freeze_ref import FreezeRefConfig, run

    out = tmp_path_factory.mktemp("ref") / "ref"
    run(FreezeRefConfig(policy=sft_dir, out=out, dtype="bf16"))
    return out


def untrained_checkpoint(d: Path):
    """A small tiny model (2 layers, hidden 32), untrained, saved as a checkpoint in the new folder `d`: its samples
    are noise (a program that fails, a turn that never ends). -> (model, tokenizer, d)."""
    from rlkit import tiny
    from rlkit.io import checkpoints, manifests

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tiny.TinyConfig(layers=2, hidden=32, heads=4, intermediate=64), tok, seed=0)
    d.mkdir()
    checkpoints.save_model(model, tok, d, manifests.make_manifest("model", "test", {}, {}, step=0))
    return model, tok, d


def updates_in_one_process(model, tok, cfg, tables: list[Path]):
    """The updates `rlkit update` runs, one per rollouts table, in this process with one Trainer (optimizer
    kept in memory): what N sequential `update` processes must equal. -> the TrainerState after them."""
    from rlkit.algorithms.inputs import build_batch
    from rlkit.algorithms.trainer import Trainer
    from rlkit.io import streams

    trainer = Trainer(model, cfg, tokenizer=tok)
    for src in tables:
        t, _ = streams.read_table(src, ["rollouts"])
        batch, _ = build_batch(t, tok.pad_token_id)
        trainer.train(batch, temperature=1.0, length_norm=16.0)
    return trainer.state


def make_lora_checkpoint(base: Path, out: Path, seed: int, rank: int = 4) -> Path:
    """A LoRA checkpoint on plain checkpoint `base`, saved as `update` saves one, with an adapter far from
    zero (a fresh adapter has B = 0 and computes what its base does)."""
    import torch

    from rlkit import training
    from rlkit.io import checkpoints, manifests
    from rlkit.training import LoraOptions, TrainOptions

    model, tok = checkpoints.load_policy(base)
    model = training.prepare_model(model, TrainOptions(lora=LoraOptions(rank=rank)), "causal-lm", base=base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    out.mkdir(parents=True)
    checkpoints.save_model(model, tok, out, manifests.make_manifest("model", "test", {}, {}, step=0))
    return out


@pytest.fixture(scope="session")
def vllm_ok() -> None:
    r = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no error text"])[-1]
        msg = f"vLLM does not import in this environment, vLLM engine tests NOT RUN: {why}"
        if os.environ.get("RLKIT_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        print(f"\n*** {msg} ***", file=sys.stderr)
        pytest.skip(msg)


# The longest files first: with two pytest-xdist workers (by file) they then run beside the short ones
# instead of alone at the end.
_FIRST = ("test_recipes.py", "test_installed_wheel.py", "test_vllm.py", "test_follow_vllm.py", "test_lora_vllm.py", "test_follow.py", "test_lora.py",
          "test_distributed.py")


def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    def rank(it) -> tuple[int, int]:
        return (0 if it.name.startswith("test_every_recipe_runs") else 1,
                _FIRST.index(it.path.name) if it.path.name in _FIRST else len(_FIRST))

    items.sort(key=rank)


def make_pairwise_judge(out: Path, rubric, label) -> Path:
    """A judge (`rlkit.scorers.judge`) trained in seconds by `rlkit sft --data` on 1,500 judgments under `rubric` (a
    pairwise `Rubric`) of arithmetic prompts with made-up answers of 1-3 digits, labelled by `label(a, b)` ("A" or
    "B"): e.g. the shorter answer (a content preference that holds in both orders) or always "A" (position bias)."""
    import json
    import random

    from rlkit.tasks import get_task

    rng = random.Random(0)
    data = out.with_suffix(".jsonl")
    with data.open("w") as f:
        for e in get_task("arithmetic").examples("train", 1500, 0):
            la, lb = rng.sample([1, 2, 3], 2)
            a, b = (str(rng.randint(0 if k == 1 else 10 ** (k - 1), 10 ** k - 1)) for k in (la, lb))
            f.write(json.dumps({"prompt": rubric.render(prompt=e.prompt, response_a=a, response_b=b),
                                "completion": label(a, b)}) + "\n")
    stage("sft", "--data", str(data), "--epochs", "2", "--out", str(out))
    return out


PAIRWISE_RUBRIC = Path(__file__).resolve().parents[1] / "recipes" / "rubrics" / "arithmetic-pairwise.toml"


@pytest.fixture(scope="session")
def shorter_judge(tmp_path_factory) -> Path:
    """A judge that learned, under recipes/rubrics/arithmetic-pairwise.toml, to prefer the shorter answer: a content
    preference, the same in both orders (shared by the judge tests and the RLAIF recipe's)."""
    from rlkit.scorers.judge import load_rubric

    out = tmp_path_factory.mktemp("judges") / "shorter"
    return make_pairwise_judge(out, load_rubric(PAIRWISE_RUBRIC), lambda a, b: "A" if len(a) < len(b) else "B")
