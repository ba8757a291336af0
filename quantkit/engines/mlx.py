"""Real MLX (mlx-lm), driven in its own virtualenv: generation, and logits for `eval --backend mlx`.

quantkit never imports mlx: it runs `mlx_worker.py` with MLX's Python (the venv
scripts/setup_mlx.sh builds; lookup shared with vLLM's in engines/venvs.py) and exchanges
JSON and .npy files. Scoring keeps one worker process per model alive (MLXScorer), fed one
batch of windows at a time, so the harness scores MLX models the way it scores torch ones.
Workers run as plain subprocesses, not through the fork server: MLX starts threads of its own,
and a child forked after them is not known to be safe.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from quantkit.engines.venvs import offline_env, venv_python
from quantkit.errors import EngineError

__all__ = ["mlx_python", "mlx_env", "run_mlx", "mlx_dequantize", "MLXScorer", "MLX_VENV_NAME"]

MLX_VENV_NAME = "mlx-0.32.4"
_WORKER = Path(__file__).with_name("mlx_worker.py")
_SETUP = "scripts/setup_mlx.sh (it builds mlx[cpu] and mlx-lm in their own venv)"


def mlx_python() -> Path:
    """QUANTKIT_MLX_PYTHON, else the venv scripts/setup_mlx.sh builds under the quantkit cache."""
    return venv_python(MLX_VENV_NAME, "QUANTKIT_MLX_PYTHON", "MLX (mlx-lm)", _SETUP)


def mlx_env() -> dict[str, str]:
    """Offline, and quiet: the worker's stdout carries its protocol."""
    return {**offline_env(), "PYTHONUNBUFFERED": "1"}


def _failure(what: str, log: str, returncode: int | None) -> EngineError:
    lines = [ln for ln in log.strip().splitlines() if ln.strip()]
    cause = lines[-1] if lines else f"exit {returncode}"
    err = EngineError(f"{what}: {cause}", "The MLX worker's output ends:\n" + "\n".join(lines[-15:]))
    err.log = log
    return err


def run_mlx(model_dir: Path, *, generate: list[dict], dequantize: bool = False,
            timeout: float = 1800) -> dict:
    """Load `model_dir` with mlx_lm.load and greedy-generate each {"prompt", "max_tokens"};
    `dequantize`: run the float model the stored codes stand for (mlx_worker.py says why)."""
    with tempfile.TemporaryDirectory(prefix="quantkit-mlx-") as tmp:
        req, resp = Path(tmp) / "req.json", Path(tmp) / "resp.json"
        req.write_text(json.dumps({"model": str(Path(model_dir).resolve()),
                                   "dequantize": dequantize, "generate": generate}))
        proc = subprocess.run([str(mlx_python()), str(_WORKER), "generate", str(req), str(resp)],
                              env=mlx_env(), cwd=tmp, timeout=timeout, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if proc.returncode != 0 or not resp.is_file():
            raise _failure(f"mlx-lm failed to run {model_dir}", proc.stdout, proc.returncode)
        return json.loads(resp.read_text())


def mlx_dequantize(model_dir: Path, timeout: float = 600) -> dict[str, torch.Tensor]:
    """mx.dequantize of every quantized tensor an MLX artifact stores (float32, exact widening
    of MLX's result in the scales' dtype), by the tensor name it is stored under."""
    with tempfile.TemporaryDirectory(prefix="quantkit-mlx-") as tmp:
        out = Path(tmp) / "dequantized.npz"
        proc = subprocess.run([str(mlx_python()), str(_WORKER), "dequantize",
                               str(Path(model_dir).resolve()), str(out)],
                              env=mlx_env(), cwd=tmp, timeout=timeout, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if proc.returncode != 0 or not out.is_file():
            raise _failure(f"mx.dequantize failed on {model_dir}", proc.stdout, proc.returncode)
        with np.load(out) as data:
            return {k: torch.from_numpy(data[k]) for k in data.files}


class MLXScorer:
    """One model loaded in an MLX worker; `logits(ids)` [B, T] -> float32 [B, T, vocab]."""

    def __init__(self, model_dir: Path, *, dequantize: bool = True):
        self._tmp = tempfile.TemporaryDirectory(prefix="quantkit-mlx-")
        self._log = Path(self._tmp.name) / "worker.log"
        self._proc = subprocess.Popen(
            [str(mlx_python()), str(_WORKER), "serve", str(Path(model_dir).resolve()),
             "1" if dequantize else "0"],
            env=mlx_env(), cwd=self._tmp.name, text=True, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log.open("w"))
        line = self._proc.stdout.readline()
        if not line.startswith("{"):
            log = self._log.read_text() + line
            self.close()
            raise _failure(f"mlx-lm failed to load {model_dir}", log, self._proc.returncode)
        self.info = json.loads(line)
        self._n = 0

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        self._n += 1
        ids_path = Path(self._tmp.name) / f"ids{self._n}.npy"
        out_path = Path(self._tmp.name) / f"logits{self._n}.npy"
        np.save(ids_path, ids.to(torch.int32).numpy())
        self._proc.stdin.write(f"{ids_path} {out_path}\n")
        self._proc.stdin.flush()
        if self._proc.stdout.readline().strip() != "ok":
            raise _failure("the MLX worker stopped while scoring", self._log.read_text(),
                           self._proc.poll())
        out = torch.from_numpy(np.load(out_path))
        os.unlink(ids_path)
        os.unlink(out_path)
        return out

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._tmp.cleanup()
