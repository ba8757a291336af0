"""Where the built-in calibration sets live and what their manifest says.

The sets are plain text files committed under calibration_sets/ (built by
calibration_sets/build.py); their manifest.json carries sizes, hashes, sources and licences,
which end up in every artifact's provenance.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from quantkit.errors import CalibrationError

__all__ = ["calibration_sets_dir", "builtin_sets", "builtin_set_file", "DEFAULT_SET", "SPLITS"]

DEFAULT_SET = "mixed"
SPLITS = ("calib", "heldout")
ENV_DIR = "QUANTKIT_CALIBRATION_DIR"
_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../quantkit


def calibration_sets_dir() -> Path:
    """$QUANTKIT_CALIBRATION_DIR, else <repo root>/calibration_sets, else the packaged copy."""
    env = os.environ.get(ENV_DIR)
    if env:
        path = Path(env).expanduser()
        if not (path / "manifest.json").is_file():
            raise CalibrationError(
                f"{ENV_DIR}={env} has no manifest.json",
                "point it at a calibration_sets/ folder (see calibration_sets/build.py) or unset it",
            )
        return path
    for path in (
        _PACKAGE_DIR.parent / "calibration_sets",
        _PACKAGE_DIR / "_data" / "calibration_sets",
    ):
        if (path / "manifest.json").is_file():
            return path
    raise CalibrationError(
        "the built-in calibration sets are not installed (no calibration_sets/manifest.json)",
        f"run from a quantkit checkout, set {ENV_DIR}, or pass a local .txt/.jsonl/.parquet file",
    )


def builtin_sets() -> dict[str, dict]:
    """Manifest entries of the built-in sets, by name."""
    manifest = json.loads((calibration_sets_dir() / "manifest.json").read_text("utf-8"))
    return dict(manifest["sets"])


def builtin_set_file(name: str, split: str = "calib") -> tuple[str, dict]:
    """Text of one split of a built-in set and its provenance (manifest hash checked)."""
    sets = builtin_sets()
    if name not in sets:
        raise CalibrationError(
            f"unknown calibration set {name!r}; built-in sets: {', '.join(sorted(sets))}",
            "pass one of those names, or a path to a .txt/.jsonl/.parquet file",
        )
    if split not in SPLITS:
        raise CalibrationError(f"unknown split {split!r}", f"use one of: {', '.join(SPLITS)}")
    entry = sets[name]
    meta = entry["files"][split]
    path = calibration_sets_dir() / meta["path"]
    if not path.is_file():
        raise CalibrationError(
            f"built-in set file {path} is missing", "rerun calibration_sets/build.py"
        )
    data = path.read_bytes()
    provenance = {
        "kind": "builtin",
        "name": name,
        "split": split,
        "path": meta["path"],
        "domain": entry["domain"],
        "licences": list(entry.get("licences", [])),
        "sources": list(
            dict.fromkeys(f"{s['name']} {s['version']}" for s in entry.get("sources", []))
        ),
        "n_source_documents": entry["n_documents"][split],
        "file_sha256": meta["sha256"],
        "file_matches_manifest": hashlib.sha256(data).hexdigest() == meta["sha256"],
    }
    return data.decode("utf-8"), provenance
