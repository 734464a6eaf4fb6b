"""A fork server for the tests' `rlkit` processes: most of a stage's start-up is importing torch and
transformers (about 4 of its 5 seconds on a 2-core CPU), and the suite starts some hundreds of them.

`python tests/zygote.py serve SOCKET` imports the third-party libraries every stage imports (never rlkit
itself, so each command runs the working tree's code and reads its environment afresh) and waits. The
client, `python -S tests/zygote.py ARGS...` (what `run_cli` and the recipes' `rlkit` run), sends its
argument list, environment and working directory and passes its stdin, stdout and stderr (SCM_RIGHTS);
the server forks a monitor, which forks the command: `python -m rlkit ARGS` from a fresh fork of the
imported interpreter, on the caller's own file descriptors, so pipes, EOF, SIGPIPE and exit codes are the
real ones. The monitor hands on SIGTERM/SIGINT/SIGHUP the client receives, kills the command when the
client dies (a timeout's SIGKILL), and reports how the command ended; the client ends the same way (exit
code, or death by the same signal).

The client runs the command itself (`os.execv` of `python -m rlkit`) when no server answers or when its
environment differs from the server's in a variable a library reads at import (HF_*, TORCH*, OMP_*, ...).
Tests about a process as such (its start-up imports, SIGKILL, its memory, its process tree) start real
processes with `rlkit_cmd()`."""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import sys

ENV = "RLKIT_TEST_ZYGOTE"  # the server's socket path, for the client
# Variables that torch, transformers, safetensors or the interpreter read as they load (the libraries the
# server imports): a client whose value differs from what the server's imports saw runs in a fresh
# interpreter. rlkit's own (RLKIT_*) and those of libraries the server does not import (VLLM_*, DATASETS_*)
# are read in the command's process, as in any other. TRANSFORMERS_VERBOSITY is rlkit's to set at run time
# (`rlkit.console.set_level` applies it to a transformers already loaded).
IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA", "NVIDIA",
               "PYTHON", "TOKENIZERS", "LD_", "NCCL", "GLOO", "SAFETENSORS", "TRITON", "MALLOC", "HOME", "XDG_",
               "TMP", "TEMP", "LANG", "LC_")
RUN_TIME = ("TRANSFORMERS_VERBOSITY",)
FALLBACKS = "RLKIT_TEST_ZYGOTE_FALLBACKS"  # a file each fresh-interpreter run appends its reason to, when set


def differs(env: dict, server: dict, added: dict) -> str | None:
    """The first variable of `env` that the server's imports saw otherwise, or None. `server`: the server's
    environment as its imports saw it; `added`: what it (or rlkit's start) set there, which a command that
    lacks it gets as its own process would."""
    for k in sorted({*env, *server}):
        if not k.startswith(IMPORT_TIME) or k in RUN_TIME:
            continue
        if env.get(k) != server.get(k) and not (k not in env and k in added):
            return k
    return None


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _send(sock: socket.socket, obj: dict, fds: list[int] = ()) -> None:
    data = json.dumps(obj).encode()
    msg = struct.pack("!I", len(data)) + data
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([msg], anc)


def _recv_exact(sock: socket.socket, n: int, fds: list[int] | None = None) -> bytes:
    buf = b""
    while len(buf) < n:
        if fds is not None and not buf:
            chunk, anc, _flags, _addr = sock.recvmsg(n, socket.CMSG_SPACE(3 * array.array("i").itemsize))
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(data[: len(data) - len(data) % a.itemsize])
                    fds.extend(a)
        else:
            chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _recv(sock: socket.socket, fds: list[int] | None = None) -> dict:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4, fds))
    return json.loads(_recv_exact(sock, n))


# -- the client


def _alone(args: list[str], why: str) -> None:
    log = os.environ.get(FALLBACKS)
    if log:
        with open(log, "a") as f:
            f.write(f"{why}: rlkit {' '.join(args)[:200]}\n")
    os.execv(sys.executable, [sys.executable, "-m", "rlkit", *args])


