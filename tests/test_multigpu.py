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


def _torchrun(ranks: int, *argv: str, ok: bool = True) -> subprocess.CompletedProcess:
    """Run `argv` (a module or script and its arguments) on `ranks` gloo ranks; with `ok`,
    assert it succeeded."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), *argv], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _torchrun_two_ranks(*argv: str) -> None:
    _torchrun(2, *argv)


def _single(model: Path, out: Path, *args: str) -> None:
    """One process in the ranks' environment (see test_two_ranks_gloo_gptq_artifact_identical)."""
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli", "quantize", str(model), *args,
                           "-o", str(out)], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _assert_spread(meta: dict, ranks: int) -> dict:
    """quantkit.json records the solves' split: every rank solved a non-empty, disjoint share."""
    solves = meta["data_parallel"]["solves"]
    per_rank = solves["linears_by_rank"]
    assert len(per_rank) == ranks and all(per_rank), solves
    assert solves["linears_per_rank"] == [len(r) for r in per_rank]
    names = [n for r in per_rank for n in r]
    assert len(names) == len(set(names))  # each Linear solved by exactly one rank
    assert len(solves["cost_share_per_rank"]) == ranks
    return solves


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
    _single(model, single, *ARGS)
    _torchrun_two_ranks("-m", "quantkit.cli", "quantize", str(model), *ARGS, "-o", str(dp))
    _assert_same_weights(single, dp)
    assert (single / "config.json").read_text() == (dp / "config.json").read_text()
    import json

    meta = json.loads((dp / "quantkit.json").read_text())
    assert meta["data_parallel"]["world_size"] == 2 and meta["data_parallel"]["backend"] == "gloo"
    # 2 blocks x 4 sequential groups (q/k/v, o, gate/up, down), one solve each: spread
    solves = _assert_spread(meta, 2)
    assert solves["groups_spread"] == 8 and solves["groups_on_rank0"] == 0
    assert sum(solves["linears_per_rank"]) == 2 * 7
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


@pytest.mark.slow  # one process and three ranks: ~55 s on 2 shared cores
def test_three_ranks_gloo_moe_experts_spread_artifact_identical(tiny_model_factory, tmp_path):
    """Qwen3-MoE (8 experts): three ranks split each expert group's solves (gate/up per
    expert, one shared input each; down per expert) and the router-fed expert Hessians are
    summed in rank order, so with one batch per rank (24 samples, GPTQ's batch of 8) the
    artifact is bitwise one process's -- the experts no rank's tokens reached included
    (their RTN fallback)."""
    import json

    model = tiny_model_factory("qwen3_moe", hidden=128, intermediate=256,
                               moe={"moe_intermediate_size": 128})
    args = [a if a != "16" else "24" for a in ARGS]
    single, dp = tmp_path / "single", tmp_path / "dp"
    _single(model, single, *args)
    _torchrun(3, "-m", "quantkit.cli", "quantize", str(model), *args, "-o", str(dp))
    _assert_same_weights(single, dp)
    meta = json.loads((dp / "quantkit.json").read_text())
    assert meta["data_parallel"]["world_size"] == 3
    assert meta.get("fallbacks") == json.loads((single / "quantkit.json").read_text()).get("fallbacks")
    solves = _assert_spread(meta, 3)
    # the experts themselves are spread: every rank solved some of every block's experts
    for block in (0, 1):
        for rank in solves["linears_by_rank"]:
            assert any(n.startswith(f"model.layers.{block}.mlp.experts.") for n in rank), solves
    # gate and up of one expert share their input: one solve, so one rank
    owner = {n: r for r, names in enumerate(solves["linears_by_rank"]) for n in names}
    for e in range(8):
        p = f"model.layers.0.mlp.experts.{e}."
        assert owner[p + "gate_proj"] == owner[p + "up_proj"]


