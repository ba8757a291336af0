"""Reading the files a user names, safely: JSON (config.json and friends), safetensors headers,
the shard list of a model directory, a NaN/Inf scan of its weights, and GGUF headers (GGUF
artifacts and llama.cpp imatrix files: formats/ and methods/ both read them, so it lives here).

Every malformed or foreign input becomes one ModelLoadError (BadWeights for non-finite values)
that names the file and what is wrong, before any long work and before any third-party reader
(safetensors, transformers) sees the bytes. Nothing here writes.

Paths in model.safetensors.index.json: an entry must name a file inside the model directory
(relative, no `..` leaving it); absolute paths and escapes are refused. Files inside the directory
may be symlinks and are followed: the Hugging Face cache builds every snapshot from symlinks into
`../../blobs/`, and a link placed in the directory is its owner's choice, unlike an index entry.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from quantkit.errors import BadWeights, ModelLoadError

__all__ = ["read_json", "read_config_json", "safetensors_header", "safetensors_files",
           "safetensors_headers", "tensor_files", "model_fingerprint", "scan_finite",
           "SAFETENSORS_ITEMSIZE", "INDEX_FILE", "read_gguf", "bad_gguf", "GGUFTensor"]

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


def model_fingerprint(path: Path) -> dict:
    """config.json's hash plus each weight file's name, size and mtime (cheap, no full read)."""
    path = Path(path)
    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns]
             for p in sorted(path.glob("*.safetensors"))}
    cfg = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
    return {"config_sha256": cfg, "weights": files}


# ------------------------------------------------------------------ NaN / Inf

# Raw bits of a float are NaN/Inf when (bits & abs_mask) >= the bits of +Inf (exponent all
# ones; float8 E4M3 has no Inf, its NaN is 0x7F): one AND and one max per chunk, on the
# integer view, numpy on 16 MiB pieces in a few threads (on SmolLM2-135M far faster than
# model_io.check_finite's float32 sum of bf16 in torch, whose thread pool also stalls on a
# busy machine).
_NONFINITE_BITS = {"F64": (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
                   "F32": (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
                   "F16": (np.uint16, 0x7FFF, 0x7C00), "BF16": (np.uint16, 0x7FFF, 0x7F80),
                   "F8_E4M3": (np.uint8, 0x7F, 0x7F), "F8_E5M2": (np.uint8, 0x7F, 0x7C)}


def scan_finite(path: Path, on_progress=None, chunk_bytes: int = 16 * 2**20,
                workers: int | None = None,
                checked_later: Callable[[str], bool] | None = None) -> None:
    """Refuse a model directory whose safetensors hold NaN/Inf in any floating tensor, naming
    the tensor: one streamed pass over the shards before any work. Tensors for which
    `checked_later(name)` is true are left out: the caller checks them as it reads them.

    Pieces of at most `chunk_bytes` are read (os.pread) and checked (numpy, which releases the
    GIL) by `workers` threads, so the pass runs at the disk's speed rather than one core's
    (issue 23: the single-threaded 1 MiB pass was part of 7.8-11.6 s spent outside the block
    loop of an 8B-shaped disk-to-disk run). The first bad tensor in file order is named."""
    files = safetensors_files(path)
    pieces: list[tuple[int, str, Path, str, int, int]] = []  # (file number, name, file, ...)
    for i, file in enumerate(files):
        header, _ = safetensors_header(file)
        with open(file, "rb") as f:
            data_start = 8 + int.from_bytes(f.read(8), "little")
        for name, info in header.items():
            if info["dtype"] not in _NONFINITE_BITS or (checked_later and checked_later(name)):
                continue
            itemsize = SAFETENSORS_ITEMSIZE[info["dtype"]]
            begin, end = (data_start + o for o in info["data_offsets"])
            step = max(chunk_bytes // itemsize, 1) * itemsize
            pieces.extend((i, name, file, info["dtype"], lo, min(lo + step, end))
                          for lo in range(begin, end, step))
    if workers is None:
        workers = min(8, os.cpu_count() or 1)

    def count_bad(piece) -> int:
        _, _, file, dtype, lo, hi = piece
        int_dtype, abs_mask, inf_bits = _NONFINITE_BITS[dtype]
        fd = os.open(file, os.O_RDONLY)
        try:
            data = os.pread(fd, hi - lo, lo)
        finally:
            os.close(fd)
        bits = np.frombuffer(data, dtype=int_dtype) & int_dtype(abs_mask)
        return int(np.count_nonzero(bits >= inf_bits)) if bits.max() >= inf_bits else 0

    from concurrent.futures import ThreadPoolExecutor

    bad: dict[tuple[int, str], int] = {}
    reported = 0
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for piece, n in zip(pieces, pool.map(count_bad, pieces), strict=True):
            i, name, file = piece[:3]
            while on_progress is not None and reported < i:  # files before this one are done
                reported += 1
                on_progress("checking weights for NaN/Inf", reported, len(files))
            if n:
                bad[(i, name)] = bad.get((i, name), 0) + n
    if bad:
        (i, name), n = next(iter(bad.items()))
        raise BadWeights(
            f"Tensor {name} contains {n} NaN/Inf values (in {files[i].name}); "
            "refusing to quantize.",
            "The checkpoint is damaged or was saved after a diverged step; fix it first.")
    while on_progress is not None and reported < len(files):
        reported += 1
        on_progress("checking weights for NaN/Inf", reported, len(files))


# ------------------------------------------------------------------ GGUF

@dataclass
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (rows first)
    data: np.ndarray  # raw bytes, [rows, row_bytes] uint8 (memory-mapped)


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
GGML_MAX_DIMS = 4  # llama.cpp refuses more


class _Truncated(Exception):
    """A read ran past the end of the file (turned into one ModelLoadError by read_gguf)."""


def read_gguf(path: str | Path, *, hint: str | None = None) -> tuple[dict, dict[str, GGUFTensor]]:
    """(KV metadata, tensors) of a GGUF file, every header field validated against the file
    (magic, version, counts, string and array lengths, value and tensor types, dims, alignment,
    tensor data within the file) so a truncated or foreign file gives one clear ModelLoadError
    before gguf-py or llama.cpp see it. gguf's GGUFReader builds a numpy view per array element
    (seconds for a 50K-token vocabulary); this reads values straight from the bytes. `hint`
    replaces the error's hint (what to do depends on what the file was meant to be)."""
    path = Path(path)
    try:
        try:
            return _read_gguf(path)
        except _Truncated as exc:
            raise bad_gguf(path, f"truncated: {exc}") from None
        except (ValueError, OverflowError, struct.error) as exc:  # not expected; never a traceback
            raise bad_gguf(path, str(exc)) from exc
    except ModelLoadError as exc:
        exc.hint = hint or exc.hint
        raise


