"""F32, F16 and BF16: GGML's unquantized types, plain little-endian copies of the weights."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from quantkit.ggml.codec import Codec

Q = GGMLQuantizationType

CODECS = (
    Codec(Q.F32, dtype=torch.float32),
    Codec(Q.F16, dtype=torch.float16),
    Codec(Q.BF16, dtype=torch.bfloat16),
)
