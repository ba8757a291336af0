"""Reading the files a user names, safely: JSON (config.json and friends), safetensors headers,
the shard list of a model directory, and a NaN/Inf scan of its weights.

Every malformed or foreign input becomes one ModelLoadError (BadWeights for non-finite values)
that names the file and what is wrong, before any long work and before any third-party reader
(safetensors, transformers) sees the bytes. Nothing here writes.

Paths in model.safetensors.index.json: an entry must name a file inside the model directory
(relative, no `..` leaving it); absolute paths and escapes are refused. Files inside the directory
may be symlinks and are followed: the Hugging Face cache builds every snapshot from symlinks into
`../../blobs/`, and a link placed in the directory is its owner's choice, unlike an index entry.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from quantkit.errors import BadWeights, ModelLoadError

__all__ = ["read_json", "read_config_json", "safetensors_header", "safetensors_files",
           "safetensors_headers", "tensor_files", "count_nonfinite", "scan_finite",
           "SAFETENSORS_ITEMSIZE", "INDEX_FILE"]

INDEX_FILE = "model.safetensors.index.json"
JSON_MAX_BYTES = 256 * 2**20  # far above any real config/index/metadata file
SAFETENSORS_MAX_HEADER = 100_000_000  # what the safetensors library itself accepts
SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                        "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
                        "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
_REEXPORT_HINT = "Re-download or re-export the checkpoint; the file is unreadable as it is."


# ------------------------------------------------------------------ JSON

def read_json(file: Path, what: str | None = None, *, hint: str | None = None) -> dict:
    """A JSON object from `file`, or a ModelLoadError saying why it is not one (missing, binary,
    not JSON, not an object). `what` names the file's role in the message."""
    file = Path(file)
    what = what or file.name
    hint = hint or "Restore the file from the original model or re-export the directory."
    if not file.is_file():
        raise ModelLoadError(f"{what} {file} does not exist or is not a file.", hint)
    size = file.stat().st_size
    if size > JSON_MAX_BYTES:
        raise ModelLoadError(f"{what} {file} is {size} bytes, too large for a JSON file here.", hint)
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{what} {file} is not UTF-8 text (binary data at byte {exc.start}).",
                             hint) from exc
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except ValueError as exc:
        raise ModelLoadError(f"{what} {file} is not valid JSON: {exc}.", hint) from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{what} {file} holds a JSON {type(data).__name__}, not an object.",
                             hint)
    return data


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def read_config_json(path: Path) -> dict:
    """config.json of a model or artifact directory as a dict (one reader for every command)."""
    return read_json(Path(path) / "config.json", "config.json",
                     hint="Copy config.json from the original Hugging Face model into "
                          f"{Path(path)}, or pass the directory written by `quantkit quantize -o`.")


# ------------------------------------------------------------------ safetensors

def _corrupt(file: Path, why: str) -> ModelLoadError:
    return ModelLoadError(f"Corrupt safetensors file {file}: {why}.", _REEXPORT_HINT)


