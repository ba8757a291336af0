"""llama.cpp through llama-cpp-python: load a GGUF, tokenize, score, greedy-generate, quantize.

A thin wrapper so eval code and tests do not repeat the ctypes details. llama-cpp-python must
be built without native CPU flags on machines whose CPU advertises AMX the VM forbids
(see docs/environment.md); that is an install concern, not handled here.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from quantkit.errors import EngineError
from quantkit.ggml.catalogue import LLAMA_FTYPES

__all__ = ["LlamaCppModel", "load_llama", "llama_quantize", "llama_cpp_version"]



def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise EngineError("llama-cpp-python is not installed.",
                          "pip install 'quantkit[llamacpp]' (see docs/environment.md for build flags)."
                          ) from exc
    return llama_cpp


def llama_cpp_version() -> str:
    return "llama-cpp-python " + getattr(_llama_cpp(), "__version__", "?")


def load_llama(path: str | Path, *, header_checked: bool = False, **kwargs):
    """llama_cpp.Llama over a GGUF whose header quantkit validated first (a damaged file is a
    clear error, not a crash inside llama.cpp); llama.cpp's own refusals become EngineError.
    `header_checked`: the caller ran read_gguf already (speed runs keep it out of the load time)."""
    from quantkit.readers import read_gguf

    llama_cpp = _llama_cpp()
    path = Path(path)
    if not path.is_file():
        raise EngineError(f"GGUF file {path} does not exist.",
                          "Pass the .gguf file written by `quantkit quantize --method gguf`.")
    if not header_checked:
        read_gguf(path)
    try:
        return llama_cpp.Llama(model_path=str(path), verbose=False, **kwargs)
    except (ValueError, RuntimeError, OSError) as exc:  # load failures are ValueError
        raise EngineError(f"llama.cpp refused {path}: {exc}",
                          "Check the file with `quantkit info FILE`; write it again with "
                          "`quantkit quantize MODEL --method gguf` if it is damaged.") from exc


class LlamaCppModel:
    """A GGUF loaded in llama.cpp (CPU), with logits for every position when asked."""

    def __init__(self, path: str | Path, n_ctx: int = 512, logits_all: bool = False,
                 n_threads: int | None = None, seed: int = 0):
        self.llm = load_llama(path, n_ctx=n_ctx, logits_all=logits_all,
                              n_threads=n_threads or min(4, os.cpu_count() or 1), seed=seed)

    def tokenize(self, text: str, add_bos: bool = False, special: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def detokenize(self, ids: list[int]) -> str:
        return self.llm.detokenize(ids).decode("utf-8", errors="replace")

    def logits(self, ids: list[int]) -> np.ndarray:
        """float32 [len(ids), n_vocab]: logits after each prefix (needs logits_all=True)."""
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def greedy(self, prompt: str, max_tokens: int = 16) -> str:
        out = self.llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, top_k=1)
        return out["choices"][0]["text"]

    def metadata(self) -> dict[str, str]:
        return dict(self.llm.metadata)

    def close(self) -> None:
        self.llm.close()


def llama_quantize(src: str | Path, dst: str | Path, gguf_type: str, *, nthread: int = 2,
                   imatrix: dict[str, np.ndarray] | None = None, pure: bool = False) -> None:
    """llama.cpp's own quantizer (llama-quantize's engine) on a GGUF file.

    `imatrix` maps GGUF weight names to the per-column importance (in_sum2 / counts), the
    values llama-quantize passes after reading an imatrix file.
    """
    llama_cpp = _llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[gguf_type.lower()]
    params.nthread = nthread
    params.pure = pure
    keep = []
    if imatrix:
        arr = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(sorted(imatrix.items())):
            v = np.ascontiguousarray(values, dtype=np.float32)
            keep.append((name.encode(), v))
            arr[i].name = keep[-1][0]
            arr[i].data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = v.size
        arr[len(imatrix)].name = None
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(arr)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise EngineError(f"llama_model_quantize({src} -> {gguf_type}) failed with code {rc}.")
