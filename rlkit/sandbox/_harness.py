"""The code that runs inside the sandbox: stdlib only, handed to the base interpreter as `python -I -c SOURCE`.

argv[1] is a JSON object from the host: `limits` (RLIMIT name -> value, set soft = hard), `uid` (when the
sandbox starts as root: the unprivileged uid/gid to drop to, so that RLIMIT_NPROC applies), `mode`:
- "exec": argv[2:] is a command, exec'd once the limits are set and the uid dropped (`rlkit.sandbox.spawn`);
- "harness": the program runner below. It reads one JSON object on stdin: `program` (source), `mode`
  ("stdio" or "fn"), `cases` (the tests' inputs only: the expected outputs never enter the sandbox), `fn_name`,
  `wall_s`, `output_bytes`; it writes JSON lines on stdout: {"ready": 1} first, then either
  {"syntax_error": 1} or one line per test in order, {"i": k, ...} with "stdout" (stdio), "value" (call/expr),
  "ok" (assert), or "error": "runtime_error" | "timeout" | "memory" | "wrong_answer" | "overflow".

Each stdio test runs in its own child (a fork of this process: the program compiled once, about a millisecond a
test instead of a Python start) with stdin = the test's input and stdout read up to `output_bytes`; call/expr/
assert tests run in one child that executes the program once, then evaluates each case and writes its result as
a plain JSON value on a private pipe. Everything the program prints there goes to /dev/null. A child is killed
(its process group) when it runs past the wall clock or floods its output; the host kills the whole sandbox
(its PID namespace) when this harness does not finish in time.
"""

import _signal as signal  # not `signal`: it imports enum, and json imports re; each start pays ~30 ms for them
import marshal
import os
import resource
import select
import sys
import time
from _json import encode_basestring_ascii as _jstr

MEMORY_EXIT = 86  # a child's exit status for MemoryError (the program could fake it: it only turns a 0 into a 0)


def _setup(cfg):
    for name, value in cfg["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    uid = cfg["uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    try:  # nobody else of this uid may read this process's memory or open its pipes through /proc
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:
        pass


def _json(v, depth=0):
    """v (plain data) as JSON text; TypeError for anything else: an object whose __eq__ is always True, or
    a str subclass, never leaves the sandbox as a result (type(v), not isinstance: no subclass)."""
    t = type(v)
    if depth > 100:
        raise TypeError("too deep")
    if v is None:
        return "null"
    if t is bool:
        return "true" if v else "false"
    if t is int:
        return int.__repr__(v)
    if t is float:
        return float.__repr__(v) if v == v and v not in (INF, -INF) else "NaN" if v != v else \
            "Infinity" if v > 0 else "-Infinity"
    if t is str:
        return _jstr(v)
    if t in (list, tuple):
        return "[" + ", ".join([_json(x, depth + 1) for x in v]) + "]"
    if t is dict:
        items = []
        for k, x in dict.items(v):
            if type(k) is not str:
                if type(k) not in (int, float, bool) and k is not None:
                    raise TypeError("dict key")
                k = _json(k)
            items.append(_jstr(k) + ": " + _json(x, depth + 1))
        return "{" + ", ".join(items) + "}"
    raise TypeError(t.__name__)


INF = float("inf")


def _emit(text):
    os.write(1, (text + "\n").encode())


def _close_others(keep):
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    top = soft if 0 < soft < (1 << 16) else 1 << 16
    for fd in range(3, top):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _child_stdio(code, in_r, out_w):
    """In the forked child: the program as __main__, stdin/stdout on the test's pipes. Never returns."""
    status = 1
    try:
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(in_r, 0)
        os.dup2(out_w, 1)
        os.dup2(null, 2)
        _close_others(())
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        sys.argv = ["main.py"]
        sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False)
        try:
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
            status = 0
        except SystemExit as e:
            status = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        except MemoryError:
            status = MEMORY_EXIT
        except BaseException:
            status = 1
        try:
            sys.stdout.flush()
        except MemoryError:
            status = MEMORY_EXIT
        except BaseException:
            status = status or 1
    finally:
        os._exit(status if isinstance(status, int) and 0 <= status < 256 else 1)


