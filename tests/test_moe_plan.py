"""`quantkit plan` on mixture-of-experts models: per-expert GPTQ Hessians one block at a
time, AWQ's expert chunks, --awq-expert-inputs."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from quantkit.arch import spec_for_config
from quantkit.cli import main
from quantkit.types import QuantScheme

pytestmark = pytest.mark.fast


def test_plan_counts_per_expert_hessians_one_block_at_a_time():
    """Qwen3-30B-A3B shapes (hidden 2048, 128 experts, moe_intermediate 768): GPTQ holds one
    Hessian per expert Linear of a group (2 x 128 x 2048^2 fp32 = 4 GiB for gate/up), for
    ONE block at a time: more layers do not raise the peak."""
    from transformers import Qwen3MoeConfig

    from quantkit.pipeline.plan import estimate

    def plan(layers: int, method: str = "gptq", scheme=QuantScheme(bits=4, group_size=128)):
        config = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
                                num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                                moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                vocab_size=151936, tie_word_embeddings=False)
        config.architectures = ["Qwen3MoeForCausalLM"]
        return estimate(config, spec_for_config(config), method=method, scheme=scheme,
                        calib_samples=128, calib_seqlen=2048, calibrated=method == "gptq",
                        calib_batch=8)

    two, four = plan(2), plan(4)
    experts = 128 * 3 * 2048 * 768
    assert experts < two.block_params < experts + 30e6  # + router, attention, norms
    hessians = 2 * 128 * 2048**2 * 4
    assert two.phase_bytes["blocks"] > hessians
    assert four.phase_bytes["blocks"] == two.phase_bytes["blocks"]  # streaming: one block
    assert four.disk_bytes > 1.9 * (two.disk_bytes - 151936 * 2048 * 2 * 2)
    # a BF16 GGUF: the writer stacks one block's 128 experts of a projection (384 MiB) at a time
    bf16 = QuantScheme(kind="kquant", gguf_type="bf16")
    stacked = 128 * 768 * 2048 * 2
    gguf_write = plan(2, "gguf", bf16).phase_bytes["write"]
    assert gguf_write - stacked == plan(2, "gguf", QuantScheme(kind="kquant", gguf_type="q8_0")
                                        ).phase_bytes["write"] - stacked * 8.5 / 16


def test_plan_counts_awq_expert_chunks_under_all_experts_calibration():
    """AWQ under --moe-calibrate-all-experts searches the experts' up -> down groups on chunks
    of experts: at most 1 GiB of down_proj inputs at a time (Qwen3-30B-A3B shapes on a GPU,
    65536 search tokens x 768 x 2 B = 96 MiB an expert: 10 experts a chunk, against the routed
    one-pass 8 x 96 MiB), not all 128 experts' 12 GiB. Routed, the experts' gate/up inputs
    (8 x 65536 x 2048 x 2 B = 2 GiB) go the same way: one chunk after the fold. The H100
    measured 9.59 GiB peak + 0.5 GiB context with all experts, 10.36 routed, at 3cba243
    (benchmarks/README.md): the plan must be within 30 % of both; a larger expert_input_bytes
    (the quantizer's, passed by quantize's plan) moves it by the inputs no longer chunked; and
    GPTQ's plan does not move."""
    from transformers import Qwen3MoeConfig

    from quantkit.methods.awq import EXPERT_INPUT_BYTES
    from quantkit.pipeline.plan import estimate

    config = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=2, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                            moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                            vocab_size=128256, tie_word_embeddings=False)
    config.architectures = ["Qwen3MoeForCausalLM"]

    def plan(method: str, all_experts: bool, budget: int | None = None):
        return estimate(config, spec_for_config(config), method=method,
                        scheme=QuantScheme(bits=4, group_size=128), calib_samples=128,
                        calib_seqlen=2048, calibrated=True, device="cuda",
                        calib_batch=1 if method == "awq" else 8, true_sequential=method == "gptq",
                        moe_all_experts=all_experts, expert_input_bytes=budget)

    routed, everything = plan("awq", False), plan("awq", True)
    per_expert = 65536 * 768 * 2
    assert EXPERT_INPUT_BYTES // per_expert == 10
    assert everything.peak_gpu_bytes - routed.peak_gpu_bytes == (10 - 8) * per_expert
    assert abs(everything.peak_gpu_bytes / 2**30 / (9.59 + 0.5) - 1) <= 0.3
    assert abs(routed.peak_gpu_bytes / 2**30 / (10.36 + 0.5) - 1) <= 0.3
    four = 4 << 30  # everything fits: routed gate/up back in the capture, 42 experts a chunk
    assert plan("awq", False, four).peak_gpu_bytes - routed.peak_gpu_bytes == 8 * 65536 * 2048 * 2
    assert plan("awq", True, four).peak_gpu_bytes - everything.peak_gpu_bytes == (42 - 10) * per_expert
    assert plan("gptq", True).peak_gpu_bytes == plan("gptq", False).peak_gpu_bytes


def test_awq_expert_inputs_flag_moves_the_plan_and_is_checked(moe_model):
    """--awq-expert-inputs reaches AWQ's chunking and its plan: a budget of one expert's
    inputs plans less memory than the default (all experts' inputs at once on this tiny
    model); a bad size or another method is refused before any work."""
    def plan(*extra: str) -> dict:
        res = CliRunner().invoke(main, ["plan", str(moe_model), "--method", "awq",
                                        "--moe-calibrate-all-experts", "--calib-samples", "64",
                                        "--calib-seqlen", "1024", "--json", *extra])
        assert res.exit_code == 0, res.output
        return json.loads(res.output)

    default, small = plan(), plan("--awq-expert-inputs", "64KiB")
    assert small["peak_ram_bytes"] < default["peak_ram_bytes"]
    for extra, said in ((["--method", "awq", "--awq-expert-inputs", "lots"], "is not a size"),
                        (["--method", "awq", "--awq-expert-inputs", "0"], "not a positive size"),
                        (["--method", "gptq", "--awq-expert-inputs", "1GiB"], "--awq-expert-inputs")):
        res = CliRunner().invoke(main, ["plan", str(moe_model), *extra])
        assert res.exit_code != 0 and said in res.output, res.output
