"""The process a sandboxed `--reward-fn` runs in (`rlkit.sandbox.workers`): standard library only, so the
sandbox needs no view of rlkit itself. The host runs this file's text with `python -I -c TEXT`
inside the sandbox and sends CONFIG as the first line on stdin (JSON): where the function is, and for a
file its source text (the one the host imported; as root, the sandbox's uid may not read a 0700 folder).

Start-up: the worker imports the function as rlkit does on the host (a file under the private module
name `_rlkit_user_<digest>_<stem>` with its folder appended to `sys.path`, or a module by name), then
writes one line: `{"ready": true}` or `{"error": "Type: message"}`.

Then one JSON line per call on stdin, `{"kwargs": {...}, "n": N}` (N: the rows of a batched call, null
for one row), and one JSON line back on stdout per call:
- `{"values": [v, ...]}`: each v a float, or `{"bad": repr}` for a value that is not a finite number;
- `{"badlen": "3 values"}`: a batched function returned the wrong number of values (or not a sequence);
- `{"error": "Type: message"}`: the function raised (SystemExit included);
- `{"died": "its call was killed by SIGXCPU (CPU time limit)"}`: the call's process ended without a result.

Each call runs in its own process, forked from the worker after the import: what one row's code does to
the interpreter (patched modules, replaced builtins, threads, a spent CPU limit) cannot reach another
row's call, and the CPU time limit (RLIMIT_CPU, CONFIG's `cpu_s`) counts per call. The call's process
has no handle on the protocol pipes (closed, stdin from /dev/null, its prints go to stderr), and the
worker makes itself non-dumpable so that the call (same uid) cannot reach them through /proc either.
After each call the worker kills what is left of the call's process group and, in a sandbox with a PID
namespace of its own (bwrap; never on the host), every other process of the sandbox but its init.
"""

import base64
import hashlib
import importlib.util
import json
import math
import numbers
import os
import re
import resource
import select
import signal
import site
import sys

