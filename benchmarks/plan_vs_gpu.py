"""`quantkit plan`'s GPU-memory prediction vs the peaks measured on the H100 machine.

    .venv/bin/python benchmarks/plan_vs_gpu.py   # -> benchmarks/results/plan_vs_h100.json

Reads the measured quantkit rows (torch.cuda.max_memory_allocated, 128 x 2048 tokens, 8
samples per forward, W4A16 g128) from the GPU benchmark's results files, two model sizes
(Llama-3.1-8B and Llama-3.2-3B layer shapes), and predicts the same runs from the config alone. The plan includes the CUDA
context (512 MiB) that the allocator's peak does not see, so that is added to the measurement.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpu_quantkit_vs_llmcompressor import SHAPES
from transformers import LlamaConfig

from quantkit.arch import spec_for_config
from quantkit.pipeline.plan import estimate
from quantkit.types import QuantScheme

RESULTS = Path(__file__).with_name("results")
MEASURED = [RESULTS / "gptq_awq_h100_quantkit_replay_cold_triton_cache.json",
            RESULTS / "gptq_32_layers_h100_both_modes_vs_llmcompressor.json",
            RESULTS / "gptq_awq_h100_quantkit_3b_shapes.json",
            RESULTS / "gptq_awq_h100_quantkit_13b_shapes.json"]  # after the model was fitted: a check
CONTEXT_GIB = 0.5


def main() -> None:
    out = []
    for source in MEASURED:
        for r in json.loads(source.read_text())["rows"]:
            if r.get("tool") != "quantkit":
                continue
            shape = r.get("shape", "llama-3.1-8b")
            hidden, inter, heads, kv = SHAPES[shape]
            cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter,
                              num_attention_heads=heads, num_key_value_heads=kv,
                              num_hidden_layers=r["layers"], vocab_size=128256,
                              tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
            method, _, mode = r["method"].partition("-")
            scheme = QuantScheme(bits=4, group_size=128, symmetric=method == "gptq")
            plan = estimate(cfg, spec_for_config(cfg), method=method, scheme=scheme,
                            calib_samples=r["samples"], calib_seqlen=r["seqlen"], calibrated=True,
                            device="cuda", calib_batch=8, true_sequential=not mode)
            predicted = plan.peak_gpu_bytes / 2**30
            measured = r["peak_gpu_gib"] + CONTEXT_GIB
            out.append({"source": source.name, "shape": shape, "layers": r["layers"],
                        "method": r["method"], "gpu": r["gpu"], "predicted_gib": round(predicted, 2),
                        "measured_gib_incl_context": round(measured, 2),
                        "relative_error": round(predicted / measured - 1, 3)})
            print(f"{shape:13s} {r['layers']:2d} blocks {r['method']:22s} predicted "
                  f"{predicted:6.2f} GiB  measured {measured:6.2f} GiB  "
                  f"{100 * (predicted / measured - 1):+.1f} %")
    (RESULTS / "plan_vs_h100.json").write_text(json.dumps(
        {"sources": [m.name for m in MEASURED], "context_gib_added": CONTEXT_GIB, "rows": out},
        indent=1) + "\n")


if __name__ == "__main__":
    main()
