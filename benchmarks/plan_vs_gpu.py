"""`quantkit plan`'s GPU-memory prediction vs the peaks measured on the H100 machine.

    .venv/bin/python benchmarks/plan_vs_gpu.py   # -> benchmarks/results/plan_vs_h100.json

Reads the measured quantkit rows (torch.cuda.max_memory_allocated, 4 blocks of Llama-3.1-8B
shapes, 128 x 2048 tokens, 8 samples per forward, W4A16 g128) from the GPU benchmark's
results file and predicts the same runs from the config alone. The plan includes the CUDA
context (512 MiB) that the allocator's peak does not see, so that is added to the measurement.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import LlamaConfig

from quantkit.arch import spec_for_config
from quantkit.pipeline.plan import estimate
from quantkit.types import QuantScheme

RESULTS = Path(__file__).with_name("results")
MEASURED = RESULTS / "gptq_awq_h100_quantkit_replay_cold_triton_cache.json"
CONTEXT_GIB = 0.5


def main() -> None:
    rows = [r for r in json.loads(MEASURED.read_text())["rows"] if r.get("tool") == "quantkit"]
    out = []
    for r in rows:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                          num_key_value_heads=8, num_hidden_layers=r["layers"], vocab_size=128256,
                          tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
        scheme = QuantScheme(bits=4, group_size=128, symmetric=r["method"] == "gptq")
        plan = estimate(cfg, spec_for_config(cfg), method=r["method"], scheme=scheme,
                        calib_samples=r["samples"], calib_seqlen=r["seqlen"], calibrated=True,
                        device="cuda", calib_batch=8)
        predicted = plan.peak_gpu_bytes / 2**30
        measured = r["peak_gpu_gib"] + CONTEXT_GIB
        out.append({"method": r["method"], "gpu": r["gpu"], "predicted_gib": round(predicted, 2),
                    "measured_gib_incl_context": round(measured, 2),
                    "relative_error": round(predicted / measured - 1, 3)})
        print(f"{r['method']:5s} predicted {predicted:6.2f} GiB  measured {measured:6.2f} GiB  "
              f"{100 * (predicted / measured - 1):+.1f} %")
    (RESULTS / "plan_vs_h100.json").write_text(json.dumps(
        {"source": MEASURED.name, "context_gib_added": CONTEXT_GIB, "rows": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