def client(args: list[str]) -> None:
    path = os.environ.get(ENV)
    if not path:
        _alone(args, "no server")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        hello = _recv(sock)
    except (OSError, EOFError, ValueError) as e:
        sock.close()
        _alone(args, f"no answer ({e})")
    env = dict(os.environ)
    k = differs(env, hello["env"], hello["added"])
    if k is not None:
        sock.close()
        _alone(args, f"{k} differs")
    pending: list[int] = []
    for s in FORWARDED:
        signal.signal(s, lambda n, _f: pending.append(n))
    _send(sock, {"argv": args, "env": env, "cwd": os.getcwd()}, [0, 1, 2])
    null = os.open(os.devnull, os.O_RDWR)  # the command holds the ends now: EOF and SIGPIPE are its own
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    for s in FORWARDED:  # from here on a signal goes straight to the monitor, which sends it on
        signal.signal(s, lambda n, _f: sock.sendall(b"S" + bytes([n])))
    for n in pending:
        sock.sendall(b"S" + bytes([n]))
    try:
        end = _recv(sock)
    except (OSError, EOFError, ValueError):
        os._exit(70)
    if "signal" in end:
        for s in FORWARDED:
            signal.signal(s, signal.SIG_DFL)
        signal.signal(end["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), end["signal"])
    os._exit(end["exit"])


# -- the server


def _preload() -> None:
    import rich.console  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import typer  # noqa: F401
    from transformers import (  # noqa: F401
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        generation,
    )


def _monitor(conn: socket.socket, job: dict, fds: list[int]) -> dict:
    """In the monitor (a child of the server): fork the command, hand it the client's signals, tell the client
    how it ended, and end. -> the job, in the command's process alone."""
    import select

    pid = os.fork()
    if pid == 0:
        conn.close()
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        return job
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    buf = b""
    while True:
        ready, _, _ = select.select([conn, pidfd], [], [])
        if pidfd in ready:
            break
        data = conn.recv(64)
        if not data:  # the client died (SIGKILL, a test's timeout): so does the command
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os._exit(0)
        buf += data
        while len(buf) >= 2:  # b"S" + the signal's number, for each signal the client got
            os.kill(pid, buf[1])
            buf = buf[2:]
    _, status = os.waitpid(pid, 0)
    end = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.waitstatus_to_exitcode(status)}
    try:
        _send(conn, end)
    except OSError:
        pass
    os._exit(0)


def serve(path: str, lifeline: int) -> dict:
    """Leave the caller's process tree, preload, then answer clients until `lifeline` (a pipe's read end whose
    write end the pytest process holds) reaches EOF. -> the job, in a command's process."""
    import select

    if os.fork():  # the caller reaps this one; the server is nobody's descendant in the tests' process trees
        os._exit(0)
    before = dict(os.environ)
    # what `rlkit.cli` sets before torch loads, which OpenMP reads as it loads: idle threads sleep, not spin
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _preload()
    env = dict(os.environ)  # as the imports saw it (more or less: what they set is in it too)
    added = {k: v for k, v in env.items() if k not in before}  # OMP_WAIT_POLICY, TORCHINDUCTOR_CACHE_DIR
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the monitors are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # clients see the socket only once it answers
    while True:
        if lifeline in select.select([listener, lifeline], [], [])[0]:
            listener.close()
            os.unlink(path)
            os._exit(0)
        conn, _ = listener.accept()
        try:
            _send(conn, {"env": env, "added": added})
            fds: list[int] = []
            job = _recv(conn, fds)
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        if len(fds) != 3:
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        if os.fork() == 0:
            listener.close()
            os.close(lifeline)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            job = _monitor(conn, job, fds)
            job["added"] = added
            return job
        conn.close()
        for fd in fds:
            os.close(fd)


def run_job(job: dict) -> None:
    """In the command's process: become `python -m rlkit ARGV` run from CWD with ENV."""
    import runpy

    # the signals of a fresh interpreter started with them at their defaults (`conftest.default_signals`)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    for k, v in job["added"].items():  # as the imports set them in a process of its own
        os.environ.setdefault(k, v)
    sys.path.insert(0, job["cwd"])  # as `python -m` puts it
    sys.argv = [sys.argv[0], *job["argv"]]
    sys.orig_argv = [sys.executable, "-m", "rlkit", *job["argv"]]
    runpy.run_module("rlkit", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # tests/ (tests/vllm would hide vllm); the command gets `python -m`'s own
    if sys.argv[1:2] == ["serve"]:
        with open(os.devnull, "rb") as null_in:
            os.dup2(null_in.fileno(), 0)
        run_job(serve(sys.argv[2], int(sys.argv[3])))
    else:
        client(sys.argv[1:])
