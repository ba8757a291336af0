"""Per-block checkpoints, so a killed `quantize` continues where it stopped.

Layout of `.OUT.partial/` (next to the output, hidden):
  request.json              the request key (sha256) and what it was made from
  block-00007.safetensors   block 7's QuantResult tensors and its unquantized tensors
  block-00007.json          the QuantResults' non-tensor fields
  hidden-00005.safetensors  calibration hidden states after block 5 (block 6's inputs)
  done.json                 {"blocks": 8, "total": 32, "hidden": 5}: written last, atomically;
                            the only progress marker
No pickle: tensors are safetensors, everything else JSON. A checkpoint whose key differs from
the request (other model, scheme, options or calibration) is deleted, never resumed.

Cost, and why it is bounded (issue 23: the checkpoints made the 8B disk-to-disk GPTQ run 2.5x
slower, 44.8 s of block loop instead of 12.1): every file is written by one background thread
while the next block computes, in order, so `done.json` never names a block whose files are not
complete. A block's results are saved for every block (small). The hidden states (128 x 2048
tokens of an 8B model: 2 GiB) are saved only when the writer is idle and at least
HIDDEN_INTERVAL x the last hidden write's seconds have passed since that write began, and
never after the last block (nothing reads them). A resume starts after the newest saved hidden
states and redoes the blocks after it (the same inputs give the same results, so the artifact
is byte-identical); that redo is bounded by about HIDDEN_INTERVAL + 1 hidden writes' time.
No fsync: each file is written to a temporary name and renamed into place, so a process that
dies at any instant (SIGINT, SIGKILL, out of memory) leaves every named file complete: the
kernel's page cache outlives the process. Only a machine crash can lose unsynced pages; a
resume that finds a file it cannot read starts over instead (`resume`).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import threading
import time
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
HIDDEN_INTERVAL = 2.0  # hidden states saved at most once per this many x their write's seconds


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
    """Write under a temporary name, then rename: the name holds the old or the new file, whole
    (no fsync: see the module docstring)."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A private contiguous CPU copy (the caller's tensor may be freed or reused after)."""
    t = t.detach()
    return t.to("cpu", copy=True).contiguous() if t.is_cuda else t.clone().contiguous()


