"""What a method record is, and the flags `quantize` and `plan` share, as plain data.

The CLI turns each `Flag` into a click option (methods know no click); `readers` says which
methods read a flag, in the order the refusal names them, so a flag given to another method
is refused rather than silently ignored or recorded as if it had been applied. A method's own
rules, its request builder and its provenance live in its record (`MethodRecord`), in its
module; `quantkit.methods` collects them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.types import EXPERT_MIN_TOKENS, PlanFacts, Quantizer, QuantScheme

__all__ = ["Flag", "FLAGS", "FLAG_READERS", "CALIB_FLAGS", "MOE_FLAGS", "FlagValues",
           "MethodRequest", "MethodRecord", "parse_size", "int_scheme_args", "shared_options",
           "check_gptq_rounding_flags"]

_DEFAULT = QuantScheme()


@dataclass(frozen=True)
class Flag:
    """One option of `quantize` / `plan`. `kind`: int, float, str, path (a file), flag (on
    when given), switch (an on/off pair in `decls`, e.g. "--sym/--asym"), choice
    (`choices`), float_range / int_range (`bounds`). `readers` None: every method reads it."""

    name: str  # the click parameter name
    decls: tuple[str, ...]
    kind: str = "str"
    default: Any = None
    help: str | None = None
    show_default: bool = False
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    bounds: tuple[float | None, float | None] = (None, None)
    readers: tuple[str, ...] | None = None


_INT_METHODS = ("rtn", "gptq", "awq")
_GPTQ_READERS = ("gptq", "int8", "nvfp4", "mxfp4", "gguf")
_CALIBRATED = ("gptq", "awq", "gguf", "fp8", "int8", "nvfp4", "mxfp4")
# per-expert statistics of mixture-of-experts blocks: GPTQ's Hessians, AWQ's activation
# means, FP8 static / int8 static / NVFP4 W4A4 input scales, SmoothQuant ranges, FP4 /
# int8 GPTQ rounding
_MOE_READERS = ("gptq", "awq", "fp8", "int8", "nvfp4", "mxfp4")
CALIB_FLAGS = ("calib", "calib_samples", "calib_seqlen", "chat", "seed", "text_column")
MOE_FLAGS = ("moe_calibrate_all_experts", "expert_min_tokens")
# the format option sits here in the order; its default and help come from quantkit.formats
FORMAT_FLAG = "fmt"

FLAGS: tuple[Flag, ...] = (
    Flag("bits", ("--bits",), "int", _DEFAULT.bits, "Weight bits.", show_default=True,
         readers=_INT_METHODS),
    Flag("group_size", ("--group-size",), "int", None,
         f"Columns per scale group (-1: one group per row). Default: {_DEFAULT.group_size} "
         "where it divides every Linear's input width, else the largest of 64 / 32 that does "
         "(printed and recorded).", readers=_INT_METHODS),
    Flag("sym", ("--sym/--asym",), "switch", _DEFAULT.symmetric,
         "Symmetric (no zero point) or asymmetric grid. Default: the format's grid, "
         "asymmetric for --format mlx (its affine grid stores a bias per group), symmetric "
         "for every other format.", readers=_INT_METHODS),
    Flag("act_order", ("--act-order/--no-act-order",), "switch", _DEFAULT.act_order,
         "GPTQ: quantize columns in activation order (groups stay static). Default: the "
         "format's, on for --format mlx (SmolLM2 4-bit g64 KLD, benchmarks/mlx_vs_mlxlm.py), "
         "off for every other format.", readers=("gptq",)),
    Flag("damp", ("--damp",), "float", None, "GPTQ: Hessian dampening (share of mean diag).",
         readers=_GPTQ_READERS),
    Flag("true_sequential", ("--true-sequential/--no-true-sequential",), "switch", None,
         "GPTQ: calibrate q/k/v -> o -> gate/up -> down each on the previous ones' quantized "
         "outputs (default), or all on the unquantized block (fewer forwards on a GPU, "
         "slightly less accurate).", readers=("gptq",)),
    Flag("gptq_v_hessian", ("--gptq-v-hessian", "gptq_v_hessian"), "choice", None,
         "GPTQ (--method gptq, or --rounding gptq): the Hessian of v_proj: tokens (X^T X, "
         "every token alike; default) or attention (weighted by the block's attention "
         "probabilities, the error v_proj's output really makes; llama, mistral, qwen2, "
         "qwen3, qwen3_moe, mixtral).", choices=("tokens", "attention"), readers=_GPTQ_READERS),
    Flag(FORMAT_FLAG, ("--format", FORMAT_FLAG)),
    Flag("gguf_type", ("--gguf-type",), "str", None,
         "GGUF: f16, bf16, q8_0, q6_k, q5_k_m, q5_k_s, q5_1, q5_0, q4_k_m, q4_k_s, q4_1, q4_0, "
         "iq4_nl, iq4_xs, q3_k_l, q3_k_m, q3_k_s, q2_k, q2_k_s, iq3_m, iq3_s, iq3_xs, iq3_xxs, "
         "iq2_m, iq2_s, iq2_xs, iq2_xxs, iq1_m, iq1_s (q2_k_s, iq3_xs and below need --imatrix "
         "or --calib) (llama.cpp's names and per-tensor rules), or auto: each tensor's type "
         "chosen by its measured sensitivity to fit --target-bpw / --target-size.",
         readers=("gguf",)),
    Flag("target_bpw", ("--target-bpw", "target_bpw"), "float", None,
         "GGUF --gguf-type auto: bits per weight of the file's weight matrices (block "
         "Linears, token_embd, output), e.g. 4.5.", readers=("gguf",)),
    Flag("target_size", ("--target-size", "target_size"), "str", None,
         "GGUF --gguf-type auto: the whole file's size, e.g. 80MB, 1.5GiB or bytes.",
         metavar="SIZE", readers=("gguf",)),
    Flag("imatrix", ("--imatrix",), "path", None,
         "GGUF: importance matrix file (llama.cpp's or quantkit's); or give --calib to "
         "collect one from calibration data.", readers=("gguf",)),
    Flag("fp8_scheme", ("--scheme", "fp8_scheme"), "str", None,
         "FP8: dynamic, static or block. int8: dynamic (per-token inputs) or static (one "
         "calibrated per-tensor input scale). nvfp4: w4a16 (weights only, default) or w4a4 "
         "(NVFP4 inputs, calibrated global input scales). awq: w4a16 (default) or w4a8 (FP8 "
         "static inputs, TensorRT-LLM's W4A8_AWQ; --format modelopt).",
         readers=("fp8", "int8", "nvfp4", "awq")),
    Flag("smoothquant", ("--smoothquant", "smoothquant"), "float_range", None,
         "int8: migrate activation outliers into the weights with strength ALPHA (0.5 "
         "usual), folded into the preceding norm / Linear.", metavar="ALPHA",
         bounds=(0.0, 1.0), readers=("int8",)),
    Flag("smoothquant_pairs", ("--smoothquant-pairs", "smoothquant_pairs"), "choice", None,
         "int8 --smoothquant: all (default: norm -> q/k/v, norm -> gate/up, up -> down, "
         "v -> o where shapes allow) or norms (the two norm groups only: llm-compressor's "
         "default SmoothQuant mappings).", choices=("all", "norms"), readers=("int8",)),
    Flag("rounding", ("--rounding",), "choice", None,
         "int8, nvfp4, mxfp4, gguf: round the weights to nearest (rtn, default) or with GPTQ "
         "onto the same grid (reads calibration data; gguf: llama.cpp's scales per "
         "super-block from the error-updated weights; --method gptq --format gguf is the "
         "same).", choices=("rtn", "gptq"), readers=("int8", "nvfp4", "mxfp4", "gguf")),
    Flag("kv_cache", ("--kv-cache", "kv_cache"), "choice", None,
         "Also calibrate per-layer FP8 E4M3 k/v scales for the engine's KV cache (formats "
         "compressed-tensors, fp8, modelopt).", choices=("fp8",)),
    Flag("calib", ("--calib",), "str", "mixed",
         "Calibration data: built-in set (mixed, prose, code, techdoc), a .txt/.jsonl/.parquet "
         "file, or hf:DATASET[:CONFIG][:SPLIT][:COLUMN].", show_default=True,
         readers=_CALIBRATED),
    Flag("text_column", ("--text-column",), "str", None,
         "Column holding the text (or chat messages) of a .jsonl/.parquet/hf: calibration "
         "source (default: text, content or messages).", readers=_CALIBRATED),
    Flag("calib_samples", ("--calib-samples",), "int", 128, show_default=True,
         readers=_CALIBRATED),
    Flag("calib_seqlen", ("--calib-seqlen",), "int", 512, show_default=True,
         readers=_CALIBRATED),
    Flag("chat", ("--chat",), "flag", help="Render calibration text through the chat template.",
         readers=_CALIBRATED),
    Flag("seed", ("--seed",), "int", 0, show_default=True, readers=_CALIBRATED),
    Flag("device", ("--device",), "str", None, "cpu or cuda (default: cuda when present)."),
    Flag("allow_pickle", ("--allow-pickle",), "flag", help="Allow loading pickle (.bin) weights."),
    Flag("trust_remote_code", ("--trust-remote-code",), "flag",
         help="Allow the model's own Python code."),
    Flag("stream", ("--stream/--no-stream",), "switch", None,
         "Read one decoder block at a time from the shards (default: whenever the checkpoint "
         "allows it) or load the whole model."),
    Flag("moe_calibrate_all_experts", ("--moe-calibrate-all-experts",), "flag",
         help="Mixture of experts: send every calibration token through every expert for "
              "statistics (the block output keeps the real routing).", readers=_MOE_READERS),
    Flag("awq_expert_inputs", ("--awq-expert-inputs", "awq_expert_inputs"), "str", None,
         "AWQ on mixture of experts: the most memory the experts' search inputs may take at "
         "once (default 1GiB); above it the experts are searched a chunk at a time (same "
         "artifact, less memory), e.g. 512MiB.", metavar="SIZE", readers=("awq",)),
    Flag("expert_min_tokens", ("--moe-min-tokens", "expert_min_tokens"), "int_range",
         EXPERT_MIN_TOKENS, "Mixture of experts: warn about experts calibrated on fewer "
         "routed tokens (an expert with none falls back to RTN).", show_default=True,
         bounds=(0, None), readers=_MOE_READERS),
)
FLAG_READERS: dict[str, tuple[str, ...]] = {f.name: f.readers for f in FLAGS if f.readers}


@dataclass
class FlagValues:
    """What a record's rules and builder see of one command line: every value (`values`,
    by click parameter name), the reader-checked flags the user typed, as typed (`given`),
    and which values were typed rather than defaulted (`explicit`)."""

    values: dict[str, Any]
    given: dict[str, str]
    explicit: set[str] = field(default_factory=set)

    def __getitem__(self, name: str) -> Any:
        return self.values.get(name)

    @property
    def calib(self) -> list[str]:
        """The calibration (and MoE statistics) flags typed, as typed."""
        return [self.given[n] for n in (*CALIB_FLAGS, *MOE_FLAGS) if n in self.given]

    @property
    def rounding(self) -> str:
        return self.values.get("rounding") or "rtn"


@dataclass
class MethodRequest:
    """A record builder's answer: the scheme, the method's options (their order is what
    quantkit.json records), whether the group size is still to fit, and the format."""

    scheme: QuantScheme
    options: dict
    group_size_auto: bool
    format: str


def _nothing(*_args) -> None:
    return None


def _no_args(_req) -> list[str]:
    return []


def _false(_options: dict) -> bool:
    return False


@dataclass(frozen=True)
class MethodRecord:
    """Everything the CLI, `plan` and the conductor know about one method.

    `quantizer(**options)` builds it. `check_flags(values)` refuses what the flag-reader
    table cannot say (flags read only with other flags). `build(values, options)` turns the
    flags into the request (`options` arrives holding the GPTQ flags every reader shares);
    `command_args(req)` / `command_tail(req)` are its inverse: the method's flags in the
    provenance command (after --format, and after the shared flags), and
    `reads_calibration(options)` whether that command names the calibration data.
    `native_format`: the one format the method writes (--format defaults to it, and
    `native_format_refusal` is the message for the default format given explicitly);
    `format_aliases`: a format that turns the request into another method's (GPTQ onto GGML
    grids is the gguf method's gptq rounding).
    MoE: `handles_experts` (the pipeline calibrates experts itself) or, for any method, an
    expert-aware quantizer (Quantizer.moe_calibrated) or its native format.
    `kv_cache_calibrates`: --kv-cache makes calibration flags read (the scales calibrate on
    the data). Plan terms: `solves_hessians` (GPTQ's Hessians and solve, unless the caller
    says), `plan_passes` (calibration forwards per quantized weight without a solve),
    `plan_stats` (the block's statistics bytes without a solve), `plan_disk` (artifact
    bytes; None: packed integer codes), `plan_write` (extra bytes of the write phase).
    """

    name: str
    quantizer: Callable[..., Quantizer]
    build: Callable[[FlagValues, dict], MethodRequest]
    command_args: Callable[[Any], list[str]]
    check_flags: Callable[[FlagValues], None] = _nothing
    command_tail: Callable[[Any], list[str]] = _no_args
    reads_calibration: Callable[[dict], bool] = _false
    native_format: str | None = None
    native_format_refusal: tuple[str, str] | None = None
    format_aliases: dict[str, tuple[str, dict]] = field(default_factory=dict)
    handles_experts: bool = False
    kv_cache_calibrates: bool = True
    solves_hessians: bool = False
    plan_passes: float = 0
    plan_stats: Callable[[PlanFacts], int] | None = None
    plan_disk: Callable[[PlanFacts], int] | None = None
    plan_write: Callable[[PlanFacts], int] | None = None


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str = "--target-size") -> int:
    """'80MB' -> 80_000_000, '1.5GiB' -> 1610612736, '123456' -> 123456 bytes (> 0)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise QuantkitError(f"{flag} {text!r} is not a size.",
                            "Write it as a number of bytes or with a unit: 80MB, 80MiB, 1.5GB.")
    size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size < 1:
        raise QuantkitError(f"{flag} {text!r} is not a positive size.", "e.g. 80MB or 1.5GiB.")
    return size


