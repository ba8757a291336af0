"""Per-block checkpoints, so a killed `quantize` continues where it stopped.

Layout of `.OUT.partial/` (next to the output, hidden):
  request.json              the request key (sha256) and what it was made from
  block-00007.safetensors   block 7's QuantResult tensors and its unquantized tensors
  block-00007.json          the QuantResults' non-tensor fields
  hidden-00007.safetensors  calibration hidden states after block 7 (the next block's inputs)
  done.json                 {"blocks": 8}: written last, atomically; the only progress marker
No pickle: tensors are safetensors, everything else JSON. A checkpoint whose key differs from
the request (other model, scheme, options or calibration) is deleted, never resumed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit.pipeline.heap import trim_heap
from quantkit.types import QuantResult, QuantScheme

__all__ = ["BlockCheckpoint", "Resumed", "checkpoint_dir", "checkpoint_note", "request_key"]

_TENSORS = ("codes", "scale", "zero", "g_idx", "bias")


def checkpoint_dir(out: Path) -> Path:
    out = Path(out)
    return out.parent / f".{out.name}.partial"


def checkpoint_note(out: Path) -> str:
    """What the checkpoint of `out` holds, for the message of a run that stopped early ("" when
    there is none). One that holds no finished block is removed: it only costs disk space."""
    directory = checkpoint_dir(out)
    try:
        done = json.loads((directory / "done.json").read_text())
        blocks, total = int(done["blocks"]), int(done.get("total", 0))
    except (OSError, ValueError, KeyError, TypeError):
        shutil.rmtree(directory, ignore_errors=True)
        return ""
    return (f"{blocks} of {total} blocks are finished and kept in the hidden checkpoint "
            f"{directory} ({_size(directory) / 2**20:.0f} MiB): a run of the same request "
            "resumes from them; delete it to free the space")


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def request_key(parts: dict) -> str:
    """sha256 of everything that decides the artifact's bytes (JSON, sorted keys)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def model_fingerprint(path: Path) -> dict:
    """config.json's hash plus each weight file's name, size and mtime (cheap, no full read)."""
    path = Path(path)
    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns]
             for p in sorted(path.glob("*.safetensors"))}
    cfg = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
    return {"config_sha256": cfg, "weights": files}


@dataclass
class Resumed:
    start: int
    dense: dict[str, torch.Tensor]
    hidden: list[torch.Tensor] | None


