"""Shared fixtures: the built-in real model, its RTN artifacts, tiny random models."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# lm-eval results are reused within one test session only: a rerun never passes on old results
os.environ["QUANTKIT_LMEVAL_CACHE"] = tempfile.mkdtemp(prefix="quantkit-test-lmeval-")

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    from quantkit.model_io import resolve_model

    return resolve_model("smollm2-135m").path


def _rtn(tmp_path_factory, bits: int) -> Path:
    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.types import QuantScheme

    out = tmp_path_factory.mktemp("rtn") / f"smollm2-rtn-w{bits}g64"
    quantize(QuantizeRequest(model="smollm2-135m", method="rtn",
                             scheme=QuantScheme(bits=bits, group_size=64), out=out))
    return out


@pytest.fixture(scope="session")
def rtn4_artifact(tmp_path_factory) -> Path:
    return _rtn(tmp_path_factory, 4)


@pytest.fixture(scope="session")
def rtn8_artifact(tmp_path_factory) -> Path:
    return _rtn(tmp_path_factory, 8)


@pytest.fixture(scope="session")
def smollm2_gptq_artifacts(tmp_path_factory) -> dict[str, Path]:
    """SmolLM2 GPTQ int4 g64 sym with static act-order (groups stay k // 64: RTN's storage
    scheme, the act-order vLLM 0.32 loads) in both exports (gptq v1, compressed-tensors), 8 x 256
    calibration tokens of `mixed`: loaded by real vLLM (test_gptq) and scored against RTN at the
    same scheme (test_accuracy_guards; without act-order these 2048 tokens gave KLD 0.364 vs
    RTN 0.399, 0.91x)."""
    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.types import QuantScheme

    root = tmp_path_factory.mktemp("smollm2-gptq")
    out = {}
    for fmt in ("gptq", "compressed-tensors"):
        out[fmt] = root / fmt
        quantize(QuantizeRequest(model="smollm2-135m", method="gptq",
                                 scheme=QuantScheme(bits=4, group_size=64, act_order=True),
                                 out=out[fmt],
                                 format=fmt, calib_samples=8, calib_seqlen=256))  # 2048 tokens > 1536
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture
def tiny_model_factory(tmp_path):
    def make(arch: str = "llama", name: str | None = None, **kw) -> Path:
        return make_tiny_model(tmp_path / (name or arch), arch, **kw)
    return make

