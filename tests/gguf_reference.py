"""llama.cpp's own GGUF tools as the reference for quantkit's GGUF writer (shared by the tests).

The converter (convert_hf_to_gguf.py, its conversion/ package and gguf-py) ships in the
llama-cpp-python sdist under vendor/llama.cpp; it is unpacked once under the quantkit cache
and run as a subprocess, never imported into quantkit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

from quantkit.machine import cache_dir

LLAMA_CPP_SDIST = "llama_cpp_python-0.3.36"
# keys whose values are provenance, not the model (general.name, size label, ...)
PROVENANCE = ("general.",)
# quantkit writes these tokenizer flags always (from what the HF tokenizer does); the
# converter omits them when tokenizer_config.json has none, and llama.cpp's default for a
# "gpt2"/"smollm" vocabulary is the same False (llama-vocab.cpp)
EXPLICIT_DEFAULTS = {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False,
                     "tokenizer.ggml.add_space_prefix": False}


def reference_converter() -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist (convert_hf_to_gguf.py, conversion/,
    gguf-py), unpacked once under the quantkit cache; the sdist is fetched with pip if absent."""
    root = cache_dir() / "sdists"
    lc = root / LLAMA_CPP_SDIST / "vendor" / "llama.cpp"
    if (lc / "convert_hf_to_gguf.py").exists() and (lc / "conversion").is_dir():
        return lc
    sdist = root / f"{LLAMA_CPP_SDIST}.tar.gz"
    if not sdist.exists():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                        ":all:", "-d", str(root), "llama-cpp-python==0.3.36"], check=True)
    want = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    prefix = f"{LLAMA_CPP_SDIST}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix) and m.name[len(prefix):].startswith(want)]
        tar.extractall(root, members=members, filter="data")
    return lc


def run_converter(src: Path, out: Path, outtype: str = "bf16",
                  extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """convert_hf_to_gguf.py --outtype `outtype` (and `extra` options, e.g. --no-mtp) of the HF
    directory `src` into `out`, with its own gguf-py; its result, whatever it is."""
    lc = reference_converter()
    return subprocess.run([sys.executable, str(lc / "convert_hf_to_gguf.py"), "--outtype", outtype,
                           *extra, "--outfile", str(out), str(src)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(lc / "gguf-py")})


def convert_with_llama_cpp(src: Path, out: Path, outtype: str = "bf16",
                           extra: tuple[str, ...] = ()) -> Path:
    """The converter's file of `src` (run_converter), which must succeed."""
    proc = run_converter(src, out, outtype, extra)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def gguf_contents(path: Path) -> tuple[dict, dict]:
    """(KV but provenance, {tensor name: (type name, GGUF shape, bytes)}) of a GGUF file.

    Read with quantkit's validating reader (gguf-py's GGUFReader gives the same KV values but
    builds a numpy view per vocabulary entry: 5 s per file here, 0.1 s this way); both files
    of a comparison go through the same reader, and every header field is checked against
    the file's bytes (quantkit/readers.py).
    """
    from gguf import GGMLQuantizationType

    from quantkit.readers import read_gguf

    kv, tensors = read_gguf(path)
    kv = {k: v for k, v in kv.items() if not k.startswith(PROVENANCE) and not k.startswith("quantkit.")}
    return kv, {name: (GGMLQuantizationType(t.qtype).name, [int(x) for x in reversed(t.shape)],
                       np.asarray(t.data).tobytes()) for name, t in tensors.items()}


def gguf_body(path: Path) -> tuple[dict, bytes]:
    """KV but quantkit's run record (command, times), and every byte from the first tensor's
    data to the end of the file: what must not depend on how the run was made."""
    from quantkit.readers import read_gguf

    kv, tensors = read_gguf(path)
    align = int(kv.get("general.alignment", 32))  # every tensor is padded to it, the last too
    size = sum(-(-np.asarray(t.data).nbytes // align) * align for t in tensors.values())
    return {k: v for k, v in kv.items() if k != "quantkit.metadata"}, path.read_bytes()[-size:]


def assert_same_gguf(ours: Path, ref: Path, skip: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Same tensors (names, types, shapes, bytes) and KV (but provenance, the tokenizer flags
    quantkit states explicitly, and keys starting with one of `skip`, which the caller says
    why) in both files; returns ours' contents."""
    (kv_a, t_a), (kv_b, t_b) = gguf_contents(ours), gguf_contents(ref)
    if skip:
        kv_a, kv_b = ({k: v for k, v in kv.items() if not k.startswith(skip)} for kv in (kv_a, kv_b))
    assert sorted(t_a) == sorted(t_b)
    for t in t_b:
        assert t_a[t][:2] == t_b[t][:2], (t, t_a[t][:2], t_b[t][:2])
        assert t_a[t][2] == t_b[t][2], f"{t}: bytes differ"
    kv_a = dict(kv_a)
    for key, value in EXPLICIT_DEFAULTS.items():
        if key not in kv_b:
            assert kv_a.pop(key, value) == value
    assert kv_a == kv_b
    return kv_a, t_a


def assert_same_as_llama_quantize(ours: Path, ref: Path, tmp: Path, gguf_type: str) -> dict:
    """`ours` (quantkit's `gguf_type` file) equals llama_model_quantize of the converter's
    file `ref`: every tensor's type, shape and bytes; returns ours' tensors."""
    from quantkit.engines.llamacpp import llama_quantize

    lq = tmp / f"llama-quantize.{gguf_type}.gguf"
    llama_quantize(ref, lq, gguf_type)
    (_, got), (_, want) = gguf_contents(ours), gguf_contents(lq)
    assert {t: v[:2] for t, v in got.items()} == {t: v[:2] for t, v in want.items()}
    assert [t for t in want if got[t][2] != want[t][2]] == []
    return got


LOGITS_TEXT = "The quick brown fox jumps over the lazy dog. def f(x): return x**2  # squares"


def assert_llama_cpp_logits_match(gguf: Path, hf_dir: Path, label: str) -> None:
    """llama.cpp's logits of a 16-bit GGUF equal transformers' (float32) of the HF directory
    within 3 % of the logit range, top-1 on > 90 % of 40 positions."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.engines.llamacpp import LlamaCppModel

    ids = AutoTokenizer.from_pretrained(hf_dir).encode(LOGITS_TEXT, add_special_tokens=False)[:40]
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    llm = LlamaCppModel(gguf, n_ctx=64, logits_all=True)
    try:
        got = llm.logits(ids)
    finally:
        llm.close()
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"{label}: llama.cpp BF16 vs transformers max logit error {err:.4f} of the range")
    assert err < 0.03 and (got.argmax(1) == want.argmax(1)).mean() > 0.9


def assert_generates(gguf: Path) -> None:
    """The file loads in real llama.cpp and greedy decoding writes some tokens."""
    from quantkit.engines.llamacpp import LlamaCppModel

    llm = LlamaCppModel(gguf, n_ctx=64)
    try:
        assert len(llm.tokenize(llm.greedy("The capital of France is", max_tokens=6))) > 0
    finally:
        llm.close()