RESULT_CAP = 64 << 20  # bytes a call's result may take
_libc = None  # ctypes' libc, for prctl (set by main)
_sweep = False  # after each call, kill every other process of the sandbox (set by main: a PID namespace of its own)


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` (rlkit.plugins.user_code.one_line)."""
    if isinstance(e, SyntaxError) and e.lineno:
        return f"{type(e).__name__}: {e.msg} (line {e.lineno})"
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__


def as_number(value: object):
    """rlkit.plugins.user_code.as_number: a finite real number as a float, else None."""
    if not isinstance(value, numbers.Real):
        size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
        if size != 1 or not callable(getattr(value, "item", None)):
            return None
        value = value.item()
        if not isinstance(value, numbers.Real):
            return None
    v = float(value)
    return v if math.isfinite(v) else None


def _value(v: object):
    x = as_number(v)
    return {"bad": repr(v)[:60]} if x is None else x


def load(cfg: dict):
    for d in cfg.get("site_dirs", ()):
        if d not in sys.path:
            site.addsitedir(d)
    if cfg["is_file"]:
        path, data = cfg["source"], base64.b64decode(cfg["data"])  # what the host read: the folder may be closed to us
        stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        digest = hashlib.sha1(path.encode() + b"\0" + data).hexdigest()[:12]
        key = f"_rlkit_user_{digest}_{stem}"  # the module name rlkit.plugins.user_code gives it on the host
        mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(key, loader=None, origin=path))
        mod.__file__ = path
        folder = os.path.dirname(path)
        if folder not in sys.path:
            sys.path.append(folder)
        sys.modules[key] = mod
        exec(compile(data, path, "exec"), mod.__dict__)  # bytes: its coding declaration holds
    else:
        for d in cfg.get("paths", ()):
            if d not in sys.path:
                sys.path.append(d)
        mod = importlib.import_module(cfg["source"])
    return getattr(mod, cfg["name"])


def result(fn, req: dict) -> dict:
    out = fn(**req["kwargs"])
    n = req.get("n")
    if n is None:
        return {"values": [_value(out)]}
    if isinstance(out, str | bytes) or not hasattr(out, "__len__") or len(out) != n:
        got = f"{len(out)} values" if hasattr(out, "__len__") and not isinstance(out, str | bytes) else repr(out)[:60]
        return {"badlen": got}
    return {"values": [_value(v) for v in out]}


def _died(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        why = {signal.SIGXCPU: " (CPU time limit)", signal.SIGXFSZ: " (file size limit)"}.get(sig, "")
        return f"its call was killed by {signal.Signals(sig).name}{why}"
    return f"its call exited with status {os.WEXITSTATUS(status)} without a result"


def call(fn, req: dict, proto: tuple[int, int], cpu_s: int | None) -> dict:
    """`fn` on one request in a forked process: its reply (see the module docstring)."""
    r, w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the call's process: never returns
        try:
            os.close(r)
            os.setpgid(0, 0)  # what the call starts is killed with its group after the call
            if _libc is not None:
                _libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: dies with the worker (host kills)
            if os.getppid() != parent:  # the worker died before the line above
                os._exit(1)
            for fd in proto:
                os.close(fd)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            if cpu_s:
                _, hard = resource.getrlimit(resource.RLIMIT_CPU)
                cap = cpu_s if hard == resource.RLIM_INFINITY else min(cpu_s, hard - 1)
                resource.setrlimit(resource.RLIMIT_CPU, (cap, cap + 1))  # SIGXCPU at cap, SIGKILL a second later
            msg = result(fn, req)
        except BaseException as e:  # noqa: BLE001 (SystemExit and KeyboardInterrupt too: all are the function's)
            msg = {"error": one_line(e)}
        try:
            for f in (sys.stdout, sys.stderr):  # its prints, before os._exit
                try:
                    f.flush()
                except Exception:  # noqa: BLE001
                    pass
            data = json.dumps(msg).encode() + b"\n"
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
        finally:
            os._exit(0)
    os.close(w)
    buf, status = _result_line(r, pid)
    os.close(r)
    if status is None:
        _, status = os.waitpid(pid, 0)
    try:
        os.killpg(pid, signal.SIGKILL)  # whatever the call left running in its group
    except OSError:
        pass
    if _sweep:
        try:
            os.kill(-1, signal.SIGKILL)  # in the sandbox's own PID namespace: all but this worker and init
        except OSError:
            pass
    if status == 0 and b"\n" in buf:
        try:
            msg = json.loads(buf[:buf.index(b"\n")])
            if isinstance(msg, dict):
                return msg
        except ValueError:
            pass
    return {"died": _died(status)}


def _result_line(r: int, pid: int) -> tuple[bytearray, int | None]:
    """(what the call wrote on its result pipe, up to its first newline; its wait status once it exited, or
    None). Stops at the line, or when the call's process ended (a process it left may hold the pipe open)."""
    buf, status = bytearray(), None
    os.set_blocking(r, False)
    while b"\n" not in buf and len(buf) <= RESULT_CAP:
        if not select.select([r], [], [], 0.05)[0]:
            done, st = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            status = st  # exited: all it wrote is in the pipe
        try:
            b = os.read(r, 1 << 16)
        except BlockingIOError:
            b = None
        if b:
            buf += b
        elif status is not None or b == b"":
            break
    return buf, status


def main() -> None:
    proto_in, proto_out = os.dup(0), os.dup(1)
    requests = os.fdopen(proto_in, "rb")
    cfg = json.loads(requests.readline())
    os.dup2(2, 1)  # the function's prints go to stderr; stdout is the protocol's
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    global _libc, _sweep
    try:  # CONFIG asks for it (bwrap), and this is not the host's PID namespace (kill(-1) there would be a disaster)
        _sweep = bool(cfg.get("sweep")) and os.readlink("/proc/self/ns/pid") != cfg.get("host_pidns")
    except OSError:
        _sweep = False
    try:
        import ctypes

        _libc = ctypes.CDLL(None)
        _libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: /proc/<worker>/fd closed to the calls
    except Exception:  # noqa: BLE001 (hardening where the platform allows it)
        _libc = None
    out = os.fdopen(proto_out, "w", buffering=1)
    try:
        fn = load(cfg)
    except BaseException as e:  # noqa: BLE001
        out.write(json.dumps({"error": one_line(e)}) + "\n")
        return
    out.write('{"ready": true}\n')
    for line in requests:
        out.write(json.dumps(call(fn, json.loads(line), (proto_in, proto_out), cfg.get("cpu_s"))) + "\n")


if __name__ == "__main__":
    main()
