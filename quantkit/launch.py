"""The `quantkit` command: the process's malloc settings first, then the CLI (quantkit.cli).

Kept free of heavy imports: where glibc's huge page tunable would help (pipeline/heap.py), the
process starts itself again with it before torch is loaded, which costs ~30 ms.
"""

from __future__ import annotations

from quantkit.pipeline.heap import reexec_with_huge_pages


def main():
    reexec_with_huge_pages()
    from quantkit.cli import main as cli_main

    return cli_main()
