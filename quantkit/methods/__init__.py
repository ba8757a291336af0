"""Quantization math, one module per method. Methods never import quantkit.formats."""

from __future__ import annotations

from quantkit.errors import SchemeMismatch
from quantkit.types import Quantizer

__all__ = ["get_quantizer", "METHODS"]

METHODS = ("rtn",)


def get_quantizer(name: str, **options) -> Quantizer:
    """The quantizer registered under `name`, built with method-specific options."""
    if name == "rtn":
        from quantkit.methods.rtn import RTNQuantizer

        return RTNQuantizer(**options)
    raise SchemeMismatch(f"Unknown method {name!r}.", f"Choose one of: {', '.join(METHODS)}.")
