"""DeepSeek-V3.2: discovery finds its blocks, MLA Linears and experts; what it cannot find is
the engine's choice for the sparse-attention indexer. vLLM 0.32's deepseek_v2.py `Indexer` gives
`wq_b` the checkpoint's quantization method but builds `wk` and `weights_proj` as one
MergedColumnParallelLinear with quant_config=None: they stay dense (and in the ignore list)."""

from __future__ import annotations

# model_type -> what a discovered spec of that type keeps dense beyond what discovery finds
DISCOVERED_DENSE: dict[str, tuple[str, ...]] = {
    "deepseek_v32": ("self_attn.indexer.wk", "self_attn.indexer.weights_proj"),
}