def _child_fn(code, job, res_w):
    """In the forked child: run the program once, then each call/expr/assert case; one JSON line per case on
    res_w (the program's own stdout and stderr go to /dev/null). Never returns."""
    import builtins

    write, plain, jstr = os.write, _json, _jstr  # taken before the program can replace them
    fresh = dict(vars(builtins))

    def out(i, key, text):
        write(res_w, f'{{"i": {i}, {jstr(key)}: {text}}}\n'.encode())

    try:
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        _close_others((res_w,))
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sys.argv = ["solution.py"]
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        g = {"__name__": "solution", "__builtins__": dict(fresh)}
        try:
            exec(code, g)
        except MemoryError:
            out(0, "error", '"memory"')
            os._exit(0)
        except BaseException:  # sys.exit() included: the tests did not run
            out(0, "error", '"runtime_error"')
            os._exit(0)
        fn_name = job.get("fn_name")
        for i, (kind, inp) in enumerate(job["cases"]):
            try:
                ns = {**g, "__builtins__": dict(fresh)}  # the test's own names: builtins as they were
                if kind == "call":
                    fn = g.get(fn_name)
                    if fn is None and "Solution" in g:
                        fn = getattr(g["Solution"](), fn_name)
                    if fn is None:
                        raise NameError(fn_name)
                    value = fn(*inp) if type(inp) is list else fn(inp)
                elif kind == "expr":
                    value = eval(compile(inp, "<test>", "eval"), ns)
                else:
                    try:
                        exec(compile(inp, "<test>", "exec"), ns)
                        value = True
                    except AssertionError:
                        value = False
                try:
                    res = ("ok", "true") if kind == "assert" else ("value", plain(value))
                except TypeError:
                    res = ("error", '"wrong_answer"')
                if kind == "assert" and value is not True:
                    res = ("error", '"wrong_answer"')
            except MemoryError:
                res = ("error", '"memory"')
            except BaseException:
                res = ("error", '"runtime_error"')
            try:
                out(i, *res)
            except MemoryError:
                out(i, "error", '"memory"')
    finally:
        os._exit(0)


class _Child:
    """A forked child, the read end of its output pipe and what has been read from it."""

    def __init__(self, pid, out_r, in_w=None, data=b""):
        self.pid, self.out_r, self.in_w, self.data = pid, out_r, in_w, data
        self.buf = bytearray()
        self.status = None

    def kill(self):
        for target in (lambda: os.killpg(self.pid, signal.SIGKILL), lambda: os.kill(self.pid, signal.SIGKILL)):
            try:
                target()
            except OSError:
                pass
        if self.status is None:
            self.status = os.waitpid(self.pid, 0)[1]


def _pump(child, deadline, cap, wake_r, on_line=None):
    """Feed the child's stdin and read its stdout until it exits, floods (> cap bytes: "overflow"), or the
    deadline passes ("timeout"); returns None when it exited on its own. on_line(bytes) -> False stops early."""
    os.set_blocking(child.out_r, False)
    if child.in_w is not None and not child.data:
        os.close(child.in_w)
        child.in_w = None
    if child.in_w is not None:
        os.set_blocking(child.in_w, False)
    sent = 0
    while True:
        pid, status = os.waitpid(child.pid, os.WNOHANG)
        if pid:
            child.status = status
            _drain(child, cap)
            break
        left = deadline - time.monotonic()
        if left <= 0:
            child.kill()
            return "timeout"
        rs = [child.out_r, wake_r]
        ws = [child.in_w] if child.in_w is not None else []
        r, w, _ = select.select(rs, ws, [], min(left, 1.0))
        if wake_r in r:
            try:
                os.read(wake_r, 512)
            except BlockingIOError:
                pass
        if w:
            try:
                sent += os.write(child.in_w, child.data[sent:sent + 65536])
            except BlockingIOError:
                pass
            except OSError:  # it closed its stdin
                sent = len(child.data)
            if sent >= len(child.data):
                os.close(child.in_w)
                child.in_w = None
        if child.out_r in r:
            _drain(child, cap, once=True)
        if len(child.buf) > cap:
            child.kill()
            return "overflow"
        if on_line is not None and not on_line(child):
            child.kill()
            return None
    if len(child.buf) > cap:
        return "overflow"
    return None


