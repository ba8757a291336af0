"""OLMo 3: carried by discovery (post-attention / post-MLP norms, full-width q/k norms); GGUF
as llama.cpp's converter writes it, under its olmo2 architecture (Olmo2Model converts both),
with the per-layer sliding-window pattern from layer_types."""

from __future__ import annotations

# model_type -> the ArchSpec fields of its GGUF layout (quantkit.arch.with_gguf applies them)
GGUF = {
    "olmo3": dict(gguf_arch="olmo2",
                  gguf_kv=("rope_freq_base_swa", "sliding_window", "sliding_window_pattern")),
}
