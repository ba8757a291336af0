"""Quantization math, one module per method. Methods never import quantkit.formats.

Each method module exports `RECORDS`, its registered `MethodRecord`(s) (quantkit.methods.options):
the quantizer, its flags' rules, its request builder and provenance, its plan terms. The
registry imports the modules on first use, so the CLI starts without them.
"""

from __future__ import annotations

import importlib
from functools import cache

from quantkit.errors import SchemeMismatch
from quantkit.methods.options import MethodRecord
from quantkit.types import Quantizer

__all__ = ["get_quantizer", "method_record", "registry", "CLI_METHODS", "MOE_METHODS_HINT"]

# the modules that register methods, in the registry's order (the order errors list them in)
_MODULES = ("rtn", "gptq", "kquants", "fp8", "awq", "int8", "fp4")
# --method's choices as `quantize --help` lists them (the registry need not load for --help)
CLI_METHODS = ("rtn", "gptq", "awq", "fp8", "int8", "nvfp4", "mxfp4", "gguf")
# what to use instead when a method cannot quantize the experts of a mixture of experts
MOE_METHODS_HINT = ("Use --method gptq, awq or rtn, --method fp8, int8, nvfp4 or mxfp4 (every "
                    "scheme) to --format compressed-tensors, or --method gguf to --format gguf.")


@cache
def registry() -> dict[str, MethodRecord]:
    """Every method's record by name, in the modules' order."""
    records: dict[str, MethodRecord] = {}
    for module in _MODULES:
        for record in importlib.import_module(f"quantkit.methods.{module}").RECORDS:
            records[record.name] = record
    return records


def method_record(name: str) -> MethodRecord:
    """The record registered under `name`."""
    records = registry()
    if name not in records:
        raise SchemeMismatch(f"Unknown method {name!r}.", f"Choose one of: {', '.join(records)}.")
    return records[name]


def get_quantizer(name: str, **options) -> Quantizer:
    """The quantizer registered under `name`, built with method-specific options."""
    return method_record(name).quantizer(**options)
