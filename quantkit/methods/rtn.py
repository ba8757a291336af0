"""Round-to-nearest: the baseline every other method must beat. Ignores calibration data."""

from __future__ import annotations

import time

from quantkit.methods.intquant import check_int_scheme, check_no_act_order, rtn_quantize_weight
from quantkit.methods.options import MethodRecord, int_scheme, int_scheme_args
from quantkit.types import BlockContext, Quantizer, QuantResult, QuantScheme

__all__ = ["RTNQuantizer", "RECORDS"]


class RTNQuantizer(Quantizer):
    name = "rtn"
    stats: tuple[str, ...] = ()
    propagate_quantized = False  # RTN reads no activations, so nothing needs propagating
    needs_calibration = False
    data_parallel = True  # each rank rounds a share of the Linears (solve_units)

    def check(self, scheme: QuantScheme) -> None:
        check_int_scheme(scheme)
        check_no_act_order(scheme, self.name)

    def solve_units(self, ctx: BlockContext) -> list[tuple[list[str], int]]:
        return [([n], m.weight.numel()) for n, m in ctx.linears.items()]

    def quantize_block(self, ctx: BlockContext) -> dict[str, QuantResult]:
        results = {}
        for name, linear in ctx.linears.items():
            t0 = time.perf_counter()
            res = rtn_quantize_weight(name, linear.weight.data, ctx.scheme)
            res.bias = None if linear.bias is None else linear.bias.data.clone()
            res.seconds = time.perf_counter() - t0
            results[name] = res
        return results


RECORDS = (MethodRecord(
    name="rtn", quantizer=RTNQuantizer, build=int_scheme, command_args=int_scheme_args,
    handles_experts=True),)