def shared_options(v: FlagValues) -> dict:
    """The options of the flags several methods read alike (GPTQ's), before a record's
    builder adds its own: their order is the order quantkit.json records."""
    options: dict = {}
    if v["damp"] is not None:
        options["damp"] = v["damp"]
    if v["true_sequential"] is False:
        options["true_sequential"] = False
    if v["gptq_v_hessian"] not in (None, "tokens"):  # the default is left out: same request
        options["v_hessian"] = v["gptq_v_hessian"]
    return options


def check_gptq_rounding_flags(method: str, v: FlagValues) -> None:
    """GPTQ's flags are read by a method with a rounding choice only with --rounding gptq."""
    for flag in ("damp", "gptq_v_hessian"):
        if flag in v.given and v.rounding != "gptq":
            raise QuantkitError(f"{v.given[flag]} is read by --method {method} only with "
                                "--rounding gptq.", f"Drop {v.given[flag]}, or pass --rounding gptq.")


def int_scheme(v: FlagValues, options: dict, activations: str | None = None) -> MethodRequest:
    """The integer weight scheme of --bits / --group-size / --sym / --act-order."""
    auto = v["group_size"] is None
    scheme = QuantScheme(kind="int", bits=v["bits"],
                         group_size=_DEFAULT.group_size if auto else v["group_size"],
                         symmetric=v["sym"], act_order=v["act_order"], gguf_type=v["gguf_type"],
                         activations=activations)
    return MethodRequest(scheme, options, auto, v[FORMAT_FLAG])


def int_scheme_args(req) -> list[str]:
    """The integer scheme's flags in a provenance command."""
    s = req.scheme
    args = ["--bits", str(s.bits), "--group-size", str(s.group_size),
            "--sym" if s.symmetric else "--asym"] + (["--act-order"] if s.act_order else [])
    if s.activations == "fp8":
        args += ["--scheme", "w4a8"]
    return args


def rounding_args(req) -> list[str]:
    """--rounding in a provenance command, for the methods that offer both roundings."""
    rounding = req.method_options.get("rounding")
    return ["--rounding", str(rounding)] if rounding else []
