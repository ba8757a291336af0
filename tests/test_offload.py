"""Offloaded calibration activations (quantkit.pipeline.offload) and the GPU-memory trims that
come with them: the parts that run without a GPU (the streams themselves are checked on the
GPU machine by benchmarks/gpu_quantkit_vs_llmcompressor.py --check)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from quantkit.arch import spec_for_config
from quantkit.methods.gptq import GPTQQuantizer, _reverse_in_place, gptq_quantize
from quantkit.pipeline.capture import BlockInputs, run_block
from quantkit.pipeline.plan import OFFLOAD_BATCH, estimate, offload_activations
from quantkit.types import BlockContext, QuantScheme

pytestmark = pytest.mark.fast

G128 = QuantScheme(bits=4, group_size=128, symmetric=True)


@pytest.mark.parametrize("shape", [(7, 5), (6, 6), (1, 1), (33, 31)])
@pytest.mark.parametrize("chunk", [1, 4, 1 << 24])
def test_reverse_in_place_is_flip_of_every_dim(shape, chunk):
    t = torch.randn(shape)
    want = t.flip((0, 1))
    ptr = t.data_ptr()
    got = _reverse_in_place(t, chunk=chunk)
    assert got.data_ptr() == ptr and torch.equal(got, want)


def test_gptq_overwrite_hessian_gives_the_same_result():
    torch.manual_seed(0)
    x = torch.randn(2048, 256)
    h = x.T @ x
    w = torch.randn(64, 256)
    keep = h.clone()
    ref = gptq_quantize(w, h, QuantScheme(bits=4, group_size=64), loop="torch")
    assert torch.equal(h, keep)  # the default leaves the caller's Hessian alone
    got = gptq_quantize(w, h, QuantScheme(bits=4, group_size=64), loop="torch",
                        overwrite_hessian=True)
    assert torch.equal(ref.codes, got.codes) and torch.equal(ref.scale, got.scale)


def test_gptq_quantizer_consumes_the_hessians_it_solved():
    torch.manual_seed(0)
    x = torch.randn(512, 128)
    h = x.T @ x
    lins = {n: torch.nn.Linear(128, 32, bias=False) for n in ("q", "k")}
    stats = {n: {"hessian": h.clone(), "tokens": 512} for n in lins}
    ctx = BlockContext(index=0, block=torch.nn.Module(), linears=lins, stats=stats,
                       scheme=QuantScheme(bits=4, group_size=64), inputs=[], rerun=lambda: [],
                       arch=None, options={}, collect=lambda *a: {})
    res = GPTQQuantizer().quantize_block(ctx)
    assert set(res) == {"q", "k"} and all("hessian" not in st for st in stats.values())


def test_offloaded_block_inputs_run_like_resident_ones():
    """On a CPU 'device' nothing is pinned or copied, but the offloaded code path (batches(),
    HostSink) must hand the block the same tensors and return the same outputs."""
    torch.manual_seed(0)
    block = torch.nn.Linear(16, 16)
    hidden = [torch.randn(2, 3, 16) for _ in range(3)]
    resident = BlockInputs(hidden, [{} for _ in hidden])
    offloaded = resident.to("cpu", offload=True)
    assert offloaded.device == torch.device("cpu") and resident.device is None
    got = run_block(block, offloaded)
    want = run_block(block, resident)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    nxt = offloaded.with_hidden(got)
    assert nxt.device == offloaded.device and nxt.kwargs is offloaded.kwargs


def _llama_8b_shapes(layers: int = 8) -> LlamaConfig:
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, num_hidden_layers=layers, vocab_size=128256,
                       tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_plan_offloaded_peak_and_the_choice(method):
    cfg = _llama_8b_shapes()
    plan = estimate(cfg, spec_for_config(cfg), method=method, scheme=G128, calib_samples=128,
                    calib_seqlen=2048, calibrated=True, device="cuda", calib_batch=8)
    hidden_copy = 128 * 2048 * 4096 * 2  # 2 GiB: one copy of the hidden states in bf16
    # offloaded: both copies of the hidden states leave the GPU, three batches stay
    assert plan.peak_gpu_offloaded_bytes <= plan.peak_gpu_bytes - 2 * hidden_copy \
        + 3 * OFFLOAD_BATCH * 2048 * 4096 * 2
    assert not offload_activations(plan, 80 * 2**30)  # fits an H100: keep them on the GPU
    assert offload_activations(plan, plan.peak_gpu_bytes)  # no margin left: offload
    cpu = estimate(cfg, spec_for_config(cfg), method=method, scheme=G128, calib_samples=128,
                   calib_seqlen=2048, calibrated=True, device="cpu", calib_batch=8)
    assert cpu.peak_gpu_offloaded_bytes is None and not offload_activations(cpu, 0)
