"""Held-out text for KLD comparisons, frozen: the first 14,000 characters of four repo files
as they stood at 03b10b4. The tests read these copies, not the live files, so rewriting the
README or cli.py cannot change what a ratio of two quantizations is measured on."""

from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).resolve().parent / "data" / "heldout"


def heldout_text(source: str) -> str:
    """The frozen text of repo file `source` (e.g. "README.md", "quantkit/cli.py")."""
    return (_DIR / (source.replace("/", "__") + ".txt")).read_text()
