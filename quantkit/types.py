"""The few records every part of quantkit shares.

Methods produce `QuantResult`s, formats consume them; the two never import each other.
Defaults of a scheme are defined here once; the CLI reads them from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = [
    "QuantScheme",
    "QuantResult",
    "BlockContext",
    "Quantizer",
    "PlanFacts",
    "ProgressFn",
    "int_qrange",
    "EXPERT_MIN_TOKENS",
]

# MoE: experts calibrated on fewer routed tokens than this are named in a warning
EXPERT_MIN_TOKENS = 16


ProgressFn = Callable[[str, int, int], None]
"""on_progress(stage, done, total): the only way core code reports progress."""


def int_qrange(bits: int) -> tuple[int, int]:
    """Unsigned code range [0, 2^bits - 1] used for every integer scheme."""
    return 0, (1 << bits) - 1


@dataclass(frozen=True)
class QuantScheme:
    """What a weight is turned into. `group_size=-1` means one group per output row.

    `activations`: None for weight-only schemes; "dynamic" (per-token scales computed by the
    engine) or "static" (one calibrated per-tensor scale) when the engine also quantizes the
    Linear's inputs to the weights' integer type (int8 W8A8); "fp8" for int4 weights whose
    inputs the engine casts to FP8 E4M3 under one calibrated per-tensor scale (W4A8_AWQ).

    `float_zero`: the asymmetric grid's zero point is a float per group (the format stores a
    free float bias, FormatRecord.float_zero: MLX), so scale and zero are fitted by least
    squares on the chosen codes (intquant.group_quantize, affine_refit); otherwise an integer.

    `tensor_scale`: NVFP4's FP32 scale per tensor (the global scale that keeps the E4M3 group
    scales in range); False where the format stores none (FormatRecord.fp4_tensor_scale: MLX's
    QuantizedLinear), so the E4M3 group scales are the weights' own step."""

    kind: str = "int"  # "int" | "fp8" | "kquant" | "nvfp4" | "mxfp4"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    act_order: bool = False
    gguf_type: str | None = None
    activations: str | None = None
    float_zero: bool = False
    tensor_scale: bool = True

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size in (-1, 0) else -(-in_features // self.group_size)

    def record(self) -> dict:
        """The fields as quantkit.json stores them: `float_zero` and `tensor_scale` only where
        they differ from their defaults, so the artifacts of other formats keep the bytes they
        had before these fields."""
        out = asdict(self)
        if not self.float_zero:
            del out["float_zero"]
        if self.tensor_scale:
            del out["tensor_scale"]
        return out

    def effective_group(self, in_features: int) -> int:
        return in_features if self.group_size in (-1, 0) else self.group_size

    def describe(self) -> str:
        if self.kind == "int":
            g = "per-channel" if self.group_size in (-1, 0) else f"g{self.group_size}"
            if self.activations == "fp8":  # ModelOpt / TensorRT-LLM W4A8_AWQ
                return (f"W{self.bits}A8 int{self.bits} {g} {'sym' if self.symmetric else 'asym'}, "
                        "FP8 E4M3 static per-tensor inputs")
            if self.activations:
                inputs = "dynamic per-token" if self.activations == "dynamic" else "static per-tensor"
                return f"W{self.bits}A{self.bits} int{self.bits} {g} {'sym' if self.symmetric else 'asym'}, {inputs} inputs"
            return f"W{self.bits}A16 {g} {'sym' if self.symmetric else 'asym'}"
        if self.kind in ("nvfp4", "mxfp4"):
            scale = "FP8 E4M3" if self.kind == "nvfp4" else "E8M0"
            inputs = "A4 (NVFP4 inputs)" if self.activations else "A16"
            tensor = "" if self.tensor_scale or self.kind != "nvfp4" else ", no tensor scale"
            return (f"{self.kind.upper()} W4{inputs}, E2M1 with a {scale} scale per "
                    f"{self.group_size}{tensor}")
        return self.gguf_type or self.kind


@dataclass
class QuantResult:
    """One quantized Linear, unpacked. Packing is a format's job.

    Integer schemes (the invariant every method keeps, checked by tests):
      codes  uint8 [N, K], original column order, values in [0, 2^bits - 1]
      scale  float32 [N, G]; zero int32 [N, G] (sym: 2^(bits-1) everywhere; float32 where
             scheme.float_zero: a format with a free float bias per group)
      g_idx  int32 [K] group of each column (None = k // group_size)
      weight = (codes - zero[:, g_idx]) * scale[:, g_idx]
    `extra` carries format-specific side tensors (e.g. AWQ pre_quant_scale, K-quant blocks).
    """

    name: str
    scheme: QuantScheme
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    loss: float | None = None  # relative reconstruction error ||W - Wq||_F / ||W||_F or method loss
    seconds: float | None = None
    calib_tokens: int | None = None  # calibration tokens this Linear saw (MoE experts: routed ones)
    fallback: str | None = None  # the method used instead when this one could not run (e.g. "rtn")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def column_groups(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        k = self.codes.shape[1]
        g = self.scheme.effective_group(k)
        return torch.arange(k) // g

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this result stands for (what the pipeline propagates)."""
        if self.scheme.kind != "int":
            raise NotImplementedError(f"dequantize for kind {self.scheme.kind}")
        n, k = self.codes.shape
        g = self.scheme.effective_group(k)
        if self.g_idx is None and k % g == 0:  # contiguous groups: broadcast, no [N, K] gather
            q = self.codes.float().reshape(n, k // g, g)
            if self.zero is not None:
                q = q - self.zero.float()[..., None]
            return (q * self.scale.float()[..., None]).reshape(n, k).to(dtype)
        gi = self.column_groups()
        scale = self.scale.float()[:, gi]
        zero = self.zero.float()[:, gi] if self.zero is not None else 0.0
        return ((self.codes.float() - zero) * scale).to(dtype)


@dataclass
class BlockContext:
    """What a quantizer sees of one decoder block.

    `linears` maps names relative to the block (e.g. "self_attn.q_proj") to the modules in
    quantization order. `stats[linear_name][stat]` holds the statistics the quantizer asked
    for, gathered from this block's calibration inputs. `rerun()` runs the block again on its
    cached inputs and returns the outputs (AWQ's search needs it; `rerun(n)`: the first n
    batches only; `rerun(n, hidden=[...])`: on other hidden states, e.g. perturbed inputs).
    """

    index: int
    block: torch.nn.Module
    linears: dict[str, torch.nn.Linear]
    stats: dict[str, dict[str, Any]]
    scheme: QuantScheme
    inputs: list[torch.Tensor]
    rerun: Callable[..., list[torch.Tensor]]
    arch: Any = None  # quantkit.arch.ArchSpec
    options: dict[str, Any] = field(default_factory=dict)
    collect: Callable[[list[str], tuple[str, ...]], dict[str, dict[str, Any]]] | None = None
    # quantkit.pipeline.replay.BlockReplay: record what submodules receive on a rerun, replay
    # an experts module's calls for some experts (AWQ's search inputs)
    replay: Any = None


@dataclass(frozen=True)
class PlanFacts:
    """What `quantkit plan` knows of a run when it asks a method for its own memory and disk
    terms (quantkit.pipeline.plan): shapes from the config, sizes in bytes."""

    config: Any
    spec: Any  # quantkit.arch.ArchSpec
    scheme: QuantScheme
    linears: list[dict[str, tuple[int, int]]]  # per block: Linear name -> [N, K]
    tokens: int  # calibration tokens (0 without calibration)
    cuda: bool
    hidden: int
    inter: int
    act_bytes: int  # bytes per activation value (the compute dtype's)
    block_params: int  # the largest block's parameters
    moe: bool
    moe_all_experts: bool
    expert_input_bytes: int | None  # AWQQuantizer's expert_input_bytes (None: its default)
    quantized: int  # quantized weights of the blocks
    scales: int  # scale groups of the blocks
    outside: int  # parameters outside the blocks
    dense_outside: int  # their bytes in the stored dtype


class Quantizer:
    """A quantization method: math only, no file formats. Every method derives from this
    class; each hook the pipeline reads is declared here with its default, so the pipeline
    reads attributes directly and a new method overrides only what it changes."""

    name: str = ""
    # statistics the pipeline gathers per Linear, e.g. ("hessian",); none: no forward hooks
    stats: tuple[str, ...] = ()
    # the next group / block calibrates on this one's quantized outputs (GPTQ's error feedback)
    propagate_quantized: bool = False
    # calibration batches are captured and run through the blocks only when a method reads them
    needs_calibration: bool = False
    # q/k/v -> o -> gate/up -> down each on the previous groups' outputs, not all at once
    true_sequential: bool = False
    # samples per calibration forward: larger batches are fewer, bigger ops (faster on a CPU)
    calib_batch_size: int = 1
    # torchrun runs: False (refused), True (summed statistics; the solves spread over the
    # ranks when solve_units names them, else on rank 0) or "block" (each block's search
    # runs on rank 0 over every rank's inputs)
    data_parallel: bool | str = False
    # per-expert statistics, and a fallback for an expert the router fed no calibration token
    moe_calibrated: bool = False
    # v_proj's Hessian: "tokens" (X^T X) or "attention" (one more eager attention forward)
    v_hessian: str = "tokens"
    # "rtn" / "gptq" for methods that offer both roundings (shown by `quantkit plan`); None: no
    # choice to show
    rounding: str | None = None
    # AWQ on MoE: the most bytes the experts' search inputs may take at once (None: no such cap)
    expert_input_bytes: int | None = None
    # the method quantizes tensors outside the blocks (quantize_rest) and keeps state across
    # blocks, so per-block checkpoints cannot resume it
    quantizes_outside_blocks: bool = False
    # quantize_rest reads the final norm too (the head's input), so it is loaded for it
    reads_final_norm: bool = False
    # a whole-file size budget: what the writer adds besides the weight matrices, set by the
    # pipeline before prepare(); None: the method has no such budget
    file_overhead_bytes: int | None = None
    # per-tensor choices the method made itself, recorded in quantkit.json (GGUF auto)
    allocation: dict | None = None
    # per block and smoothing group, what the method searched and folded (AWQ); recorded in
    # quantkit.json for families whose groups were discovered. Empty: no smoothing
    history: tuple | list = ()

    def check(self, scheme: QuantScheme) -> None:
        """Refuse a scheme this method cannot produce, before any work."""

    def prepare(self, *, config: Any = None, spec: Any = None,
                shapes: dict[str, tuple[int, int]] | None = None) -> None:
        """Per-tensor plans from the config alone, once it is read (nothing to plan here)."""

    def warm_up(self, scheme: QuantScheme, device: torch.device) -> None:
        """Start slow set-up (e.g. compile a GPU kernel) while the inputs are captured."""

    def observe_embedding(self, module: torch.nn.Module, batches: list[torch.Tensor]) -> None:
        """Block 0's inputs are captured: the embedding table is real now; batches are the
        calibration token ids."""

    def quantize_block(self, ctx: BlockContext) -> dict[str, QuantResult]:
        raise NotImplementedError

    def solve_units(self, ctx: BlockContext) -> list[tuple[list[str], int]] | None:
        """The independent solves of `quantize_block(ctx)`, for data-parallel runs that spread
        them over the ranks (quantkit.pipeline.distributed): (names of the Linears solved
        together, relative cost as an integer), every Linear of ctx in exactly one unit.
        The promise: quantize_block on a copy of ctx whose `linears` hold any union of whole
        units returns exactly those Linears' results, the same as on the whole ctx, and
        changes nothing else (no other tensor of the block, no state across calls).
        None (the default): the group is one piece, solved on rank 0."""
        return None

    def quantize_rest(self, model: torch.nn.Module, spec: Any) -> dict[str, QuantResult]:
        """Tensors outside the blocks, after them (read only with quantizes_outside_blocks)."""
        return {}
