"""Data-parallel quantization (torchrun, quantkit.pipeline.distributed) on CPU with gloo.

Two processes quantize a tiny random llama with GPTQ through the real CLI under torchrun; the
artifact must be BITWISE identical to a single process's from the same calibration samples.
Why exact and not within a tolerance: with one calibration batch per rank, rank 0's Hessian
is batch 0's and rank 1's is batch 1's, and their reduced sum is the very float32 addition
b0 + b1 the single process makes (float addition commutes). With more batches per rank the
summation order differs ((b0+b1)+(b2+b3) vs ((b0+b1)+b2)+b3), and GPTQ's error feedback
amplifies those last-bit differences into different (equally good) codes: measured on this
model, ~10% of codes differ, exactly as much as a single process run with batch 4 instead
of 8 differs from itself, with per-layer errors within 1%. The single process also runs
with one thread, as each rank does: a BLAS product (GPTQ's lazy column update) may sum in
a different order with another thread count, and GPTQ amplifies that the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--method", "gptq", "--bits", "4", "--group-size", "64", "--calib-samples", "16",
        "--calib-seqlen", "64", "--device", "cpu", "--no-resume"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def _torchrun_two_ranks(*argv: str) -> None:
    """Run `argv` (a module or script and its arguments) on 2 gloo ranks; assert it succeeded."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *argv],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _assert_same_weights(single: Path, dp: Path) -> None:
    from safetensors.torch import load_file

    a, b = load_file(single / "model.safetensors"), load_file(dp / "model.safetensors")
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ


def test_two_ranks_gloo_gptq_artifact_identical(tiny_model_factory, tmp_path):
    model = tiny_model_factory("llama")  # hidden 256, intermediate 512, 2 blocks
    single, dp = tmp_path / "single", tmp_path / "dp"
    # the single process runs in the ranks' environment (OMP_NUM_THREADS=1): torch's thread
    # count alone is not enough, scipy's OpenBLAS (the Hessians' ssyrk) and numba read it too,
    # and with two BLAS threads the sums came out differently on an AVX2 CPU
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli", "quantize", str(model), *ARGS,
                           "-o", str(single)], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _torchrun_two_ranks("-m", "quantkit.cli", "quantize", str(model), *ARGS, "-o", str(dp))
    _assert_same_weights(single, dp)
    assert (single / "config.json").read_text() == (dp / "config.json").read_text()
    import json

    meta = json.loads((dp / "quantkit.json").read_text())
    assert meta["data_parallel"]["world_size"] == 2 and meta["data_parallel"]["backend"] == "gloo"
    assert meta["calibration"] == json.loads((single / "quantkit.json").read_text())["calibration"]
    # only rank 0 wrote: no temp dirs or second artifact left behind
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".dp")) == []


AWQ_SCRIPT = """
import sys
from pathlib import Path

import torch.distributed as dist

from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

dist.init_process_group("gloo")  # already initialised: quantize() joins it, does not end it
quantize(QuantizeRequest(model=sys.argv[1], method="awq", out=Path(sys.argv[2]),
                         scheme=QuantScheme(bits=4, group_size=64, symmetric=False),
                         calib_samples=2, calib_seqlen=256, device="cpu", resume=False,
                         method_options={"search_tokens": 256}))
dist.destroy_process_group()
"""


def test_two_ranks_gloo_awq_artifact_identical(tiny_model_factory, tmp_path):
    """AWQ: x_mean from the summed absmean of both ranks; the scale and clip searches read
    the first search_tokens tokens (256 = sample 0), which rank 0's share starts with, so
    the artifact is again bitwise identical (one sample per rank: the same float sums)."""

    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.types import QuantScheme

    model = tiny_model_factory("llama", hidden=128, intermediate=256)
    single, dp = tmp_path / "single", tmp_path / "dp"
    quantize(QuantizeRequest(model=str(model), method="awq", out=single,
                             scheme=QuantScheme(bits=4, group_size=64, symmetric=False),
                             calib_samples=2, calib_seqlen=256, device="cpu", resume=False,
                             method_options={"search_tokens": 256}))
    script = tmp_path / "awq_dp.py"
    script.write_text(AWQ_SCRIPT)
    _torchrun_two_ranks(str(script), str(model), str(dp))
    _assert_same_weights(single, dp)


@pytest.mark.fast
def test_shard_is_contiguous_and_covers_every_batch():
    from quantkit.pipeline.distributed import DataParallel

    batches = list(range(7))
    parts = [DataParallel(rank=r, world=3, local_rank=r, backend="gloo").shard(batches)
             for r in range(3)]
    assert parts == [[0, 1], [2, 3], [4, 5, 6]]
    from quantkit.errors import CalibrationError

    with pytest.raises(CalibrationError):
        DataParallel(rank=0, world=8, local_rank=0, backend="gloo").shard(batches)


@pytest.mark.fast
def test_methods_without_data_parallel_support_are_refused():
    from quantkit.errors import SchemeMismatch
    from quantkit.methods import get_quantizer
    from quantkit.pipeline.distributed import DataParallel

    dp = DataParallel(rank=0, world=2, local_rank=0, backend="gloo")
    dp.check_method(get_quantizer("gptq"))
    dp.check_method(get_quantizer("rtn"))
    dp.check_method(get_quantizer("awq"))
    with pytest.raises(SchemeMismatch, match="data-parallel"):
        dp.check_method(get_quantizer("fp8", scheme="dynamic"))
