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
# environment keys no foreign module reads at import: they may differ between a server and a run
_VOLATILE = ("PYTEST_", "QUANTKIT_", "COLUMNS", "LINES", "PWD", "OLDPWD", "SHLVL", "_")
_START_TIMEOUT_S = 600
_lock = threading.Lock()
_own: dict[str, _Server] = {}  # this process's private server (one at a time)
_shared: dict[str, _Server] = {}  # the server this process started for its children


@dataclass
class WorkerResult:
    returncode: int
    log: str  # the worker's stdout and stderr, interleaved


def run_script(python: Path, script: Path, args: list[str], *, env: dict[str, str],
               preload: str, cwd: Path, timeout: float | None = None) -> WorkerResult:
    """`python script *args` in `cwd` with `env`, through a server that has imported `preload`
    ("module[:attr],..."). Raises subprocess.TimeoutExpired after `timeout` s (the worker is
    killed)."""
    server = None
    if os.environ.get(SHARED_ENV, "").lower() not in ("off", "0", "no"):
        server = _server_for(python, preload, env)
    if server is not None:
        result = server.run(script, args, env=env, cwd=cwd, timeout=timeout)
        if result is not None:
            return result
    proc = subprocess.run([str(python), str(script), *args], env=env, cwd=cwd, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return WorkerResult(proc.returncode, proc.stdout or "")


def share(python: Path, preload: str, env: dict[str, str]) -> None:
    """Start (in the background) a server for `env` and let child processes use it."""
    key = _key(python, preload, env)
    if _parent_server(key) is not None:
        return  # a parent's server already serves this environment
    with _lock:
        if key not in _shared:
            try:
                _shared[key] = _Server.start(python, preload, env, key)
            except OSError:
                return
        os.environ[SHARED_ENV] = str(_shared[key].socket_path)


def _key(python: Path, preload: str, env: dict[str, str]) -> str:
    stable = sorted((k, v) for k, v in env.items() if not k.startswith(_VOLATILE))
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


def _server_for(python: Path, preload: str, env: dict[str, str]) -> _Server | None:
    """The server this process shares, a parent's, else this process's own."""
    key = _key(python, preload, env)
    if key in _shared and _shared[key].alive():
        return _shared[key]
    parent = _parent_server(key)
    if parent is not None:
        return _Server.attach(*parent)
    with _lock:
        server = _own.get(key)
        if server is None or not server.alive():
            for old in _own.values():  # one private server per process at a time
                old.close()
            _own.clear()
            try:
                server = _own[key] = _Server.start(python, preload, env, key)
            except OSError:
                return None
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

    def run(self, script: Path, args: list[str], *, env: dict[str, str], cwd: Path,
            timeout: float | None) -> WorkerResult | None:
        """The worker's result, or None when the server is not usable (the caller runs the
        worker as a subprocess instead: same result, without the saved import)."""
        if not self._ready.wait(_START_TIMEOUT_S) or self._failed:
            return None
        handle, name = tempfile.mkstemp(prefix="worker-", suffix=".log", dir=cwd)
        os.close(handle)
        log = Path(name)
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(str(self.socket_path))
        except OSError:
            return None
        with conn:
            conn.sendall(json.dumps({"script": str(script), "args": [str(a) for a in args],
                                     "cwd": str(cwd), "log": str(log), "env": env}).encode()
                         + b"\n")
            replies = _Replies(conn, None if timeout is None else time.monotonic() + timeout)
            started = replies.next()
            if "pid" not in started:  # the server could not fork: run it without the server
                log.unlink(missing_ok=True)
                return None
            done = replies.next()
            if "timeout" in done:
                _kill_group(started["pid"])
                raise subprocess.TimeoutExpired([str(script), *args], timeout, _text(log))
            if "returncode" not in done:
                return WorkerResult(-1, _text(log) + "\nthe fork server lost this worker\n")
            return WorkerResult(int(done["returncode"]), _text(log))


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


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    finally:
        path.unlink(missing_ok=True)