class BlockCheckpoint:
    """Saves finished blocks under `directory`; `resume` returns them if `key` matches.

    `save` hands the writing to one background thread; `close` waits for it (and raises what
    it raised). Call `close` before reading `results` and when the run stops early, so that
    what the checkpoint holds is what its message says.
    """

    def __init__(self, directory: Path, key: str, describe: dict | None = None):
        self.dir = Path(directory)
        self.key = key
        self.describe = describe or {}
        self._jobs: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._hidden_index = -1  # newest block whose output hidden states are on disk
        self._hidden_busy = False  # a hidden-state write is queued or running
        self._hidden_began = 0.0
        self._hidden_cost: float | None = None  # seconds of the last hidden-state write

    # ---------------------------------------------------------------- reading
    def resume(self, total: int, needs_hidden: bool = True) -> Resumed | None:
        """Earlier blocks of this very request, or None (a stale or unreadable checkpoint is
        removed). With `needs_hidden` (calibrated methods) the run continues after the newest
        saved hidden states; the finished blocks after them are redone."""
        state = self._done()
        if state is None:
            self._reset()
            return None
        blocks, hidden_index = state
        start = min(blocks, total)
        if needs_hidden and start < total:
            start = min(start, hidden_index + 1)
        if start <= 0:
            return None
        try:
            dense: dict[str, torch.Tensor] = {}
            for i in range(start):
                dense.update(self._read_dense(i))
            hidden = None
            if needs_hidden and start < total:
                with safe_open(str(self.dir / f"hidden-{start - 1:05d}.safetensors"),
                               framework="pt") as f:
                    hidden = [f.get_tensor(f"h.{j}") for j in range(len(list(f.keys())))]
        except Exception:  # noqa: BLE001 - a file lost to a machine crash: start over
            self._reset()
            return None
        self._hidden_index = start - 1 if hidden is not None else -1
        return Resumed(start, dense, hidden)

    def results(self, total: int) -> SavedResults:
        return SavedResults(self, total)

    def _done(self) -> tuple[int, int] | None:
        """(finished blocks, newest block with saved hidden states) of this request, or None."""
        try:
            req = json.loads((self.dir / "request.json").read_text())
            if req.get("key") != self.key:
                return None
            done = json.loads((self.dir / "done.json").read_text())
            blocks = int(done["blocks"])
            return blocks, int(done.get("hidden", blocks - 1))  # older checkpoints: every block
        except (OSError, ValueError, KeyError, TypeError):
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
        """Block `index` is finished: queue its results, unquantized tensors and (when the
        policy in the module docstring says so) its output hidden states for writing.

        The tensors are copied by the writer thread, not here: callers must not change them
        in place afterwards (the block loop never does: a block's inputs are read again by
        replays, and results and unquantized tensors are final)."""
        self._raise_error()
        trim_heap()  # the method's temporaries, before the copies
        if not (self.dir / "request.json").is_file():
            self._reset()
        meta: dict = {"results": {}, "dense": list(dense)}
        named: dict[str, torch.Tensor] = {}
        for name, r in results.items():
            for a in _TENSORS:
                v = getattr(r, a)
                if v is not None:
                    named[f"r:{name}:{a}"] = v
            for k, v in r.extra.items():
                named[f"x:{name}:{k}"] = v
            meta["results"][name] = {"scheme": asdict(r.scheme), "extra": list(r.extra),
                                     "loss": r.loss, "seconds": r.seconds,
                                     "calib_tokens": r.calib_tokens, "fallback": r.fallback}
        named.update({f"d:{n}": v for n, v in dense.items()})
        keep_hidden = hidden is not None and index + 1 < total and self._hidden_due()
        ready = None
        if keep_hidden:
            self._hidden_busy = True
            self._hidden_began = time.perf_counter()
            if any(h.is_cuda for h in hidden):  # copied on a side stream once computed
                ready = torch.cuda.Event()
                ready.record()
        hidden = list(hidden) if keep_hidden else None

        def write() -> None:
            stem = f"block-{index:05d}"
            tensors = {k: _host_copy(v) for k, v in named.items()}
            _atomic_write(self.dir / f"{stem}.safetensors", lambda p: save_file(tensors, str(p)))
            _atomic_write(self.dir / f"{stem}.json", lambda p: p.write_text(json.dumps(meta)))
            if hidden is not None:
                self._write_hidden(index, hidden, ready)
            _atomic_write(self.dir / "done.json", lambda p: p.write_text(json.dumps(
                {"blocks": index + 1, "total": total, "hidden": self._hidden_index})))

        if self._jobs is None:
            self._jobs = queue.Queue()
            self._thread = threading.Thread(target=self._write_loop, daemon=True,
                                            name="quantkit-checkpoint")
            self._thread.start()
        self._jobs.put(write)

    def _hidden_due(self) -> bool:
        if self._hidden_busy:
            return False
        return self._hidden_cost is None or \
            time.perf_counter() - self._hidden_began >= HIDDEN_INTERVAL * self._hidden_cost

    def _write_hidden(self, index: int, hidden: list[torch.Tensor], ready) -> None:
        """Write the hidden states, then drop the previous ones: only the newest are ever read.
        GPU ones are first copied to host memory on a side stream after `ready` (their GPU
        memory is then free to go); host ones are written as they are, without a copy (a
        2 GiB clone of an 8B model's states would only add RAM), kept alive until written."""
        began = time.perf_counter()
        try:
            if ready is not None:
                stream = torch.cuda.Stream(hidden[0].device)
                with torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    hs = {f"h.{j}": _host_copy(h) for j, h in enumerate(hidden)}
            else:
                hs = {f"h.{j}": h.detach().contiguous() for j, h in enumerate(hidden)}
            hidden.clear()
            _atomic_write(self.dir / f"hidden-{index:05d}.safetensors",
                          lambda p: save_file(hs, str(p)))
            old, self._hidden_index = self._hidden_index, index
            if old >= 0 and old != index:
                (self.dir / f"hidden-{old:05d}.safetensors").unlink(missing_ok=True)
        finally:
            self._hidden_cost = time.perf_counter() - began
            self._hidden_busy = False

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._error is None:  # after a failure nothing more is written
                try:
                    job()
                except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                    self._error = exc

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Wait until every queued block is on disk; raise the writer's error, if any."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = self._jobs = None
        self._raise_error()

    def remove(self) -> None:
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)
