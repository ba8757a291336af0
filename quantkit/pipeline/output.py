"""Artifacts appear whole or not at all: write into a sibling temp dir, then rename."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from quantkit.errors import ArtifactExists

__all__ = ["check_output", "atomic_output"]


def check_output(out: Path, force: bool) -> None:
    """Refuse an existing output path before any work is done."""
    if out.exists() and not force:
        raise ArtifactExists(f"Output path {out} already exists.",
                             "Pass --force to replace it, or choose another -o path.")


@contextlib.contextmanager
def atomic_output(out: Path, force: bool, is_dir: bool = True) -> Iterator[Path]:
    """Yield a temp path next to `out`; on success it replaces `out`, on any error it vanishes.

    Interrupts (Ctrl-C, exceptions) leave `out` as it was; a SIGKILL leaves only a hidden
    `.out.tmp-*` sibling, never a half-written `out`.
    """
    out = Path(out)
    check_output(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_root = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp = tmp_root if is_dir else tmp_root / out.name
    try:
        yield tmp
        _normal_permissions(tmp_root)
        if out.exists():
            if out.is_dir() and not out.is_symlink():
                shutil.rmtree(out)
            else:
                out.unlink()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)


def _normal_permissions(root: Path) -> None:
    """mkdtemp makes 0700 dirs (and some writers 0600 files); artifacts get umask defaults."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    for p in [root, *root.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)
