"""Quantization math, one module per method. Methods never import quantkit.formats."""

from __future__ import annotations

from quantkit.errors import SchemeMismatch
from quantkit.types import Quantizer

__all__ = ["get_quantizer", "METHODS"]

METHODS = ("rtn", "gptq", "gguf", "fp8", "awq", "int8", "nvfp4", "mxfp4")


def get_quantizer(name: str, **options) -> Quantizer:
    """The quantizer registered under `name`, built with method-specific options."""
    if name == "rtn":
        from quantkit.methods.rtn import RTNQuantizer

        return RTNQuantizer(**options)
    if name == "gptq":
        from quantkit.methods.gptq import GPTQQuantizer

        return GPTQQuantizer(**options)
    if name == "gguf":
        from quantkit.methods.kquants import GGUFQuantizer

        return GGUFQuantizer(**options)
    if name == "fp8":
        from quantkit.methods.fp8 import FP8Quantizer

        return FP8Quantizer(**options)
    if name == "awq":
        from quantkit.methods.awq import AWQQuantizer

        return AWQQuantizer(**options)
    if name == "int8":
        from quantkit.methods.int8 import Int8Quantizer

        return Int8Quantizer(**options)
    if name in ("nvfp4", "mxfp4"):
        from quantkit.methods.fp4 import FP4Quantizer

        return FP4Quantizer(method=name, **options)
    raise SchemeMismatch(f"Unknown method {name!r}.", f"Choose one of: {', '.join(METHODS)}.")
