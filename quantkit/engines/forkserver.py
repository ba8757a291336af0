"""Run worker scripts in a foreign virtualenv through a fork server (forkserver_main.py).

The server imports the heavy modules once (vLLM: 10-16 s per start on a 2-core CPU); every run
is a child forked from it, with the run's own environment, directory, log file and exit code,
as `subprocess.run([python, script, *args])` would give. A server serves one Python and one
environment (keys that nothing in the foreign venv reads at import aside: `_VOLATILE`); a run
whose environment differs gets a server of its own.

A process may share its server with the processes it starts (`share()`: the test suite does,
so CLI subprocesses skip the import too); the server lives as long as the process that started
it. QUANTKIT_FORKSERVER=off runs every worker as a plain subprocess.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["run_script", "share", "WorkerResult", "SHARED_ENV"]

SHARED_ENV = "QUANTKIT_FORKSERVER"  # "off", or the socket of a server this process may use
_SERVER = Path(__file__).with_name("forkserver_main.py")
# environment keys no foreign module reads at import: they may differ between a server and a
# run. KMP_BLOCKTIME: llama.cpp's CPU library setenv()s it when it loads, below os.environ, so a
# process that used llama.cpp passes it to its children; GNU OpenMP (torch's, vLLM's) ignores it.
_VOLATILE = ("PYTEST_", "QUANTKIT_", "COLUMNS", "LINES", "PWD", "OLDPWD", "SHLVL", "_",
             "KMP_BLOCKTIME")
_START_TIMEOUT_S = 600
_MAX_OWN = 2  # private servers a process keeps (each holds its imports in memory)
_lock = threading.Lock()
_own: dict[str, _Server] = {}  # this process's private servers, least recently used first
_shared: dict[str, _Server] = {}  # the server this process started for its children


@dataclass
class WorkerResult:
    returncode: int
    log: str  # the worker's stdout, and its stderr interleaved unless kept apart
    err: str = ""  # its stderr, when run with separate_stderr


def run_script(python: Path, script: Path | None, args: list[str], *, env: dict[str, str],
               preload: str, cwd: Path, timeout: float | None = None, module: str | None = None,
               separate_stderr: bool = False,
               volatile: tuple[str, ...] | None = None) -> WorkerResult:
    """`python script *args` (or `python -m module *args`) in `cwd` with `env`, through a server
    that has imported `preload` ("module[:attr],..."). `volatile`: environment key prefixes no
    preloaded module reads at import (default: quantkit's own keys and the terminal's), which
    may differ between the server and a run. Raises subprocess.TimeoutExpired after `timeout` s
    (the worker is killed)."""
    volatile = _VOLATILE if volatile is None else volatile
    server = None
    if os.environ.get(SHARED_ENV, "").lower() not in ("off", "0", "no"):
        server = _server_for(python, preload, env, volatile)
    target = {"module": module} if module else {"script": str(script)}
    if server is not None:
        result = server.run(target, args, env=env, cwd=cwd, timeout=timeout,
                            separate_stderr=separate_stderr)
        if result is not None:
            return result
    argv = ["-m", module] if module else [str(script)]
    proc = subprocess.run([str(python), *argv, *args], env=env, cwd=cwd, timeout=timeout,
                          stdout=subprocess.PIPE, text=True,
                          stderr=subprocess.PIPE if separate_stderr else subprocess.STDOUT)
    return WorkerResult(proc.returncode, proc.stdout or "", proc.stderr or "")


def share(python: Path, preload: str, env: dict[str, str]) -> None:
    """Start (in the background) a server for `env` and let child processes use it."""
    key = _key(python, preload, env, _VOLATILE)
    if _parent_server(key) is not None:
        return  # a parent's server already serves this environment
    with _lock:
        if key not in _shared:
            try:
                _shared[key] = _Server.start(python, preload, env, key)
            except OSError:
                return
        os.environ[SHARED_ENV] = str(_shared[key].socket_path)


def _key(python: Path, preload: str, env: dict[str, str], volatile: tuple[str, ...]) -> str:
    stable = sorted((k, v) for k, v in env.items() if not k.startswith(volatile))
    return hashlib.sha256(json.dumps([str(python), preload, stable]).encode()).hexdigest()[:16]


def _parent_server(key: str) -> tuple[Path, int] | None:
    """(socket, pid) of the server a parent process shares, when it serves `key` and lives."""
    shared = os.environ.get(SHARED_ENV)
    if not shared or shared.lower() in ("off", "0", "no"):
        return None
    try:
        meta = json.loads(Path(shared + ".json").read_text())
        if meta.get("key") == key:
            os.kill(int(meta["pid"]), 0)
            return Path(shared), int(meta["pid"])
    except (OSError, ValueError, KeyError):
        pass
    return None


def _server_for(python: Path, preload: str, env: dict[str, str],
                volatile: tuple[str, ...]) -> _Server | None:
    """The server this process shares, a parent's, else this process's own."""
    key = _key(python, preload, env, volatile)
    if key in _shared and _shared[key].alive():
        return _shared[key]
    parent = _parent_server(key)
    if parent is not None:
        return _Server.attach(*parent)
    with _lock:
        server = _own.pop(key, None)
        if server is None or not server.alive():
            while len(_own) >= _MAX_OWN:  # the least recently used goes
                _own.pop(next(iter(_own))).close()
            try:
                server = _Server.start(python, preload, env, key)
            except OSError:
                return None
        _own[key] = server  # most recently used last
        return server


class _Server:
    def __init__(self, socket_path: Path, proc: subprocess.Popen | None = None,
                 workdir: Path | None = None):
        self.socket_path, self.proc, self.workdir = socket_path, proc, workdir
        self._ready = threading.Event()
        self._failed = False

    @classmethod
    def attach(cls, socket_path: Path, pid: int) -> _Server:
        """Another process's server: ready once its socket exists, failed once it is gone."""
        server = cls(socket_path)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not socket_path.exists() and time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except OSError:
                break
            time.sleep(0.2)
        server._failed = not socket_path.exists()
        server._ready.set()
        return server

    @classmethod
    def start(cls, python: Path, preload: str, env: dict[str, str], key: str) -> _Server:
        workdir = Path(tempfile.mkdtemp(prefix="quantkit-forkserver-"))
        sock = workdir / "server.sock"
        with open(workdir / "server.log", "wb") as log:
            proc = subprocess.Popen([str(python), str(_SERVER), str(sock), preload], env=env,
                                    cwd=workdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=log)
        (workdir / "server.sock.json").write_text(json.dumps({"key": key, "pid": proc.pid}))
        server = cls(sock, proc, workdir)
        threading.Thread(target=server._wait_ready, daemon=True).start()
        atexit.register(server.close)
        return server

    def _wait_ready(self) -> None:
        line = self.proc.stdout.readline()
        self._failed = line.strip() != b"ready"
        self._ready.set()

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # a ready server exits on EOF; one still importing is killed
            try:
                self.proc.wait(timeout=5 if self._ready.is_set() else 0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def run(self, target: dict, args: list[str], *, env: dict[str, str], cwd: Path,
            timeout: float | None, separate_stderr: bool) -> WorkerResult | None:
        """The worker's result, or None when the server is not usable (the caller runs the
        worker as a subprocess instead: same result, without the saved import)."""
        if not self._ready.wait(_START_TIMEOUT_S) or self._failed:
            return None
        logs = []
        for suffix in (".log", ".err") if separate_stderr else (".log",):
            handle, name = tempfile.mkstemp(prefix="worker-", suffix=suffix)
            os.close(handle)
            logs.append(Path(name))
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(str(self.socket_path))
        except OSError:
            _texts(logs)
            return None
        with conn:
            conn.sendall(json.dumps({**target, "args": [str(a) for a in args], "cwd": str(cwd),
                                     "log": str(logs[0]), "err": str(logs[-1]) if
                                     separate_stderr else None, "env": env}).encode() + b"\n")
            replies = _Replies(conn, None if timeout is None else time.monotonic() + timeout)
            started = replies.next()
            if "pid" not in started:  # the server could not fork: run it without the server
                _texts(logs)
                return None
            done = replies.next()
            if "timeout" in done:
                _kill_group(started["pid"])
                raise subprocess.TimeoutExpired([*target.values(), *args], timeout,
                                                *_texts(logs))
            if "returncode" not in done:
                out = _texts(logs)
                out[-1] += "\nthe fork server lost this worker\n"
                return WorkerResult(-1, *out)
            return WorkerResult(int(done["returncode"]), *_texts(logs))


class _Replies:
    """JSON lines from the server, each awaited until a deadline."""

    def __init__(self, conn: socket.socket, deadline: float | None):
        self.conn, self.deadline, self.buffer = conn, deadline, b""
        self.events = selectors.DefaultSelector()
        self.events.register(conn, selectors.EVENT_READ)

    def next(self) -> dict:
        """The next reply; {"timeout": True} at the deadline, {} if the server hung up."""
        while b"\n" not in self.buffer:
            left = None if self.deadline is None else max(self.deadline - time.monotonic(), 0)
            if not self.events.select(left):
                return {"timeout": True}
            chunk = self.conn.recv(65536)
            if not chunk:
                return {}
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _texts(paths: list[Path]) -> list[str]:
    """The files' texts; the files are removed."""
    out = []
    for path in paths:
        try:
            out.append(path.read_text(errors="replace"))
        except OSError:
            out.append("")
        path.unlink(missing_ok=True)
    return out
