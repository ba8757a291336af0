"""Reproducible mode: the same bytes whichever kernels the CPU would pick (real subprocesses,
the libraries' own switches standing in for another CPU: MKL_ENABLE_INSTRUCTIONS=AVX2 is MKL on
an AVX2-only CPU, one OpenMP thread a machine with another core count)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.errors import QuantkitError
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.reproducible import PINNED, active, cpu_flags
from quantkit.types import QuantScheme

REPO = Path(__file__).resolve().parents[1]
# what decides the kernels: removed from the environment so that each run sets its own
_SWITCHES = ("QUANTKIT_REPRODUCIBLE", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS", *PINNED)


def _quantize(model: Path, out: Path, *flags: str, **env_extra: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _SWITCHES}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env_extra)
    cmd = [sys.executable, "-m", "quantkit.cli", "quantize", str(model), "--method", "gptq",
           "--group-size", "64", "--calib-samples", "8", "--calib-seqlen", "64", "--device", "cpu",
           "--no-resume", "-o", str(out), *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="reproducible mode pins AVX2 kernels")
def test_reproducible_mode_gives_same_bytes_on_other_kernels(tiny_model_factory, tmp_path):
    model = tiny_model_factory("llama", layers=1)
    _quantize(model, tmp_path / "a", "--reproducible")
    _quantize(model, tmp_path / "b", "--reproducible", MKL_ENABLE_INSTRUCTIONS="AVX2",
              OMP_NUM_THREADS="1")
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    kernels = json.loads((tmp_path / "b" / "quantkit.json").read_text())["kernels"]
    assert kernels["reproducible"] is True
    assert kernels["torch_cpu_capability"] == "AVX2"
    assert kernels["env"]["MKL_CBWR"] == "AVX2,STRICT"
    assert all(b["kernel"] == "Haswell" and b["threads"] == 1 for b in kernels.get("blas", []))
    assert "--reproducible" in json.loads((tmp_path / "a" / "quantkit.json").read_text())["command"]


def test_reproducible_request_refused_after_torch_loaded(tmp_path):
    """In-process (torch already loaded, kernels not pinned): a clear refusal, nothing written."""
    assert not active()
    req = QuantizeRequest(model="smollm2-135m", method="gptq", scheme=QuantScheme(), out=tmp_path / "o",
                          reproducible=True)
    with pytest.raises(QuantkitError) as exc:
        quantize(req)
    assert "QUANTKIT_REPRODUCIBLE=1" in exc.value.hint
    assert not (tmp_path / "o").exists()
