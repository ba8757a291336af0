"""A fork server: imports heavy modules once, then runs each requested script in a forked child.

Runs in a foreign virtualenv (vLLM's) and imports nothing from quantkit.
Why: `import vllm; from vllm import LLM` costs 10-16 s of every vLLM start on a 2-core CPU;
a child forked from a process that has already imported vLLM starts with it loaded.

Usage: python forkserver_main.py SOCKET MODULE[:ATTR][,MODULE[:ATTR]...]
The server exits when its standard input closes (the process that started it is gone).
Protocol, one Unix-socket connection per run, JSON lines: the client sends
{"script" or "module", "args", "cwd", "log", "err" (optional: stderr apart), "env"}; the
server answers {"pid": N} once the child runs and
{"returncode": N} when it ended (negative: killed by that signal, as subprocess reports it).
The child runs the script as `python SCRIPT ARGS...` (or `python -m MODULE ARGS...`) would
(run_name "__main__", sys.argv, the environment and working directory of the request), stdout
into `log` and stderr into `err` (or `log`). A client
that disconnects before the end gets its child killed.
"""

import importlib
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import sys
import time
import traceback

# this folder holds quantkit/engines/vllm.py; keep it from shadowing the real vllm package
_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]


def main(sock_path: str, modules: str) -> None:
    # Ctrl-C in the owner's terminal reaches this process group too: the owner's exit (EOF on
    # stdin) ends the server, and a run's handler kills its worker when the client goes
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for spec in filter(None, modules.split(",")):
        name, _, attr = spec.partition(":")
        module = importlib.import_module(name)
        if attr:  # vLLM imports its entry points lazily, on attribute access
            getattr(module, attr)
    if not _forked_child_computes():
        sys.exit("a child forked after these imports cannot run a parallel torch op: "
                 "the client runs its workers as plain subprocesses")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped without waiting
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    events = selectors.DefaultSelector()
    events.register(server, selectors.EVENT_READ)
    events.register(sys.stdin, selectors.EVENT_READ)
    while True:
        for key, _ in events.select():
            if key.fileobj is sys.stdin:
                if not os.read(0, 4096):  # the owner is gone (maybe killed: tidy its files)
                    server.close()
                    _remove_workdir(sock_path)
                    return
                continue
            conn, _ = server.accept()
            if os.fork() == 0:
                server.close()
                _handle(conn)
            conn.close()


def _forked_child_computes(timeout_s: float = 60) -> bool:
    """Whether a forked child can run a multi-threaded torch matmul: OpenMP runtimes hang in a
    child forked after the parent ran a parallel region, which an import could have done."""
    if "torch" not in sys.modules:
        return True
    pid = os.fork()
    if pid == 0:
        torch = sys.modules["torch"]
        a = torch.randn(512, 512)
        os._exit(0 if float((a @ a).abs().sum()) > 0 else 1)
    for _ in range(int(timeout_s / 0.05)):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def _remove_workdir(sock_path: str) -> None:
    """The socket, and the directory the client made for this server (its log, its key)."""
    workdir = os.path.dirname(os.path.abspath(sock_path))
    if os.path.basename(workdir).startswith("quantkit-forkserver-"):
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        os.unlink(sock_path)


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _handle(conn: socket.socket) -> None:
    """One request: fork the worker, report its pid and its exit; kill it if the client goes."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = 0
    try:
        request = json.loads(conn.makefile("r").readline())
        pid = os.fork()
        if pid == 0:
            conn.close()
            _run(request)
        _send(conn, {"pid": pid})
        watch = selectors.DefaultSelector()
        watch.register(conn, selectors.EVENT_READ)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                break
            if watch.select(timeout=0.2) and not conn.recv(1):  # the client disconnected
                _kill_group(pid)
    except BaseException:
        traceback.print_exc()
        if pid:
            _kill_group(pid)
    finally:
        os._exit(0)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run(request: dict) -> None:
    """The forked worker: the request's environment, directory, output and argv; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills it and anything it started
        signal.signal(signal.SIGINT, signal.default_int_handler)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        log = os.open(request["log"], flags, 0o644)
        os.dup2(log, 1)
        os.dup2(os.open(request["err"], flags, 0o644) if request.get("err") else log, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if request.get("module"):  # as `python -m MODULE ARGS...`
            sys.argv = [request["module"], *request["args"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [request["script"], *request["args"]]
            runpy.run_path(request["script"], run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