def test_rank_failure_stops_every_rank_and_writes_nothing(tiny_model_factory, tmp_path):
    """A real failure on one rank only: block 0's v_proj weights are huge (finite, so the
    checkpoint's NaN/Inf scan passes), its outputs overflow, and o_proj's Hessian holds Inf.
    Rank 1 owns o_proj's solve (q/k/v went to rank 0), so only rank 1 raises; rank 0 waits
    at the group's agreement, learns of it there and stops too (before it, without the
    agreement, rank 0 sat in the next collective until rank 1's exit broke the connection or
    torchrun killed it). The error says which rank failed and why, the run fails, and nothing
    is written (no artifact, no temp dir)."""
    from safetensors.torch import load_file, save_file

    model = tiny_model_factory("llama")
    weights = load_file(model / "model.safetensors")
    v = "model.layers.0.self_attn.v_proj.weight"
    weights[v] = torch.full_like(weights[v], 2e38)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = _torchrun(2, "-m", "quantkit.cli", "quantize", str(model), *ARGS,
                     "-o", str(tmp_path / "dp"), ok=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said[-3000:]
    # every rank raises it; torchrun may stop rank 0 (SIGTERM) once rank 1 has exited first
    assert "rank 1 of 2 failed while solving model.layers.0: rank 1 (self_attn.o_proj): " \
        "BadWeights: Hessian of model.layers.0.self_attn.o_proj holds NaN/Inf" in said, said[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.fast
def test_assign_balances_each_group_and_agrees_on_every_rank():
    from quantkit.pipeline.distributed import assign

    # longest first, to the least loaded rank of the group: 9 | 7+3 | 5+4
    assert assign([3, 9, 4, 7, 5], 3) == [1, 0, 2, 1, 2]
    # one-unit groups go to the least busy rank over the run, then the lower one
    assert assign([10], 3, prior=[5, 0, 0]) == [1]
    assert assign([10], 2) == [0]
    # equal costs: by position, so identical on every rank
    assert assign([1, 1, 1, 1], 2) == [0, 1, 0, 1]


@pytest.mark.fast
def test_results_travel_as_one_buffer_unchanged():
    """What an owner rank broadcasts (quantkit.pipeline.distributed._pack) is what the other
    ranks rebuild: every tensor bitwise, dtypes, shapes, side tensors and scalars."""
    from quantkit.pipeline.distributed import _pack, _unpack
    from quantkit.types import QuantResult, QuantScheme

    g = torch.Generator().manual_seed(0)
    scheme = QuantScheme(bits=4, group_size=64)
    a = QuantResult(name="a", scheme=scheme,
                    codes=torch.randint(0, 16, (24, 128), dtype=torch.uint8, generator=g),
                    scale=torch.rand(24, 2, generator=g), zero=torch.full((24, 2), 8, dtype=torch.int32),
                    g_idx=torch.arange(128, dtype=torch.int32) // 64,
                    bias=torch.randn(24, generator=g).to(torch.bfloat16),
                    extra={"pre_quant_scale": torch.rand(3, generator=g)}, loss=0.125, seconds=0.5)
    b = QuantResult(name="b", scheme=scheme, codes=torch.zeros(5, 7, dtype=torch.uint8),
                    scale=torch.ones(5, 1), fallback="rtn")
    (layout, size), flat = _pack({"x.a": a, "x.b": b}, "cpu")
    assert flat.dtype == torch.uint8 and flat.numel() == size
    got = _unpack(layout, flat.clone())
    assert list(got) == ["x.a", "x.b"]
    for want, res in ((a, got["x.a"]), (b, got["x.b"])):
        for f in ("codes", "scale", "zero", "g_idx", "bias"):
            x, y = getattr(want, f), getattr(res, f)
            assert (x is None) == (y is None)
            if x is not None:
                assert x.dtype == y.dtype and torch.equal(x, y)
        assert want.extra.keys() == res.extra.keys()
        assert all(torch.equal(want.extra[k], res.extra[k]) for k in want.extra)
        assert (res.name, res.scheme, res.loss, res.seconds, res.fallback) == \
            (want.name, want.scheme, want.loss, want.seconds, want.fallback)


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


def _plan(config, method: str = "gptq", gpus: int = 1, **kw):
    from quantkit.arch import spec_for_config
    from quantkit.methods import get_quantizer
    from quantkit.pipeline.plan import estimate
    from quantkit.types import QuantScheme

    config.architectures = [config.architectures[0]] if config.architectures else None
    return estimate(config, spec_for_config(config), method=method,
                    scheme=QuantScheme(bits=4, group_size=128, symmetric=method == "gptq"),
                    calib_samples=128, calib_seqlen=2048, calibrated=True, calib_batch=8,
                    device="cuda", gpus=gpus,
                    spread_solves=get_quantizer(method).data_parallel is True, **kw)


def _qwen3_30b_a3b(layers: int = 4):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                            moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                            vocab_size=151936, tie_word_embeddings=False)
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def _llama_8b(layers: int = 4):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=layers, vocab_size=128256)
    config.architectures = ["LlamaForCausalLM"]
    return config


