"""The Python interpreter that runs inside a sandbox for `rlkit.sandbox.interpreter`: stdlib only, started as
`python -I -S -X utf8 -c SOURCE MAX_OUTPUT CPU_S` through `rlkit.sandbox.spawn` (the limits set and the uid dropped
before it runs).

Protocol: the host's requests come on stdin, one JSON line each, `{"code": SOURCE, "id": K}`; the replies go
to stdout, one JSON line each: `{"ready": 1}` first, then per request `{"id": K, "out": TEXT, "out_cut": N,
"err": TEXT, "err_cut": N, "status": S}` (the call's stdout, its first MAX_OUTPUT characters, and stderr, its last
MAX_OUTPUT characters, with how many characters of each were cut; S the exit status: 0, 1 for an uncaught
exception, SystemExit's code). At the start the protocol's pipes move to descriptors of their own, and fds
0/1/2 become /dev/null; during a call fds 1 and 2 are anonymous in-memory files
(bounded by RLIMIT_FSIZE), read back after it.

State: every call runs in one namespace (a module `__main__`), so names defined by one call are there in the next.
A call whose last statement is an expression shows its value's repr (when not None) on stdout, as a notebook
cell does. Each call may use CPU_S seconds of CPU (the soft RLIMIT_CPU, raised per call: SIGXCPU kills the
interpreter); the host enforces the wall clock by killing the whole sandbox.
"""

import ast
import json
import os
import resource
import sys
import traceback

_FIRST_FD = 40  # where the protocol's pipes move (or 4 below RLIMIT_NOFILE when it is lower)


def _memfd(name):
    try:
        return os.memfd_create(name)
    except (AttributeError, OSError):  # no memfd: a file in the private /tmp
        fd = os.open(f"/tmp/.{name}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.unlink(f"/tmp/.{name}")
        return fd


def _read_back(fd, limit, tail=False):
    """(the first `limit` characters written to fd, or its last with `tail`; how many characters more there were).
    The file is at most RLIMIT_FSIZE bytes."""
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    text = b"".join(chunks).decode("utf-8", "replace")
    if len(text) <= limit:
        return text, 0
    return (text[-limit:] if tail else text[:limit]), len(text) - limit


def _cpu_used():
    r = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


def _run(code, ns):
    """Run one call's code in ns; its exit status (the traceback, if any, on stderr)."""
    try:
        tree = ast.parse(code, "<python>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<python>", "exec"), ns)
        if last is not None:
            value = eval(compile(last, "<python>", "eval"), ns)
            if value is not None:
                print(repr(value))
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 (the model's code: its failure is its output)
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<python>":
            tb = tb.tb_next  # the model's own frames only, not this file's
        sys.stderr.write("".join(traceback.format_exception(type(e), e, tb)))
        return 1


def main():
    limit, cpu_s = int(sys.argv[1]), int(sys.argv[2])
    proto_in = _dup_high(0)
    proto_out = _dup_high(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    reader = os.fdopen(proto_in, "rb", buffering=0)
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    sys.argv = ["<python>"]

    def reply(obj):
        data = (json.dumps(obj) + "\n").encode()
        while data:
            data = data[os.write(proto_out, data):]

    reply({"ready": 1})
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = os.read(reader.fileno(), 1 << 16)
            if not chunk:
                return
            buf += chunk
        line, _, buf = buf.partition(b"\n")
        req = json.loads(line)
        code = req["code"]
        out, err = _memfd("stdout"), _memfd("stderr")
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = int(_cpu_used()) + cpu_s + 1
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard < 0 else min(soft, hard), hard))
        status = _run(code, ns)
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except BaseException:  # noqa: BLE001 (a full file, a closed stream: what was written stays)
                pass
        os.dup2(null, 1)
        os.dup2(null, 2)
        o, o_cut = _read_back(out, limit)
        e, e_cut = _read_back(err, limit, tail=True)
        os.close(out)
        os.close(err)
        reply({"id": req["id"], "out": o, "out_cut": o_cut, "err": e, "err_cut": e_cut,
               "status": status if isinstance(status, int) else 1})


def _dup_high(fd):
    import fcntl

    top = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, min(_FIRST_FD, max(3, top - 4)))


if __name__ == "__main__":
    main()
