"""Artifacts appear whole or not at all, and an existing one is never lost.

A new artifact is written into a hidden sibling `.NAME.tmp-PID-*`, then renamed in. Replacing
one (--force) renames the old artifact aside to `.NAME.old-PID`, renames the new one in, then
deletes the old: at every instant a complete artifact is at NAME, or set aside and put back
by the next run (`recover`). Leftovers of dead processes (their pid is in the name) are
removed by the next run for the same output.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from quantkit.errors import ArtifactExists, OutputPathError

__all__ = ["check_output", "check_not_input", "atomic_output", "recover", "identity",
           "describe_output"]

PAUSE_ENV = "QUANTKIT_TEST_PAUSE_AT"  # "POINT:FILE": write our pid to FILE, then sleep (tests)


def _pause_point(name: str) -> None:
    """Test hook: stop at a named moment of the replace, so a test can kill us right there."""
    point, _, marker = os.environ.get(PAUSE_ENV, "").partition(":")
    if point == name and marker:
        Path(marker).write_text(str(os.getpid()))
        # short sleeps: a signal the kernel hands to another thread (numba / OpenMP / the
        # checkpoint writer) only sets Python's flag, which one long sleep would not look at
        # for an hour (seen once in CI under load: SIGINT never became KeyboardInterrupt)
        for _ in range(36000):
            time.sleep(0.1)


def _leftovers(out: Path, tag: str) -> list[Path]:
    """`.NAME.<tag>-PID...` siblings of `out`, newest first."""
    if not out.parent.is_dir():
        return []
    found = [Path(p) for p in glob.glob(str(out.parent / f".{glob.escape(out.name)}.{tag}-*"))]
    return sorted(found, key=lambda p: os.lstat(p).st_mtime_ns, reverse=True)


def _owner_alive(path: Path, tag: str) -> bool:
    """Whether the process whose pid follows `.tag-` in the name still runs (unknown: yes)."""
    pid_text = path.name.rsplit(f".{tag}-", 1)[-1].split("-")[0]
    if not pid_text.isdigit():
        return True
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def recover(out: Path) -> list[str]:
    """Repair what interrupted runs left next to `out`; returns what was done, one line each.

    An aside copy (`.NAME.old-PID`) is renamed back when NAME is missing (a replace was
    killed between its two renames), else deleted; temp dirs of dead processes are deleted."""
    out = Path(out)
    notes = []
    for aside in _leftovers(out, "old"):
        if _owner_alive(aside, "old"):
            continue  # another run is replacing this very output right now
        if not os.path.lexists(out):
            with contextlib.suppress(FileNotFoundError):
                os.rename(aside, out)
                notes.append(f"restored {out} from {aside.name}, where an interrupted --force "
                             "replace had set it aside")
                continue
        _remove(aside)
        notes.append(f"removed {aside.name}, the replaced artifact an interrupted run left behind")
    for tmp in _leftovers(out, "tmp"):
        if not _owner_alive(tmp, "tmp"):
            _remove(tmp)
            notes.append(f"removed {tmp.name}, the unfinished write of a run that was killed")
    return notes


def check_writable(out: Path, option: str = "-o") -> None:
    """Create and remove a probe file where `out` (given with `option`) will be written (its
    nearest existing ancestor), so an unwritable path fails before any work, not after it."""
    where = Path(os.path.abspath(out)).parent
    while not os.path.lexists(where) and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise OutputPathError(
            f"Cannot write {out}: {where} is a file, not a directory.",
            f"Choose an {option} path whose parent is a directory.")
    try:
        fd, probe = tempfile.mkstemp(prefix=".quantkit-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputPathError(f"Cannot write {out}: {where} is not writable ({e.strerror}).",
                              f"Choose an {option} path in a writable directory.") from e


def check_output(out: Path, force: bool) -> None:
    """Before any work: the output location must be writable, interrupted runs' leftovers are
    repaired (each repair is a warning), and an existing output needs --force."""
    out = Path(out)
    check_writable(out)
    for note in recover(out):
        warnings.warn(note, stacklevel=2)
    if os.path.lexists(out) and not force:
        raise ArtifactExists(f"Output path {out} already exists.",
                             "Pass --force to replace it, or choose another -o path.")


def check_not_input(out: Path, inputs: dict[str, Path]) -> None:
    """Refuse an output that is, contains or lies inside an input (the model directory, a
    calibration or imatrix file): replacing it would delete what the run reads."""
    target = Path(out).resolve()
    for what, path in inputs.items():
        src = Path(path).resolve()
        if target == src:
            rel = "is"
        elif src.is_relative_to(target):
            rel = "contains"
        elif target.is_relative_to(src) and src.is_dir():
            rel = "lies inside"
        else:
            continue
        raise OutputPathError(f"-o {out} {rel} the {what} {path}; writing it would change or "
                              f"delete the {what}.",
                              "Choose an -o path outside every input of the run.")


def identity(path: Path) -> tuple[int, int] | None:
    """(inode, mtime) of what is at `path` now, None when nothing is: tells a replaced
    artifact from the one that was there before."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def describe_output(out: Path, before: tuple[int, int] | None) -> str:
    """One true sentence about what an interrupted run left at `out`."""
    now = identity(out)
    asides = _leftovers(out, "old")
    if now is not None and now == before:
        return f"{out} still holds the artifact that was there before"
    if now is not None:
        return f"the new artifact was written to {out}"
    if asides:
        return (f"the earlier artifact is set aside as {asides[0]}; the next quantize run "
                f"with -o {out} puts it back")
    return f"nothing was written to {out}"


@contextlib.contextmanager
def atomic_output(out: Path, force: bool, is_dir: bool = True) -> Iterator[Path]:
    """Yield a temp path next to `out`; on success it replaces `out`, on any error it vanishes
    and `out` is as it was."""
    out = Path(out)
    check_output(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_root = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    tmp = tmp_root if is_dir else tmp_root / out.name
    try:
        yield tmp
        _normal_permissions(tmp_root)
        _pause_point("written")
        if os.path.lexists(out):
            _replace(out, tmp)
        else:
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)


def _replace(out: Path, new: Path) -> None:
    """Old aside, new in, old deleted; an interrupt before the new one is in puts the old back."""
    aside = out.parent / f".{out.name}.old-{os.getpid()}"
    _remove(aside)
    os.rename(out, aside)
    try:
        _pause_point("aside")
        os.rename(new, out)
    except BaseException:
        if not os.path.lexists(out):
            os.rename(aside, out)
        raise
    _pause_point("replaced")
    _remove(aside)


def _normal_permissions(root: Path) -> None:
    """mkdtemp makes 0700 dirs (and some writers 0600 files); artifacts get umask defaults."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [root, *root.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)