@pytest.mark.fast
def test_plan_gpus_spreads_moe_solves_and_splits_forwards():
    """`quantkit plan --gpus N`, Qwen3-30B-A3B shapes: each expert group's 128 solves spread
    evenly (the solve time ~1/N: the one q/k/v and o solve per block do not split), the
    forwards and statistics shrink with each rank's share of the batches, and so do the
    per-GPU hidden states; RAM per process does not (every rank reads every block)."""
    one, two, four = (_plan(_qwen3_30b_a3b(layers=1), gpus=g) for g in (1, 2, 4))
    assert (one.gpus, two.gpus, four.gpus) == (1, 2, 4)
    assert two.solves_spread and four.solves_spread and one.solves_spread is None
    assert 0.5 <= two.solve_seconds / one.solve_seconds < 0.56
    assert 0.25 <= four.solve_seconds / one.solve_seconds < 0.31
    assert four.seconds < two.seconds < one.seconds
    assert four.peak_gpu_bytes < two.peak_gpu_bytes < one.peak_gpu_bytes
    assert two.peak_ram_bytes == one.peak_ram_bytes


@pytest.mark.fast
def test_plan_gpus_dense_true_sequential_solves_do_not_shrink_and_awq_searches_on_rank0():
    """Dense 8B shapes: true-sequential GPTQ has one solve per group (q/k/v stacked, o,
    gate/up, down), which no rank can share, so the solves' time stays and only the forwards
    shrink; without true-sequential order the block's four solves balance (down_proj alone
    is most of them). AWQ's search stays on rank 0: only its statistics' pass splits."""
    one, two = _plan(_llama_8b()), _plan(_llama_8b(), gpus=2)
    assert two.solve_seconds == one.solve_seconds and two.seconds < one.seconds
    flat1 = _plan(_llama_8b(), true_sequential=False)
    flat2 = _plan(_llama_8b(), gpus=2, true_sequential=False)
    assert 0.7 < flat2.solve_seconds / flat1.solve_seconds < 1
    awq1, awq2 = _plan(_llama_8b(), "awq"), _plan(_llama_8b(), "awq", gpus=2)
    assert awq2.solves_spread is False
    fwd_half = (one.seconds - two.seconds) / one.seconds  # GPTQ: every pass splits
    assert 0 < (awq1.seconds - awq2.seconds) / awq1.seconds < fwd_half


@pytest.mark.fast
def test_plan_cli_gpus(tiny_model_factory):
    import json

    from click.testing import CliRunner

    from quantkit.cli import main

    model = str(tiny_model_factory("llama"))
    res = CliRunner().invoke(main, ["plan", model, "--method", "gptq", "--device", "cuda",
                                    "--gpus", "2", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got["gpus"] == 2 and got["solves_spread"] is True and got["peak_gpu_bytes"] > 0
    table = CliRunner().invoke(main, ["plan", model, "--method", "gptq", "--gpus", "2"])
    assert table.exit_code == 0 and "ranks" in table.output, table.output
    refused = CliRunner().invoke(main, ["plan", model, "--method", "fp8", "--gpus", "2"])
    assert refused.exit_code == 2 and "data-parallel" in refused.output, refused.output
