"""The quantkit CLI as a real separate process, forked from a server that has imported it.

`run_cli` gives what `subprocess.run([sys.executable, "-m", "quantkit.cli", ...])` gives (its
own process, exit code, stdout and stderr apart, the env and cwd asked for), through
quantkit/engines/forkserver.py: the suite's ~50 CLI runs skip importing torch, transformers and
quantkit (~3-4 s each on 2 cores), and transformers' auto classes (~3 s more: the server reads
quantkit.model_io.AutoModelForCausalLM, which imports them the way quantkit does). Tests that
signal, limit or measure the process itself (SIGINT/SIGKILL, RLIMIT, peak RSS) start it with
subprocess directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from quantkit.engines.forkserver import run_script

# every key may matter to quantkit at import but the one pytest changes per test
_VOLATILE = ("PYTEST_CURRENT_TEST",)
_PRELOAD = "quantkit.cli,quantkit.model_io:AutoModelForCausalLM"


def run_cli(args, *, env: dict | None = None, cwd=None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    argv = [str(a) for a in args]
    res = run_script(Path(sys.executable), None, argv, env=dict(os.environ if env is None else env),
                     preload=_PRELOAD, cwd=Path(cwd or os.getcwd()), timeout=timeout,
                     module="quantkit.cli", separate_stderr=True, volatile=_VOLATILE)
    return subprocess.CompletedProcess([sys.executable, "-m", "quantkit.cli", *argv],
                                       res.returncode, res.log, res.err)