def safetensors_header(file: Path) -> tuple[dict[str, dict], dict]:
    """(tensors, __metadata__) of one safetensors file, validated against the file size.

    Mirrors the safetensors library's own rules so it never fails later: 8-byte length within
    the file, a UTF-8 JSON object, known dtypes, non-negative integer shapes, data offsets
    whose length is numel * itemsize, tensors tiling the data section exactly (in bounds, no
    overlap, no gap, nothing after the last one).
    """
    file = Path(file)
    if not file.is_file():
        raise ModelLoadError(f"Safetensors file {file} does not exist or is not a file.",
                             _REEXPORT_HINT)
    size = file.stat().st_size
    if size < 8:
        raise _corrupt(file, f"only {size} bytes, shorter than the 8-byte header length")
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n < 2 or n > size - 8:
            raise _corrupt(file, f"header length {n} does not fit in the file ({size} bytes)"
                                 + (": the file is truncated" if n > size - 8 else ""))
        if n > SAFETENSORS_MAX_HEADER:
            raise _corrupt(file, f"header length {n} exceeds the format's limit "
                                 f"({SAFETENSORS_MAX_HEADER} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _corrupt(file, f"header is not a UTF-8 JSON object ({exc})") from exc
    if not isinstance(header, dict):
        raise _corrupt(file, "header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _corrupt(file, "__metadata__ must map strings to strings")
    data_len = size - 8 - n
    spans = []
    for name, info in header.items():
        spans.append((*_tensor_span(file, name, info), name))
    spans.sort()
    expected, prev = 0, None
    for begin, end, name in spans:
        if begin < expected:
            raise _corrupt(file, f"tensor {name!r} (bytes {begin}..{end}) overlaps tensor "
                                 f"{prev!r} (ends at {expected})")
        if begin > expected:
            raise _corrupt(file, f"{begin - expected} unused bytes before tensor {name!r}")
        if end > data_len:
            raise _corrupt(file, f"tensor {name!r} ends at byte {end} of a {data_len}-byte data "
                                 "section: the file is truncated")
        expected, prev = end, name
    if expected != data_len:
        raise _corrupt(file, f"{data_len - expected} bytes after the last tensor "
                             f"(data section {data_len} bytes, tensors end at {expected})")
    return header, meta


def _tensor_span(file: Path, name: str, info) -> tuple[int, int]:
    """(begin, end) of one header entry after checking its dtype, shape and offsets."""
    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(info, dict):
        raise _corrupt(file, f"entry {name!r} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in SAFETENSORS_ITEMSIZE:
        raise _corrupt(file, f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(is_int(d) for d in shape):
        raise _corrupt(file, f"tensor {name!r} has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(o) for o in offsets)
            or offsets[1] < offsets[0]):
        raise _corrupt(file, f"tensor {name!r} has invalid data_offsets {offsets!r}")
    numel = 1
    for d in shape:
        numel *= d
    if offsets[1] - offsets[0] != numel * SAFETENSORS_ITEMSIZE[dtype]:
        raise _corrupt(file, f"tensor {name!r}: {dtype} {shape} needs "
                             f"{numel * SAFETENSORS_ITEMSIZE[dtype]} bytes but its data_offsets "
                             f"span {offsets[1] - offsets[0]}")
    return offsets[0], offsets[1]


def _inside(root: Path, entry: str) -> Path | None:
    """root / entry when `entry` is a relative path that stays inside root, else None."""
    if not entry or "\x00" in entry or os.path.isabs(entry) or entry.startswith("\\"):
        return None
    parts = PurePosixPath(entry.replace("\\", "/")).parts
    depth = 0
    for part in parts:
        depth += -1 if part == ".." else (0 if part == "." else 1)
        if depth < 0:
            return None
    return root / entry


def tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a model directory, from its index when it has one.

    Refuses index entries outside the directory and shards the index names but lacks, and
    validates every shard header (safetensors_header)."""
    path = Path(path)
    index = path / INDEX_FILE
    if not index.exists():
        out: dict[str, Path] = {}
        for file in sorted(path.glob("*.safetensors")):
            for name in safetensors_header(file)[0]:
                if name in out:
                    raise ModelLoadError(
                        f"Tensor {name!r} is stored twice: in {out[name].name} and {file.name}.",
                        "Remove the stray shard, or add the model's "
                        f"{INDEX_FILE} so quantkit knows which shard is meant.")
                out[name] = file
        return out
    hint = f"Restore {INDEX_FILE} and the shards it lists from the original model."
    weight_map = read_json(index, INDEX_FILE, hint=hint).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index} has no 'weight_map' object naming the shards.", hint)
    files: dict[str, Path] = {}
    for name, entry in weight_map.items():
        file = _inside(path, entry) if isinstance(entry, str) else None
        if file is None:
            raise ModelLoadError(
                f"{index} maps tensor {name!r} to {entry!r}, which is not a file inside the "
                f"model directory; quantkit reads shards only from {path}.",
                "Shards must be listed by file name relative to the model directory "
                "(e.g. model-00001-of-00002.safetensors); copy them into the directory.")
        if not file.is_file():
            raise ModelLoadError(f"{index} maps tensor {name!r} to shard {entry!r}, which is "
                                 f"missing from {path}.", hint)
        files[name] = file
    headers = {f: safetensors_header(f)[0] for f in sorted(set(files.values()))}
    for name, file in files.items():
        if name not in headers[file]:
            raise ModelLoadError(f"{index} says tensor {name!r} is in {file.name}, but that shard "
                                 "holds no such tensor.", hint)
    return files


def safetensors_files(path: Path) -> list[Path]:
    """The validated safetensors files of a directory (the index's shards when it has one)."""
    return sorted(set(tensor_files(path).values()))


def safetensors_headers(path: Path) -> dict[str, dict]:
    """dtype / shape / data_offsets of every tensor of a directory, validated, data not read."""
    out: dict[str, dict] = {}
    for file in safetensors_files(path):
        out.update(safetensors_header(file)[0])
    return out


# ------------------------------------------------------------------ NaN / Inf

def count_nonfinite(t: torch.Tensor) -> int:
    """How many NaN/Inf values `t` holds (0 for integer tensors).

    NaN or Inf anywhere makes the float32 sum non-finite: one fast reduction (isfinite on bf16
    runs ~10x slower on CPU); only a non-finite sum, which finite values can also give by
    overflowing, needs the exact element check."""
    if not t.is_floating_point() or t.numel() == 0:
        return 0
    if torch.isfinite(t.sum(dtype=torch.float32)):
        return 0
    return int((~torch.isfinite(t)).sum())


# Raw bits of a float are NaN/Inf when (bits & abs_mask) >= the bits of +Inf (exponent all
# ones; float8 E4M3 has no Inf, its NaN is 0x7F): one AND and one max per chunk, on the
# integer view, single-threaded numpy on small chunks (SmolLM2-135M, 269 MB: ~0.1 s CPU;
# torch's float32 sum of bf16 took 10x that, and its thread pool stalls on a busy machine).
_NONFINITE_BITS = {"F64": (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
                   "F32": (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
                   "F16": (np.uint16, 0x7FFF, 0x7C00), "BF16": (np.uint16, 0x7FFF, 0x7F80),
                   "F8_E4M3": (np.uint8, 0x7F, 0x7F), "F8_E5M2": (np.uint8, 0x7F, 0x7C)}


def scan_finite(path: Path, on_progress=None, chunk_bytes: int = 2**20) -> None:
    """Refuse a model directory whose safetensors hold NaN/Inf in any floating tensor, naming
    the tensor: one streamed pass over the shards in `chunk_bytes` pieces, before any work."""
    files = safetensors_files(path)
    chunk = bytearray(chunk_bytes)
    for i, file in enumerate(files):
        header, _ = safetensors_header(file)
        with open(file, "rb") as f:
            data_start = 8 + int.from_bytes(f.read(8), "little")
            for name, info in header.items():
                if info["dtype"] not in _NONFINITE_BITS:
                    continue
                int_dtype, abs_mask, inf_bits = _NONFINITE_BITS[info["dtype"]]
                itemsize = SAFETENSORS_ITEMSIZE[info["dtype"]]
                begin, end = (data_start + o for o in info["data_offsets"])
                step = chunk_bytes // itemsize * itemsize
                f.seek(begin)
                bad = 0
                for lo in range(begin, end, step):
                    view = memoryview(chunk)[:min(step, end - lo)]
                    f.readinto(view)
                    bits = np.frombuffer(view, dtype=int_dtype) & int_dtype(abs_mask)
                    if bits.max() >= inf_bits:
                        bad += int(np.count_nonzero(bits >= inf_bits))
                if bad:
                    raise BadWeights(
                        f"Tensor {name} contains {bad} NaN/Inf values (in {file.name}); "
                        "refusing to quantize.",
                        "The checkpoint is damaged or was saved after a diverged step; fix it "
                        "first.")
        if on_progress is not None:
            on_progress("checking weights for NaN/Inf", i + 1, len(files))