class SavedResults(Mapping):
    """The QuantResults of finished blocks, read from the checkpoint one at a time on access.

    Holding every block's uint8 codes in RAM would cost 1 byte per weight (half the bf16
    model); writers pack result by result, so only one unpacked result lives at a time.
    """

    def __init__(self, ckpt: BlockCheckpoint, blocks: int):
        self.ckpt = ckpt
        self.where: dict[str, int] = {}
        for i in range(blocks):
            meta = json.loads((ckpt.dir / f"block-{i:05d}.json").read_text())
            self.where.update(dict.fromkeys(meta["results"], i))

    def __getitem__(self, name: str) -> QuantResult:
        trim_heap()  # the previous result's (and the writer's) temporaries
        return self.ckpt.read_result(self.where[name], name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


class BlockCheckpoint:
    """Saves finished blocks under `directory`; `resume` returns them if `key` matches."""

    def __init__(self, directory: Path, key: str, describe: dict | None = None):
        self.dir = Path(directory)
        self.key = key
        self.describe = describe or {}

    # ---------------------------------------------------------------- reading
    def resume(self, total: int) -> Resumed | None:
        """Earlier blocks of this very request, or None (a stale checkpoint is removed)."""
        done = self._done()
        if done is None:
            self._reset()
            return None
        start = min(done, total)
        dense: dict[str, torch.Tensor] = {}
        for i in range(start):
            dense.update(self._read_dense(i))
        hidden = None
        hfile = self.dir / f"hidden-{start - 1:05d}.safetensors"
        if start > 0 and hfile.is_file():
            with safe_open(str(hfile), framework="pt") as f:
                hidden = [f.get_tensor(f"h.{j}") for j in range(len(list(f.keys())))]
        return Resumed(start, dense, hidden) if start > 0 else None

    def results(self, total: int) -> SavedResults:
        return SavedResults(self, total)

    def _done(self) -> int | None:
        try:
            req = json.loads((self.dir / "request.json").read_text())
            if req.get("key") != self.key:
                return None
            return int(json.loads((self.dir / "done.json").read_text())["blocks"])
        except (OSError, ValueError, KeyError):
            return None

    def _read_dense(self, i: int) -> dict[str, torch.Tensor]:
        meta = json.loads((self.dir / f"block-{i:05d}.json").read_text())
        with safe_open(str(self.dir / f"block-{i:05d}.safetensors"), framework="pt") as f:
            return {n: f.get_tensor(f"d:{n}") for n in meta["dense"]}

    def read_result(self, i: int, name: str) -> QuantResult:
        m = json.loads((self.dir / f"block-{i:05d}.json").read_text())["results"][name]
        with safe_open(str(self.dir / f"block-{i:05d}.safetensors"), framework="pt") as f:
            keys = set(f.keys())
            t = {a: f.get_tensor(f"r:{name}:{a}") for a in _TENSORS if f"r:{name}:{a}" in keys}
            extra = {k: f.get_tensor(f"x:{name}:{k}") for k in m["extra"]}
        return QuantResult(name=name, scheme=QuantScheme(**m["scheme"]), **t, extra=extra,
                           loss=m["loss"], seconds=m["seconds"],
                           calib_tokens=m.get("calib_tokens"), fallback=m.get("fallback"))

    # ---------------------------------------------------------------- writing
    def _reset(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        (self.dir / "request.json").write_text(json.dumps({"key": self.key, **self.describe},
                                                          indent=1, default=str))

    def save(self, index: int, total: int, results: dict[str, QuantResult],
             dense: dict[str, torch.Tensor], hidden: list[torch.Tensor] | None) -> None:
        """Block `index` is finished: its results, unquantized tensors and output hidden states."""
        trim_heap()  # the method's temporaries, before the copies below
        if not (self.dir / "request.json").is_file():
            self._reset()
        tensors: dict[str, torch.Tensor] = {}
        meta: dict = {"results": {}, "dense": list(dense)}
        for name, r in results.items():
            for a in _TENSORS:
                v = getattr(r, a)
                if v is not None:
                    tensors[f"r:{name}:{a}"] = v.detach().cpu().clone()
            for k, v in r.extra.items():
                tensors[f"x:{name}:{k}"] = v.detach().cpu().clone()
            meta["results"][name] = {"scheme": asdict(r.scheme), "extra": list(r.extra),
                                     "loss": r.loss, "seconds": r.seconds,
                                     "calib_tokens": r.calib_tokens, "fallback": r.fallback}
        for n, v in dense.items():
            tensors[f"d:{n}"] = v.detach().cpu().clone()
        stem = f"block-{index:05d}"
        _atomic_write(self.dir / f"{stem}.safetensors", lambda p: save_file(tensors, str(p)))
        _atomic_write(self.dir / f"{stem}.json", lambda p: p.write_text(json.dumps(meta)))
        if hidden is not None:
            hs = {f"h.{j}": h.detach().cpu().contiguous() for j, h in enumerate(hidden)}
            _atomic_write(self.dir / f"hidden-{index:05d}.safetensors",
                          lambda p: save_file(hs, str(p)))
        _atomic_write(self.dir / "done.json",
                      lambda p: p.write_text(json.dumps({"blocks": index + 1, "total": total})))
        old = self.dir / f"hidden-{index - 1:05d}.safetensors"
        old.unlink(missing_ok=True)  # only the newest hidden states are ever needed

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
