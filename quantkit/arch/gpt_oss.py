"""gpt-oss: biased q/k/v/o and attention sinks (a per-head logit, kept unquantized), every
block MoE with a biased router `mlp.router` and biased experts stored fused in the
checkpoint (MXFP4 in OpenAI's). Per-expert Linears take llm-compressor's names
(`mlp.experts.{e}.gate_proj`, ...), what its gpt-oss calibration modules write.
"""

from __future__ import annotations

from quantkit.arch.spec import (
                      DENSE_AWQ,
                      DENSE_LINEARS,
                      DENSE_ROLES,
                      ArchSpec,
                      ExpertsSpec,
                      moe_awq_groups,
)

EXPERTS = ExpertsSpec(count_keys=("num_local_experts",), router="mlp.router",
                      fused_transposed=True, gate_up_interleaved=True, bias=True,
                      glu="_apply_gate", stored_fused=True,
                      activation="swigluoai")  # vLLM gpt_oss.py: its clamped SwiGLU

SPECS = (
    ArchSpec("gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",), experts=EXPERTS,
             sequential=DENSE_LINEARS[:2] + ((EXPERTS.linear("gate"), EXPERTS.linear("up")),
                                             (EXPERTS.linear("down"),)),
             # no up -> down group: down reads (clamp(up) + 1) * glu(gate), not linear in up's
             # output, so a scale folded from down's columns into up's rows would change what
             # the block computes (the norm -> every expert's gate/up group stays: one scale,
             # the router compensated)
             awq_groups=DENSE_AWQ[:2] + moe_awq_groups(EXPERTS)[:1],
             roles={k: v for k, v in DENSE_ROLES.items() if k.startswith("attn")},
             gguf_arch="gpt-oss", gguf_swa_pattern=2,  # llama.cpp: every 2nd layer global
             gguf_kv=("head_dim_if_set", "expert_count", "expert_used_count", "sliding_window",
                      "expert_feed_forward_length_intermediate"),
             engine_gaps={"vllm": "vLLM 0.32's gpt-oss loader reads experts only fused "
                          "(gate_up_proj / down_proj) or under its own w13_*/w2_* names and "
                          "skips per-expert gate_proj/up_proj/down_proj tensors without an "
                          "error (a decoded bf16 artifact under these names generated '' on "
                          "CPU); use --format gguf for llama.cpp"}),
)
