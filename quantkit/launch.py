"""The `quantkit` command: the process's malloc settings first, then the CLI (quantkit.cli).

Kept free of heavy imports: where glibc's huge page tunable would help (quantkit.machine), the
process starts itself again with it before torch is loaded, which costs ~30 ms.
"""

from __future__ import annotations

import os
import sys

from quantkit.machine import huge_page_env


def reexec_with_huge_pages() -> None:
    """Start this process again (same PID, same command line) with huge_page_env, once; returns
    where nothing would change or the exec fails. Call before anything heavy is imported."""
    env = huge_page_env()
    if env is None:
        return
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, argv, env)
    except OSError:
        return


def main():
    reexec_with_huge_pages()
    from quantkit.cli import main as cli_main

    return cli_main()
