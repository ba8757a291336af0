"""DeepSeek-V3.2: discovery finds its blocks, MLA Linears and experts; what it cannot find is
the engine's choice for the sparse-attention indexer. vLLM 0.32's deepseek_v2.py `Indexer` gives
`wq_b` the checkpoint's quantization method but builds `wk` and `weights_proj` as one
MergedColumnParallelLinear with quant_config=None: they stay dense (and in the ignore list).

GGUF: llama.cpp's converter (DeepseekV32Model) writes it as its own deepseek32 architecture
(DeepSeek-V2's MLA split, the DSA indexer's tensors and keys, the MTP block as nextn), which the
gguf package quantkit runs with (scripts/constraints.txt: 0.19.0) does not have: no tensor name
can come from its TensorNameMap, so quantkit refuses GGUF for it and says why."""

from __future__ import annotations

# model_type -> what a discovered spec of that type keeps dense beyond what discovery finds
DISCOVERED_DENSE: dict[str, tuple[str, ...]] = {
    "deepseek_v32": ("self_attn.indexer.wk", "self_attn.indexer.weights_proj"),
}

GGUF = {"deepseek_v32": dict(gguf_unwritten="deepseek32")}