def bad_gguf(path: Path, why: str) -> ModelLoadError:
    return ModelLoadError(f"Corrupt or foreign GGUF file {path}: {why}.",
                          "Re-download it, or write it again with `quantkit quantize MODEL "
                          "--method gguf -o FILE.gguf`; llama.cpp cannot load it as it is.")


def _read_gguf(path: Path) -> tuple[dict, dict[str, GGUFTensor]]:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist or is not a file.",
                             "Pass the .gguf file written by `quantkit quantize --method gguf`.")
    size = path.stat().st_size
    if size < 24:
        raise bad_gguf(path, f"only {size} bytes, shorter than the 24-byte GGUF header")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    mv = memoryview(buf)
    off = 0

    def take(fmt: str, what: str):
        nonlocal off
        n = struct.calcsize(fmt)
        if off + n > size:
            raise _Truncated(f"{what} at byte {off} runs past the end ({size} bytes)")
        v = struct.unpack_from(fmt, mv, off)[0]
        off += n
        return v

    def string(what: str) -> str:
        nonlocal off
        n = take("<Q", f"length of {what}")
        if n > size - off:
            raise _Truncated(f"{what} at byte {off} claims {n} bytes, {size - off} are left")
        s_ = bytes(mv[off:off + n]).decode("utf-8", errors="surrogateescape")
        off += n
        return s_

    def value(vtype: int, key: str, nested: bool = False):
        nonlocal off
        if vtype == _STRING:
            return string(f"string value of {key!r}")
        if vtype == _ARRAY and not nested:
            etype, n = take("<I", f"array type of {key!r}"), take("<Q", f"array length of {key!r}")
            if etype not in _SCALAR and etype != _STRING:
                raise bad_gguf(path, f"key {key!r}: array of unknown value type {etype}")
            least = 8 if etype == _STRING else struct.calcsize(_SCALAR[etype])
            if n * least > size - off:
                raise _Truncated(f"array {key!r} at byte {off} claims {n} elements, "
                                 f"more than the {size - off} bytes left hold")
            if etype in _SCALAR and etype != 7:
                dt = np.dtype(_SCALAR[etype])
                arr = np.frombuffer(mv, dtype=dt, count=n, offset=off)
                off += n * dt.itemsize
                return arr.tolist()
            return [value(etype, key, nested=True) for _ in range(n)]
        if vtype not in _SCALAR:
            raise bad_gguf(path, f"key {key!r} has unknown value type {vtype}")
        return take(_SCALAR[vtype], f"value of {key!r}")

    if bytes(mv[:4]) != b"GGUF":
        raise bad_gguf(path, f"magic is {bytes(mv[:4])!r}, not b'GGUF'")
    off = 4
    version = take("<I", "version")
    if version not in (2, 3):
        raise bad_gguf(path, f"GGUF version {version} (llama.cpp reads versions 2 and 3"
                              + (", little-endian only" if version > 0xFFFF else "") + ")")
    n_tensors, n_kv = take("<Q", "tensor count"), take("<Q", "KV count")
    # a KV pair takes at least 13 bytes (key length, type, 1-byte value), a tensor info 32
    if n_kv * 13 + n_tensors * 32 > size - off:
        raise bad_gguf(path, f"the header declares {n_kv} KV pairs and {n_tensors} tensors, "
                              f"more than a {size}-byte file can hold")
    kv = {}
    for i in range(n_kv):
        key = string(f"key {i}")
        if key in kv:
            raise bad_gguf(path, f"key {key!r} appears twice")
        kv[key] = value(take("<I", f"type of {key!r}"), key)
    infos = []
    for i in range(n_tensors):
        name = string(f"name of tensor {i}")
        n_dims = take("<I", f"dimension count of {name!r}")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise bad_gguf(path, f"tensor {name!r} has {n_dims} dimensions (1..{GGML_MAX_DIMS})")
        dims = [take("<Q", f"dimensions of {name!r}") for _ in range(n_dims)]
        infos.append((name, dims, take("<I", f"type of {name!r}"),
                      take("<Q", f"data offset of {name!r}")))
    align = kv.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise bad_gguf(path, f"general.alignment {align!r} is not a power of two")
    start = (off + align - 1) // align * align
    tensors = {}
    for name, dims, qt, toff in infos:
        if name in tensors:
            raise bad_gguf(path, f"tensor {name!r} appears twice")
        try:
            qtype = GGMLQuantizationType(qt)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise bad_gguf(path, f"tensor {name!r} has unknown type {qt}") from None
        if dims[0] % block:
            raise bad_gguf(path, f"tensor {name!r}: row length {dims[0]} is not a multiple of "
                                  f"its type's block size {block} ({qtype.name})")
        rows = math.prod(dims[1:])
        row_bytes = dims[0] // block * type_size
        if toff % align or start + toff + rows * row_bytes > size:
            raise bad_gguf(path, f"tensor {name!r} ({qtype.name} {dims}) at data offset {toff} "
                                  + ("is not aligned" if toff % align else
                                     f"ends past the end of the file ({size} bytes)"))
        data = buf[start + toff:start + toff + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(name, qtype, tuple(reversed(dims)), data)
    return kv, tensors