def _drain(child, cap, once=False):
    while True:
        try:
            chunk = os.read(child.out_r, 65536)
        except (BlockingIOError, InterruptedError):
            return "more"
        if not chunk:
            return "eof"
        child.buf += chunk
        if len(child.buf) > cap or once:
            return "more"


def _status_reason(status):
    if os.WIFSIGNALED(status):
        return "timeout" if os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL) else "runtime_error"
    code = os.WEXITSTATUS(status)
    return None if code == 0 else "memory" if code == MEMORY_EXIT else "runtime_error"


def _run_stdio(code, job, deadline, wake_r):
    cap = job["output_bytes"]
    for i, inp in enumerate(job["cases"]):
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _child_stdio(code, in_r, out_w)
        os.close(in_r)
        os.close(out_w)
        data = (inp if isinstance(inp, str) else "\n".join(map(str, inp))).encode("utf-8", "surrogatepass")
        child = _Child(pid, out_r, in_w, data)
        bad = _pump(child, deadline, cap, wake_r)
        for fd in (child.out_r, child.in_w):
            if fd is not None:
                os.close(fd)
        try:  # daemons it started in its own group
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if bad is None:
            bad = _status_reason(child.status)
        if bad is not None:
            _emit(f'{{"i": {i}, "error": "{bad}"}}')
            if bad == "timeout":
                return
            continue
        _emit(f'{{"i": {i}, "stdout": {_jstr(child.buf.decode("utf-8", "replace"))}}}')


def _run_fn(code, job, deadline, wake_r):
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(res_r)
        _child_fn(code, job, res_w)
    os.close(res_w)
    n = len(job["cases"])
    cap = job["output_bytes"]
    state = {"next": 0}

    def on_line(child):  # forwards whole lines; the host parses them (JSON) and checks their order
        while b"\n" in child.buf:
            line, _, rest = bytes(child.buf).partition(b"\n")
            child.buf[:] = rest
            os.write(1, line + b"\n")
            state["next"] += 1
            if state["next"] >= n:
                return False
        return True

    child = _Child(pid, res_r)
    bad = _pump(child, deadline, cap, wake_r, on_line)
    if bad is None and state["next"] < n:
        on_line(child)
    os.close(res_r)
    exited = child.status  # it ended on its own before the tests were done: how (SIGXCPU: CPU limit, a timeout)
    child.kill()
    if state["next"] < n:
        if bad is None and exited is not None:
            bad = _status_reason(exited)
        _emit(f'{{"i": {state["next"]}, "error": "{bad or "runtime_error"}"}}')


def main():
    # argv: MODE UID|- NAME=VALUE,... [COMMAND...]
    mode, uid, limits = sys.argv[1:4]
    _setup({"uid": None if uid == "-" else int(uid),
            "limits": {k: int(v) for k, v in (kv.split("=") for kv in limits.split(","))}})
    if mode == "exec":
        argv = sys.argv[4:]
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.execvp(argv[0], argv)
    _emit('{"ready": 1}')
    job = marshal.loads(sys.stdin.buffer.read())
    start = time.monotonic()
    deadline = start + max(0.05, job["wall_s"] - 0.1)
    try:
        code = compile(job["program"], "main.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        _emit('{"syntax_error": 1}')
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    if job["mode"] == "stdio":
        _run_stdio(code, job, deadline, wake_r)
    else:
        _run_fn(code, job, deadline, wake_r)


if __name__ == "__main__":
    main()
