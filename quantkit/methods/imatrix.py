"""llama.cpp importance matrices: per input column mean of x^2 for every block matmul.

Files are llama-imatrix's: GGUF (general.type = "imatrix", `imatrix.datasets`,
`imatrix.chunk_count`, `imatrix.chunk_size`, and per weight two F32 tensors
`<name>.in_sum2` [n_mat, K] and `<name>.counts` [n_mat, 1]) or the legacy binary `.dat`:

  int32 n_entries, then per entry: int32 len, name bytes, int32 ncall, int32 nval,
  float32[nval] (already divided by the token count and multiplied by ncall);
  optional trailer: int32 chunk_count, int32 len, dataset bytes.

The quantizer uses `in_sum2 / counts` (float32), as llama-quantize's loader does. A 3-D expert
tensor (`ffn_*_exps`) has one matrix per expert: in_sum2 [E, K], counts [E, 1], and an expert
whose count is 0 gets importance 1 in every column (tools/quantize/quantize.cpp).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from quantkit.errors import ModelLoadError

__all__ = ["ImatrixData", "load_imatrix", "save_imatrix"]


@dataclass
class ImatrixData:
    values: dict[str, torch.Tensor]  # GGUF weight name -> float32 [n_mat * K] (n_mat: experts)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    legacy: bool = False


def save_imatrix(path: str | Path, entries: dict[str, tuple[torch.Tensor, int | list[int]]], *,
                 datasets: list[str], chunk_count: int, chunk_size: int) -> None:
    """Write {name: (sum of x^2 per column [K], token count)} as a llama.cpp GGUF imatrix
    (an expert tensor: sums [E, K] and one count per expert)."""
    from gguf import GGUFWriter

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer = GGUFWriter(str(tmp), arch="imatrix")  # the loader ignores general.architecture
    writer.add_string("general.type", "imatrix")
    writer.add_array("imatrix.datasets", list(datasets))
    writer.add_uint32("imatrix.chunk_count", int(chunk_count))
    writer.add_uint32("imatrix.chunk_size", int(chunk_size))
    for name in sorted(entries):
        sums, count = entries[name]
        counts = np.asarray(count, dtype=np.float32).reshape(-1, 1)
        writer.add_tensor(f"{name}.in_sum2",
                          sums.detach().cpu().float().numpy().reshape(counts.shape[0], -1))
        writer.add_tensor(f"{name}.counts", counts)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def load_imatrix(path: str | Path) -> ImatrixData:
    """Read a GGUF or legacy imatrix into per-weight importance vectors."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"imatrix file {path} does not exist.", _IMATRIX_HINT)
    with open(path, "rb") as f:
        magic = f.read(4)
    try:
        return _load_gguf(path) if magic == b"GGUF" else _load_legacy(path)
    except (ValueError, TypeError, struct.error, KeyError, IndexError) as exc:
        raise ModelLoadError(f"{path} is not a readable llama.cpp imatrix: {exc}",
                             _IMATRIX_HINT) from exc


_IMATRIX_HINT = ("Pass an imatrix written by llama-imatrix or quantkit to --imatrix, or collect "
                 "one from calibration data with --calib SET instead.")


def _load_gguf(path: Path) -> ImatrixData:
    from quantkit.readers import read_gguf

    kv, tensors = read_gguf(path, hint=_IMATRIX_HINT)  # header validated before any value is read
    sums, counts = {}, {}
    for t in tensors.values():
        for suffix, into in ((".in_sum2", sums), (".counts", counts)):
            if t.name.endswith(suffix):
                if t.qtype.name != "F32":
                    raise ValueError(f"{t.name} is {t.qtype.name}, not F32")
                into[t.name[:-len(suffix)]] = np.asarray(t.data).reshape(-1).view(np.float32)
    if set(sums) != set(counts):
        raise ValueError(f"mismatched sums and counts for {sorted(set(sums) ^ set(counts))[:3]}")
    for key in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"):
        if key not in kv:
            raise ValueError(f"missing imatrix metadata {key}")
    values = {}
    for name, s in sums.items():
        c = np.rint(counts[name].reshape(-1)).astype(np.float32)  # std::lround
        s = s.reshape(c.shape[0], -1)
        v = np.where(c[:, None] > 0, s / np.where(c > 0, c, 1)[:, None], np.float32(1))
        values[name] = torch.from_numpy(np.ascontiguousarray(v.reshape(-1), dtype=np.float32))
    ds = kv["imatrix.datasets"]
    datasets = [s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                for s in (ds if isinstance(ds, list) else [ds])]
    return ImatrixData(values, datasets, int(kv["imatrix.chunk_count"]))


def _load_legacy(path: Path) -> ImatrixData:
    buf = path.read_bytes()
    off = 0

    def take(fmt: str):
        nonlocal off
        out = struct.unpack_from(fmt, buf, off)
        off += struct.calcsize(fmt)
        return out

    (n_entries,) = take("<i")
    if n_entries < 1 or n_entries * 16 > len(buf):  # an entry takes at least 16 bytes
        raise ValueError(f"{n_entries} entries in {len(buf)} bytes")
    values = {}
    for _ in range(n_entries):
        (n,) = take("<i")
        if n < 0 or off + n > len(buf):
            raise ValueError(f"name length {n} at byte {off - 4} runs past the end")
        name = buf[off:off + n].decode("utf-8")
        off += n
        ncall, nval = take("<ii")
        if nval < 1 or off + 4 * nval > len(buf):
            raise ValueError(f"bad entry {name!r}")
        v = np.frombuffer(buf, dtype="<f4", count=nval, offset=off).astype(np.float32)
        off += 4 * nval
        if ncall > 0:
            v = v / np.float32(ncall)
        values[name] = torch.from_numpy(v.copy())
    datasets, chunk_count = [], 0
    if off + 4 <= len(buf):
        (chunk_count,) = take("<i")
        if off + 4 <= len(buf):
            (n,) = take("<i")
            if n > 0:
                datasets.append(buf[off:off + n].decode("utf-8", "replace"))
    return ImatrixData(values, datasets, chunk_count, legacy=True)
