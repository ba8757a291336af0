"""The fork server vLLM workers run through (quantkit/engines/forkserver.py) gives what
`subprocess.run([python, script, *args])` gives: the script's exit code, its output, the run's
environment, directory and argv, a killed worker at the timeout; and a server shared with a
child process serves that process too. Checked with this venv's Python and a cheap preload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from quantkit.engines import forkserver

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    mode = sys.argv[1]
    print("out", mode)
    print("err", mode, file=sys.stderr)
    stat = open(f"/proc/{os.getppid()}/stat").read()  # the parent's parent: the server
    json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "flag": os.environ.get("FS_FLAG"),
               "pid": os.getpid(), "preloaded": "email.mime.text" in sys.modules,
               "server": int(stat.rsplit(")", 1)[1].split()[1])},
              open("result.json", "w"))
    if mode == "exit3":
        sys.exit(3)
    if mode == "raise":
        raise ValueError("boom")
    if mode == "kill":
        os.kill(os.getpid(), 9)
    if mode == "sleep":
        time.sleep(60)
""")
PRELOAD = "email.mime.text"


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(SCRIPT)
    return path


def _run(script: Path, cwd: Path, mode: str, timeout: float | None = 60, **env: str):
    env = {**os.environ, "FS_FLAG": mode, **env}
    env.pop(forkserver.SHARED_ENV, None)
    return forkserver.run_script(Path(sys.executable), script, [mode], env=env, preload=PRELOAD,
                                 cwd=cwd, timeout=timeout)


def test_worker_gets_its_argv_env_cwd_and_exit_code(script, tmp_path, monkeypatch):
    monkeypatch.delenv(forkserver.SHARED_ENV, raising=False)
    results = {}
    for mode, code in (("ok", 0), ("exit3", 3), ("raise", 1), ("kill", -9)):
        cwd = tmp_path / mode
        cwd.mkdir()
        res = _run(script, cwd, mode)
        assert res.returncode == code, res.log
        assert f"out {mode}" in res.log and f"err {mode}" in res.log
        results[mode] = json.loads((cwd / "result.json").read_text())
        assert results[mode]["argv"] == [mode] and results[mode]["flag"] == mode
        assert results[mode]["cwd"] == str(cwd)
        assert results[mode]["preloaded"], "the worker did not fork from the server"
    assert "ValueError: boom" in _run(script, tmp_path / "ok", "raise").log
    assert len({r["pid"] for r in results.values()}) == 4
    assert not list(tmp_path.glob("*/worker-*.log")), "the worker logs are removed"


def test_timeout_kills_the_worker(script, tmp_path, monkeypatch):
    monkeypatch.delenv(forkserver.SHARED_ENV, raising=False)
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        _run(script, tmp_path, "sleep", timeout=3)
    assert time.monotonic() - t0 < 20
    assert "out sleep" in caught.value.output
    pid = json.loads((tmp_path / "result.json").read_text())["pid"]
    for _ in range(50):  # killed, then reaped by its handler
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), "the timed-out worker still runs"


def test_off_runs_a_plain_subprocess(script, tmp_path, monkeypatch):
    monkeypatch.setenv(forkserver.SHARED_ENV, "off")
    env = {**os.environ, "FS_FLAG": "ok"}
    res = forkserver.run_script(Path(sys.executable), script, ["ok"], env=env, preload=PRELOAD,
                                cwd=tmp_path, timeout=60)
    assert res.returncode == 0 and "out ok" in res.log
    assert not json.loads((tmp_path / "result.json").read_text())["preloaded"]


def test_shared_server_serves_a_child_process(script, tmp_path, monkeypatch):
    """A child process with the same environment (volatile keys aside) runs its worker through
    the parent's server; one whose environment differs gets its own."""
    monkeypatch.delenv(forkserver.SHARED_ENV, raising=False)
    env = {k: v for k, v in os.environ.items() if k != forkserver.SHARED_ENV}
    forkserver.share(Path(sys.executable), PRELOAD, env)
    shared = os.environ[forkserver.SHARED_ENV]
    server_pid = json.loads(Path(shared + ".json").read_text())["pid"]
    child = textwrap.dedent(f"""
        import json, os, sys
        from pathlib import Path
        from quantkit.engines import forkserver
        env = {{k: v for k, v in os.environ.items() if k != forkserver.SHARED_ENV}}
        env.update(sys.argv[2:] and {{"FS_EXTRA": sys.argv[2]}} or {{}})
        res = forkserver.run_script(Path(sys.executable), Path({str(script)!r}), ["ok"],
                                    env=env, preload={PRELOAD!r}, cwd=Path(sys.argv[1]))
        print(res.returncode)
    """)
    parents = {}
    for name, extra in (("same", []), ("other", ["x"])):
        cwd = tmp_path / name
        cwd.mkdir()
        out = subprocess.run([sys.executable, "-c", child, str(cwd), *extra], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "COLUMNS": "99"})
        assert out.stdout.strip() == "0", out.stderr
        parents[name] = json.loads((cwd / "result.json").read_text())["server"]
    assert parents["same"] == server_pid, "the child did not use the shared server"
    assert parents["other"] != server_pid, "a different environment used the shared server"


def test_a_client_that_dies_takes_its_worker_with_it(script, tmp_path, monkeypatch):
    """A CLI killed mid-run (SIGKILL, Ctrl-C) must not leave its vLLM worker running on: the
    server's handler sees the connection close and kills the worker's process group."""
    monkeypatch.delenv(forkserver.SHARED_ENV, raising=False)
    env = {k: v for k, v in os.environ.items() if k != forkserver.SHARED_ENV}
    forkserver.share(Path(sys.executable), PRELOAD, env)
    client = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from quantkit.engines import forkserver
        env = {{k: v for k, v in os.environ.items() if k != forkserver.SHARED_ENV}}
        forkserver.run_script(Path(sys.executable), Path({str(script)!r}), ["sleep"], env=env,
                              preload={PRELOAD!r}, cwd=Path(sys.argv[1]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", client, str(tmp_path)])
    result = tmp_path / "result.json"
    for _ in range(300):
        if result.is_file() and result.stat().st_size:
            break
        time.sleep(0.1)
    worker = json.loads(result.read_text())
    assert worker["server"] == json.loads(Path(os.environ[forkserver.SHARED_ENV] + ".json")
                                          .read_text())["pid"]
    proc.kill()
    proc.wait()
    for _ in range(100):
        if not Path(f"/proc/{worker['pid']}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{worker['pid']}").exists(), "the dead client's worker still runs"
