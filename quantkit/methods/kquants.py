"""GGUF quantization (`--method gguf`): llama.cpp's per-tensor type mix plus bit-exact encoders.

The mix (which GGML type each tensor gets) is quantkit.ggml.mix.plan_types over the presets
of quantkit.ggml.catalogue; the encoders and decoders are quantkit.ggml's codecs. This module
is the method: options, imatrix collection, GPTQ rounding and `--gguf-type auto`'s measurements.

Methods never import quantkit.formats: the quantizer hands the writer encoded rows in
`QuantResult.extra["gguf_bytes"]` (HF row order; the writer applies llama's q/k row
permutation, which commutes with row-wise encoding).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from quantkit.arch import gguf_linear_name
from quantkit.errors import QuantkitError, SchemeMismatch
from quantkit.ggml.catalogue import (
    AUTO_BASE,
    FALLBACK,
    PRESETS,
    bits_per_weight,
    block_size,
    type_size,
)
from quantkit.ggml.codec import dequantize_tensor, preload_compiled, quantize_tensor
from quantkit.ggml.mix import TensorPlan, layer_of, plan_types
from quantkit.methods.bit_allocation import Option
from quantkit.methods.imatrix import ImatrixData, load_imatrix, save_imatrix
from quantkit.methods.options import (
    FlagValues,
    MethodRecord,
    MethodRequest,
    check_gptq_rounding_flags,
    parse_size,
    rounding_args,
)
from quantkit.types import BlockContext, PlanFacts, Quantizer, QuantResult, QuantScheme

__all__ = ["GGUFQuantizer"]

Q = GGMLQuantizationType
log = logging.getLogger("quantkit.gguf")



class GGUFQuantizer(Quantizer):
    """llama.cpp's quantization, in Python: per-tensor type mix + K-quant encoders.

    Options: gguf_type (a PRESETS key), imatrix (None, a llama.cpp imatrix file - GGUF or
    legacy .dat - or "calib" to collect one from the calibration set through the pipeline's
    "sq_mean" statistic), imatrix_out (where to save a collected imatrix, GGUF format).

    Results carry only the GGML bytes (extra["gguf_bytes"]), no dequantized weight: the
    imatrix is a statistic of the float model (propagate_quantized False), so nothing reads
    quantized weights back, and a float32 copy per Linear would cost memory and a decode.
    The per-Linear error comes from the encoder itself (encode_rows(errors=True)).

    rounding="gptq" (`--method gptq --format gguf`): GPTQ's column loop onto each planned
    type's grid (quantkit.methods.gguf_gptq), Hessians from the calibration pipeline, damp as
    GPTQ's (v_hessian as GPTQ's); those results also carry extra["dequantized"] (the exact
    decoded weight, which
    later blocks calibrate on) and QuantResult.fallback where llama.cpp's encoder ran instead.
    """

    name = "gguf"
    propagate_quantized = False  # like llama-imatrix: statistics of the float model
    calib_batch_size = 8  # sums of x^2 do not care how tokens are batched; bigger is faster
    quantizes_outside_blocks = True  # token_embd / output, and the auto solve over all blocks

    def __init__(self, gguf_type: str = "q4_k_m", imatrix: str | Path | bool | None = None,
                 imatrix_out: str | Path | None = None, imatrix_dataset: str | None = None,
                 rounding: str = "rtn", damp: float = 0.01, target_bpw: float | None = None,
                 target_size: int | None = None, gain_batches: int = 2,
                 v_hessian: str = "tokens", **_):
        from quantkit.methods.gptq import check_v_hessian

        key = str(gguf_type).lower()
        self.v_hessian = check_v_hessian(v_hessian)
        self.auto = key == "auto"
        if key not in PRESETS and not self.auto:
            raise SchemeMismatch(f"Unknown GGUF type {gguf_type!r}.",
                                 f"Choose one of: {', '.join(PRESETS)}, auto.")
        if not self.auto and (target_bpw is not None or target_size is not None):
            flag = "--target-bpw" if target_bpw is not None else "--target-size"
            raise SchemeMismatch(f"{flag} sets the size budget of --gguf-type auto; --gguf-type "
                                 f"{key} has a fixed mix.",
                                 f"Pass --gguf-type auto with {flag}, or drop {flag}.")
        self.budget = None
        if self.auto:
            from quantkit.methods.gguf_auto import Budget

            self.budget = Budget(target_bpw, target_size)
            if rounding == "gptq":
                raise SchemeMismatch(
                    "--gguf-type auto with --rounding gptq is not built: auto chooses the types "
                    "after every block has been measured, and GPTQ needs each tensor's type while "
                    "its block is quantized.",
                    "Drop --rounding gptq (auto rounds with llama.cpp's imatrix encoders), or pick "
                    "a fixed --gguf-type for GPTQ.")
            if imatrix is None or imatrix is False:
                imatrix = "calib"  # sensitivity is weighted by the activations: always measured
            key = AUTO_BASE
        self.preset = PRESETS[key]
        self.collect = imatrix is True or (isinstance(imatrix, str) and imatrix.lower() == "calib")
        self.imatrix_path = None if (self.collect or not imatrix) else Path(imatrix)
        self.imatrix_out = Path(imatrix_out) if imatrix_out else None
        self.imatrix_dataset = imatrix_dataset
        if self.imatrix_out and not self.collect:
            raise SchemeMismatch("imatrix_out needs an imatrix collected from calibration data.",
                                 "Pass --calib (imatrix='calib') together with the output path.")
        if self.collect and not self.preset.quantized:
            raise SchemeMismatch(f"{key} is an unquantized export; an imatrix has no use there.")
        if rounding not in ("rtn", "gptq"):
            raise SchemeMismatch(f"Unknown GGUF rounding {rounding!r}.",
                                 "Choose rtn (llama.cpp's own) or gptq (error feedback).")
        if rounding == "gptq" and not self.preset.quantized:
            raise SchemeMismatch(f"{key} is an unquantized export; GPTQ rounding has no use there.",
                                 "Pick a quantized --gguf-type such as q4_k_m.")
        if v_hessian != "tokens" and rounding != "gptq":
            raise SchemeMismatch(f"v_hessian={v_hessian!r} is read only by GPTQ rounding.",
                                 "Pass --rounding gptq, or drop --gptq-v-hessian.")
        if damp < 0:
            raise SchemeMismatch(f"GPTQ damp must be >= 0, got {damp}.", "The usual value is 0.01.")
        self.gptq, self.damp = rounding == "gptq", float(damp)
        self.stats: tuple[str, ...] = (("sq_mean",) if self.collect else ()) + (
            ("hessian",) if self.gptq else ())
        # auto also runs blocks on calibration inputs for the block-output gains
        self.needs_calibration = bool(self.stats) or (self.auto and int(gain_batches) > 0)
        if self.gptq:  # as --method gptq: later Linears calibrate on the quantized outputs
            self.propagate_quantized = True
            self.true_sequential = True
        self.plans: dict[str, TensorPlan] = {}
        self.spec = None
        self.imatrix: dict[str, torch.Tensor] = {}
        # GGUF name -> (sum of x^2 per column, tokens); expert tensors: ([E, K], [count per expert])
        self.collected: dict[str, tuple[torch.Tensor, int | list[int]]] = {}
        self.n_expert = 0
        self.chunks = (0, 0)
        self.type_name = "auto" if self.auto else self.preset.name
        # auto: GGUF name -> (HF module name, kept options, their bytes, bias) until the solve
        self.measured: dict[str, tuple[str, list, dict[str, torch.Tensor], torch.Tensor | None]] = {}
        self.auto_shapes: dict[str, tuple[int, ...]] = {}
        self.fixed_shapes: dict[str, tuple[int, ...]] = {}
        self.file_overhead_bytes = 0  # auto --target-size: what the writer adds (set by the pipeline)
        self.allocation: dict | None = None  # auto: the solve, recorded in the file's metadata
        self._seconds: dict[str, float] = {}
        self._rel_error: dict[str, dict[str, float]] = {}
        # auto: calibration batches each tensor's block-output gain is measured on (0: off,
        # the imatrix cost alone); the gains found, by GGUF name
        self.gain_batches = int(gain_batches)
        self.gains: dict[str, float] = {}
        # auto also chooses token_embd / output: the head's input is the final norm's output
        self.reads_final_norm = self.auto
        self.n_layer = 0
        self._embd_counts: torch.Tensor | None = None  # calibration token counts [vocab]
        self._embd_delta: list[torch.Tensor] | None = None  # token_embd's error on the gain batches
        self._final_hidden: torch.Tensor | None = None  # last block's float outputs [tokens, H]
        self._final_delta: torch.Tensor | None = None  # their error, last block at its references
        self._outside: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # weight, imatrix
        self._outside_gains: dict[str, dict[str, float | str]] = {}

    # ------------------------------------------------------------------ before any data
    def check(self, scheme: QuantScheme) -> None:
        if scheme.kind != "kquant":
            raise SchemeMismatch(f"--method gguf needs a kquant scheme, not {scheme.kind!r}.")
        if scheme.gguf_type and scheme.gguf_type.lower() != self.type_name:
            raise SchemeMismatch(f"Scheme gguf_type {scheme.gguf_type!r} disagrees with method "
                                 f"option gguf_type {self.type_name!r}.")
        if self.preset.quantized and not torch.cuda.is_available():
            preload_compiled(self._possible_types())  # CPU encoders load while the model opens

    def _possible_types(self) -> set[Q]:
        """Every type this preset can write: its rules, output/embeddings, row-width fallbacks."""
        p = self.preset
        types = {p.base, p.output, Q.Q8_0} | {t for r in p.rules for t in r.types}
        types |= {p.attn_output_8_experts, p.token_embd} - {None}
        if self.auto:
            from quantkit.methods.gguf_auto import AUTO_CANDIDATES, NARROW_EXTRA

            types |= set(AUTO_CANDIDATES) | set(NARROW_EXTRA)
        return types | {FALLBACK[t] for t in types if t in FALLBACK}

    def prepare(self, config, spec, shapes: dict[str, tuple[int, int]]) -> None:
        """Fix every tensor's type from the config alone and validate the imatrix file."""
        self.spec = spec
        self._config_dict = config if isinstance(config, dict) else config.to_dict()
        get = (lambda k: getattr(config, k, None)) if not isinstance(config, dict) else config.get
        vocab, hidden = get("vocab_size"), get("hidden_size")
        tensors = {"token_embd.weight": (vocab, hidden)}
        if not get("tie_word_embeddings"):
            tensors["output.weight"] = (vocab, hidden)
        for full, shape_of in spec.gguf_outer_embeds:
            if shape_of(get) is not None:
                tensors[gguf_linear_name(spec, full)] = tuple(shape_of(get))
        for full, shape in shapes.items():
            rel = full[len(spec.block_path) + 1:].partition(".")[2]
            if spec.gguf_split(rel):  # llama.cpp stores it as pieces (per head, or its rows)
                self._plan_head_pieces(spec, full, rel, shape, config, tensors)
                continue
            gname = gguf_linear_name(spec, full)
            if gname is None:
                raise SchemeMismatch(f"{full} has no GGUF name for architecture {spec.name}.")
            tensors[gname] = tuple(shape)
        n_head = get("num_attention_heads") or 1
        self.n_layer = int(get("num_hidden_layers"))
        n_expert = spec.experts.count(config) if spec.experts is not None else 0
        self.n_expert = n_expert  # an imatrix entry of a 3-D expert tensor has n_expert vectors
        # llama.cpp counts every block of the file, the nextn (MTP) blocks too
        self.plans = plan_types(self.preset, tensors, spec.gguf_block_count(config),
                                is_70b=spec.gguf_is_70b(config),
                                has_imatrix=self.collect or self.imatrix_path is not None,
                                n_gqa=n_head // (get("num_key_value_heads") or n_head),
                                n_expert=n_expert)
        groups: dict[str, list[str]] = {}
        for name, plan in sorted(self.plans.items(), key=lambda kv: (layer_of(kv[0]), kv[0])):
            if plan.note:
                log.info("%s: %s", name, plan.note)
                groups.setdefault(plan.note, []).append(name)
        for note, names in groups.items():  # per tensor: INFO here, quantkit.fallbacks in the file
            log.warning("%d tensors fall back %s, e.g. %s", len(names), note, names[0])
        needy = sorted((n for n, pl in self.plans.items() if pl.qtype in self.preset.needs_imatrix
                        and n not in ("token_embd.weight", "output.weight")), key=lambda n: (layer_of(n), n))
        if needy and not (self.collect or self.imatrix_path is not None):
            raise SchemeMismatch(
                f"--gguf-type {self.preset.name} needs an importance matrix: llama.cpp refuses to "
                f"write {'/'.join(sorted({self.plans[n].qtype.name for n in needy}))} tensors without "
                f"one ({len(needy)} here, e.g. {needy[0]}).",
                "Pass --imatrix FILE (llama-imatrix's output) or --calib SET to collect one, or "
                "pick a type that works without, such as q3_k_m or iq4_xs.")
        if self.imatrix_path is not None:
            self.imatrix = self._checked_imatrix(load_imatrix(self.imatrix_path), tensors)
            missing = [n for n in needy if n not in self.imatrix]
            if missing:  # llama-quantize: "Missing importance matrix for tensor ..."
                raise SchemeMismatch(
                    f"imatrix {self.imatrix_path} has no entry for {missing[0]} ({len(missing)} "
                    f"tensors), and its type {self.plans[missing[0]].qtype.name} needs one.",
                    "Use an imatrix computed for this whole model (llama-imatrix or --calib).")
        reordered = sorted(n for n in tensors if self._order(spec, n) != (None, None))
        if self.auto and reordered:
            raise SchemeMismatch(
                f"--gguf-type auto is not built for tensors llama.cpp's converter permutes "
                f"({len(reordered)} here, e.g. {reordered[0]}: {spec.gguf_arch}'s value-head order).",
                "Pick a fixed --gguf-type (e.g. q4_k_m) for this model.")
        if self.auto:
            self._prepare_auto(tensors)

    def _order(self, spec, gname: str | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(rows, cols) the converter permutes GGUF tensor `gname` by (ArchSpec.gguf_order):
        the weight is rounded in that order, and imatrix / Hessian columns follow it."""
        order = getattr(spec, "gguf_order", None)
        if order is None or gname is None:
            return None, None
        return order(gname, self._config_dict)

    @staticmethod
    def _to_gguf_order(w: torch.Tensor, rows, cols) -> torch.Tensor:
        if rows is not None:
            w = w.index_select(0, rows.to(w.device))
        return w if cols is None else w.index_select(1, cols.to(w.device))

    @staticmethod
    def _to_hf_order(w: torch.Tensor, rows, cols) -> torch.Tensor:
        """The inverse of _to_gguf_order (a dequantized weight back into the model's order)."""
        if rows is not None:
            w = w.index_select(0, torch.argsort(rows).to(w.device))
        return w if cols is None else w.index_select(1, torch.argsort(cols).to(w.device))

    def _prepare_auto(self, tensors: dict[str, tuple[int, ...]]) -> None:
        """Which tensors auto chooses (every weight matrix: block Linears, token_embd, output)
        and the budget they share, checked against what the candidates can make before any
        data is read."""
        from quantkit.methods.gguf_auto import candidate_types, tensor_bytes

        if self.n_expert:
            raise SchemeMismatch("--gguf-type auto is not built for mixture-of-experts models yet.",
                                 "Pick a fixed --gguf-type (e.g. q4_k_m) for this model.")
        self.auto_shapes = {n: s for n, s in tensors.items() if n in self.plans}
        self.fixed_shapes = {n: tensors[n] for n in self.plans if n not in self.auto_shapes}
        self.matrix_params = sum(math.prod(s) for n, s in tensors.items() if n in self.plans)
        self.fixed_bytes = sum(tensor_bytes(self.plans[n].qtype, s) for n, s in self.fixed_shapes.items())
        sizes = {n: [tensor_bytes(t, s) for t in candidate_types(s, FALLBACK)]
                 for n, s in self.auto_shapes.items()}
        self.auto_budget = self.budget.check(sizes, self.matrix_params, self.fixed_bytes,
                                             self.file_overhead_bytes)

    def _plan_head_pieces(self, spec, full: str, rel: str, shape: tuple[int, int], config,
                          tensors: dict[str, tuple]) -> None:
        """The pieces of a split Linear (DeepSeek's kv_b_proj -> per-head attn_k_b, attn_v_b;
        Qwen3-Next's in_proj_qkvz -> the rows of attn_qkv, attn_gate), planned by their own
        GGUF names and shapes."""
        bases = spec.split_bases(rel, config)
        if self.preset.quantized and (self.collect or self.imatrix_path is not None or self.gptq):
            raise SchemeMismatch(
                f"{full} is stored as pieces ({', '.join(b.rpartition('.')[2] for b in bases)}) "
                f"in GGUF architecture {spec.gguf_arch}; quantkit quantizes them with llama.cpp's "
                "plain rounding only, not with an imatrix or GPTQ rounding yet.",
                "Drop --imatrix / --calib and --rounding gptq for this model.")
        bid = int(full[len(spec.block_path) + 1:].partition(".")[0])
        self.config = config
        probe = torch.empty(shape, device="meta")
        for base, piece in spec.split_pieces(rel, probe, config):
            tensors[base.format(bid=bid) + ".weight"] = tuple(piece.shape)

    def _checked_imatrix(self, data: ImatrixData, tensors: dict[str, tuple]) -> dict[str, torch.Tensor]:
        """Names and widths must match the model; missing entries fall back to no imatrix."""
        ours = {n for n in tensors if n.startswith("blk.")}
        hits = ours & set(data.values)
        if not hits:
            raise SchemeMismatch(
                f"imatrix {self.imatrix_path} has no entry for any tensor of this model "
                f"(it has e.g. {sorted(data.values)[:3]}; the model has e.g. {sorted(ours)[:3]}).",
                "Use an imatrix computed for this model (llama-imatrix or --calib).")
        for name in sorted(hits | ({"output.weight"} & set(data.values) & set(tensors))):
            # a 3-D expert tensor: one importance vector per expert (llama-quantize's check)
            n_mat = self.n_expert if name.endswith("_exps.weight") else 1
            if data.values[name].numel() != tensors[name][-1] * n_mat:
                per = f" x {n_mat} experts" if n_mat > 1 else ""
                raise SchemeMismatch(
                    f"imatrix entry {name} has {data.values[name].numel()} values but the tensor "
                    f"has {tensors[name][-1]} input columns{per}.", "The imatrix is for another model.")
        missing = sorted(ours - hits)
        if missing:
            log.warning("imatrix has no entry for %d tensors (e.g. %s); they use the plain "
                        "reference quantization", len(missing), missing[0])
        return {n: v for n, v in data.values.items() if n in tensors}

    # ------------------------------------------------------------------ per block
    def quantize_block(self, ctx: BlockContext) -> dict[str, QuantResult]:
        if not self.preset.quantized:
            return {}  # f16/bf16 export: the writer stores the dense weights
        spec = ctx.arch if ctx.arch is not None else self.spec
        results = {}
        self._imatrix_rows: dict[str, torch.Tensor | None] = {}
        experts: dict[str, dict[int, tuple[torch.Tensor, int]]] = {}
        for name, linear in ctx.linears.items():
            gname = gguf_linear_name(spec, f"{spec.block_path}.{ctx.index}.{name}")
            slot = spec.gguf_slot(name)
            expert = slot[1] if slot else None
            qw = self.imatrix.get(gname)
            if qw is not None and expert is not None:  # this expert's slice of the 3-D entry
                k = linear.weight.shape[1]
                qw = qw[expert * k:(expert + 1) * k]
            stat = ctx.stats.get(name, {})
            if self.collect and expert is not None:  # an expert the router never fed has no stat
                count = int(stat.get("tokens") or 0) if "sq_mean" in stat else 0
                sums = stat["sq_mean"].float().detach().cpu() if count else \
                    torch.zeros(linear.weight.shape[1])
                experts.setdefault(gname, {})[expert] = (sums, count)
                # llama-quantize's reading of the saved file: in_sum2 / counts, or 1 in every
                # column for an expert that got no token
                qw = sums / float(count) if count else torch.ones_like(sums)
            elif self.collect and "sq_mean" in stat and stat.get("tokens"):
                sums, count = stat["sq_mean"].float(), int(stat["tokens"])
                cols = self._order(spec, gname)[1]
                if cols is not None:  # llama-imatrix sees the converter's column order
                    sums = sums.index_select(0, cols.to(sums.device))
                self.collected[gname] = (sums.detach().cpu(), count)
                qw = sums / float(count)  # llama.cpp: in_sum2 / counts, in float32
                self.chunks = (max(self.chunks[0], len(ctx.inputs)),
                               count // max(1, len(ctx.inputs)))
            if spec.gguf_split(name):
                results[name] = self._quantize_head_pieces(spec, ctx.index, name, linear.weight.data)
                continue
            if self.gptq:
                self._imatrix_rows[name] = qw
                continue
            if self.auto:
                results[name] = self._measure(name, gname, linear, qw)
                continue
            results[name] = self._quantize(name, gname, linear.weight.data, qw, linear.bias)
        if self.gptq:
            results = self._gptq_block(ctx, spec)
        if self.auto and self.gain_batches and ctx.inputs:
            self._block_gains(ctx, spec)
        elif self.auto and ctx.inputs and ctx.index == self.n_layer - 1:  # the head's input
            self._final_hidden = torch.cat([o.reshape(-1, o.shape[-1]).float().cpu()
                                            for o in ctx.rerun(1)])
        for gname, parts in experts.items():  # one imatrix entry per 3-D tensor, expert-major
            order = sorted(parts)
            self.collected[gname] = (torch.stack([parts[e][0] for e in order]),
                                     [parts[e][1] for e in order])
        return results

    def _quantize(self, name: str, gname: str, w: torch.Tensor, qw, bias=None) -> QuantResult:
        t0 = time.perf_counter()
        plan = self.plans.get(gname)
        if plan is None:
            raise SchemeMismatch(f"No GGUF type planned for {gname}; call prepare() first.")
        # the converter's row / column order (qw, an imatrix entry, is in it already)
        w32 = self._to_gguf_order(w.detach().float(), *self._order(self.spec, gname))
        data, sq_err = quantize_tensor(w32, plan.qtype, qw, errors=True)
        err = float(sq_err.sum().sqrt() / w32.norm().double().clamp_min(1e-30))
        scheme = QuantScheme(kind="kquant", bits=0, group_size=block_size(plan.qtype),
                             gguf_type=plan.qtype.name.lower())
        n, k = w32.shape
        return QuantResult(
            name=name, scheme=scheme,
            codes=torch.zeros((), dtype=torch.uint8).expand(n, k),  # codes live packed in gguf_bytes
            scale=torch.empty(0),
            bias=None if bias is None else bias.detach().clone(),
            extra={"gguf_bytes": data.cpu(), "gguf_type": torch.tensor(int(plan.qtype)),
                   "gguf_wanted_type": torch.tensor(int(plan.wanted))},
            loss=err, seconds=time.perf_counter() - t0)

    def _quantize_head_pieces(self, spec, index: int, name: str, w: torch.Tensor) -> QuantResult:
        """One result for a split Linear: each piece's rows ((heads x) rows) encoded with
        that piece's planned type, under extra "gguf_piece{i}_*" (formats/gguf.py writes each
        as its own tensor, 3-D per head or 2-D); the error is over the whole weight."""
        t0 = time.perf_counter()
        extra, sq, total = {}, 0.0, 0.0
        for i, (base, piece) in enumerate(spec.split_pieces(name, w.detach().float(), self.config)):
            plan = self.plans[base.format(bid=index) + ".weight"]
            data, sq_err = quantize_tensor(piece.reshape(-1, piece.shape[-1]), plan.qtype, None,
                                           errors=True)
            extra.update({f"gguf_piece{i}_bytes": data.cpu().reshape(*piece.shape[:-1], -1),
                          f"gguf_piece{i}_type": torch.tensor(int(plan.qtype)),
                          f"gguf_piece{i}_wanted_type": torch.tensor(int(plan.wanted))})
            sq, total = sq + float(sq_err.sum()), total + float(piece.double().square().sum())
        n, k = w.shape
        return QuantResult(
            name=name, scheme=QuantScheme(kind="kquant", bits=0, group_size=0,
                                          gguf_type=self.preset.name),
            codes=torch.zeros((), dtype=torch.uint8).expand(n, k), scale=torch.empty(0),
            extra=extra, loss=(sq / max(total, 1e-30)) ** 0.5, seconds=time.perf_counter() - t0)

    def _gptq_block(self, ctx: BlockContext, spec) -> dict[str, QuantResult]:
        """Every Linear of the block through GPTQ onto its planned GGML grid (one H^-1 factor
        per set of Linears that read the same input); types without a grid, experts and
        Linears that saw no token keep llama.cpp's own encoding, and their result says so."""
        from quantkit.methods.gguf_gptq import GPTQ_GRIDS, gptq_ggml, grid_block, hessian_factor
        from quantkit.methods.gptq import shared_input_sets

        results: dict[str, QuantResult] = {}
        solvable = []
        for name, linear in ctx.linears.items():
            gname = gguf_linear_name(spec, f"{spec.block_path}.{ctx.index}.{name}")
            plan = self.plans.get(gname)
            st = ctx.stats.get(name) or {}
            why = None
            if plan is None or plan.qtype not in GPTQ_GRIDS:
                t = plan.qtype.name if plan else "?"
                why = f"rtn: no GPTQ grid for {t} yet (llama.cpp's encoder)"
            elif spec.gguf_slot(name) and spec.gguf_slot(name)[1] is not None:
                why = "rtn: experts are not solved with GPTQ yet (llama.cpp's encoder)"
            elif not st.get("tokens") or "hessian" not in st:
                why = "rtn: no calibration token reached this Linear (llama.cpp's encoder)"
            elif linear.weight.shape[1] % grid_block(plan.qtype):
                why = f"rtn: row width not a multiple of {grid_block(plan.qtype)}"
            if why is None:
                solvable.append(name)
                continue
            log.warning("%s: %s", gname, why)
            res = self._quantize(name, gname, linear.weight.data, self._imatrix_rows.get(name), linear.bias)
            res.fallback = why
            res.extra["dequantized"] = self._to_hf_order(
                dequantize_tensor(res.extra["gguf_bytes"], int(res.extra["gguf_type"])),
                *self._order(spec, gname))
            results[name] = res
        for names in shared_input_sets(ctx, solvable):
            t0 = time.perf_counter()
            hessian = ctx.stats[names[0]]["hessian"]
            # Linears that read one input share its column order (the converter permutes
            # ssm_out's columns: its Hessian is solved in that order)
            orders = [self._order(spec, gguf_linear_name(spec, f"{spec.block_path}.{ctx.index}.{n}"))[1]
                      for n in names]
            if any((o is None) != (orders[0] is None) or (o is not None and not torch.equal(o, orders[0]))
                   for o in orders):
                raise SchemeMismatch(f"{names} read one input but llama.cpp's converter orders "
                                     "their columns differently; GPTQ cannot share their Hessian.")
            if orders[0] is not None:
                cols = orders[0].to(hessian.device)
                hessian = hessian.index_select(0, cols).index_select(1, cols)
            label = f"{spec.block_path}.{ctx.index}." + "+".join(names)
            hinv, diag = hessian_factor(hessian, self.damp, label)
            for n in names:
                del ctx.stats[n]["hessian"]
            del hessian
            share = (time.perf_counter() - t0) / len(names)
            for n in names:
                t1 = time.perf_counter()
                linear = ctx.linears[n]
                gname = gguf_linear_name(spec, f"{spec.block_path}.{ctx.index}.{n}")
                qtype = self.plans[gname].qtype
                qw = self._imatrix_rows.get(n)
                order = self._order(spec, gname)  # rounded in the converter's order
                w32 = self._to_gguf_order(linear.weight.data.detach().float().cpu(), *order)
                data, deq = gptq_ggml(w32, hinv, qtype, diag if qw is None else qw.float().cpu())
                res = self._result(n, qtype, self.plans[gname].wanted, data, linear.bias,
                                   float((deq - w32).norm() / w32.norm().clamp_min(1e-30)))
                res.extra["dequantized"] = self._to_hf_order(deq, *order)
                res.seconds = share + time.perf_counter() - t1
                results[n] = res
        return {n: results[n] for n in ctx.linears if n in results}

    @staticmethod
    def _result(name: str, qtype: Q, wanted: Q, data: torch.Tensor, bias, err: float) -> QuantResult:
        n = data.shape[0]
        k = data.shape[1] // type_size(qtype) * block_size(qtype)
        scheme = QuantScheme(kind="kquant", bits=0, group_size=block_size(qtype),
                             gguf_type=qtype.name.lower())
        return QuantResult(
            name=name, scheme=scheme,
            codes=torch.zeros((), dtype=torch.uint8).expand(n, k),  # codes live packed in gguf_bytes
            scale=torch.empty(0),
            bias=None if bias is None else bias.detach().clone(),
            extra={"gguf_bytes": data.cpu(), "gguf_type": torch.tensor(int(qtype)),
                   "gguf_wanted_type": torch.tensor(int(wanted))},
            loss=err)

    def _measure(self, name: str, gname: str, linear: torch.nn.Linear, qw) -> QuantResult:
        """auto: the tensor at every candidate type (bytes kept for the hull's options, cost =
        imatrix-weighted squared error); a stand-in result of the smallest option until the
        solve in quantize_rest picks the one written."""
        from quantkit.methods.gguf_auto import candidate_types, measure_options

        t0 = time.perf_counter()
        w = linear.weight.data
        options, data, rel = measure_options(
            w, candidate_types(tuple(w.shape), FALLBACK), qw,
            lambda x, t, imp: quantize_tensor(x, t, imp), dequantize_tensor)
        bias = None if linear.bias is None else linear.bias.detach().cpu().clone()
        self.measured[gname] = (name, options, {k: v.cpu() for k, v in data.items()}, bias)
        self._rel_error[gname] = rel
        self._seconds[gname] = time.perf_counter() - t0
        first = Q[options[0].label]
        res = self._result(name, first, first, data[first.name], linear.bias, rel[first.name])
        res.seconds = self._seconds[gname]
        return res

    def _block_gains(self, ctx: BlockContext, spec) -> None:
        """Scale each tensor's costs to the block's output: quantize that tensor alone at its
        option nearest 4.5 bits, run the block on the first `gain_batches` calibration batches
        and divide the squared block-output error per token by the tensor's own cost there.

        The imatrix cost is a layer's output error; how much of it reaches the block's output
        differs by tensor (q/k pass through the softmax, v/o/down add to the residual, gate/up
        pass through down_proj), which one forward per tensor measures. The ratio is assumed
        the same at every type (small perturbations: linear). The scaled cost is in block-output
        units whatever the imatrix's scale, so tensors without an imatrix entry compare too."""
        reference = ctx.rerun(self.gain_batches)
        tokens = sum(o.shape[0] * o.shape[1] if o.dim() == 3 else o.shape[0] for o in reference)
        refs: dict[str, str] = {}
        for name, linear in ctx.linears.items():
            gname = gguf_linear_name(spec, f"{spec.block_path}.{ctx.index}.{name}")
            hf_name, opts, data, bias = self.measured[gname]
            k = linear.weight.shape[1]
            ref = min(opts, key=lambda o: abs(8 * o.nbytes / (linear.weight.numel()) - 4.5))
            refs[name] = ref.label
            saved = linear.weight.data.clone()
            deq = dequantize_tensor(data[ref.label], Q[ref.label]).reshape(-1, k)
            linear.weight.data.copy_(deq.to(linear.weight.device, linear.weight.dtype))
            out = ctx.rerun(self.gain_batches)
            linear.weight.data.copy_(saved)
            err = sum(float((o.double() - r.double()).square().sum()) for o, r in zip(out, reference, strict=True))
            gain = (err / max(tokens, 1)) / ref.cost if ref.cost > 0 else 1.0
            self.gains[gname] = gain
            self.measured[gname] = (hf_name, [Option(o.label, o.nbytes, o.cost * gain) for o in opts],
                                    data, bias)
        if ctx.index == 0 and self._embd_delta:
            self._lookup_gain(ctx, reference)
        if ctx.index == self.n_layer - 1:
            self._head_inputs(ctx, spec, reference, refs)

    def _lookup_gain(self, ctx: BlockContext, reference: list[torch.Tensor]) -> None:
        """token_embd's gain: block 0 on its inputs plus token_embd's error at the ~4.5-bit
        reference (observe_embedding): squared block-output error per unit of squared input
        error. Its cost (squared input error per token) is then in the block tensors' units."""
        n = min(len(self._embd_delta), len(reference))
        hidden, in_err = [], 0.0
        for h, d in zip(ctx.inputs[:n], self._embd_delta[:n], strict=True):
            p = h + d.to(h.device, h.dtype)
            in_err += float((p.double() - h.double()).square().sum())
            hidden.append(p)
        out = ctx.rerun(n, hidden=hidden)
        err = sum(float((o.double() - r.double()).square().sum())
                  for o, r in zip(out, reference[:n], strict=True))
        if in_err > 0:
            self._outside_gains.setdefault("token_embd.weight", {})["lookup_gain"] = err / in_err
        self._embd_delta = None

    def _head_inputs(self, ctx: BlockContext, spec, reference: list[torch.Tensor],
                     refs: dict[str, str]) -> None:
        """The last block's outputs (the final norm's input, so the output head's) and their
        error with every tensor of the block at its reference option at once: a residual
        perturbation of known size, whose KLD through the head converts the head's own KLD
        into block-output units (quantize_rest)."""
        saved = {}
        for name, linear in ctx.linears.items():
            gname = gguf_linear_name(spec, f"{spec.block_path}.{ctx.index}.{name}")
            data = self.measured[gname][2]
            saved[name] = linear.weight.data.clone()
            deq = dequantize_tensor(data[refs[name]], Q[refs[name]]).reshape(linear.weight.shape)
            linear.weight.data.copy_(deq.to(linear.weight.device, linear.weight.dtype))
        try:
            out = ctx.rerun(self.gain_batches)
        finally:
            for name, linear in ctx.linears.items():
                linear.weight.data.copy_(saved[name])
        from quantkit.methods.gguf_auto import KLD_TOKENS

        flat = lambda ts: torch.cat([t.reshape(-1, t.shape[-1]).float().cpu() for t in ts])  # noqa: E731
        self._final_hidden = flat(reference)
        self._final_delta = (flat(out) - self._final_hidden)[:KLD_TOKENS]

    def observe_embedding(self, module: torch.nn.Module, batches: list[torch.Tensor]) -> None:
        """auto: how often calibration looks up each token_embd row (its row weights), and on
        the gain batches the error token_embd at its ~4.5-bit reference adds to block 0's
        inputs (measured against block 0's output in _block_gains). Called by the pipeline
        while the embedding table is loaded."""
        if not self.auto or "token_embd.weight" not in self.auto_shapes or not batches:
            return
        from quantkit.methods.gguf_auto import candidate_types, nearest_type

        w = module.weight.detach()
        ids = torch.cat([b.reshape(-1).cpu() for b in batches])
        self._embd_counts = torch.bincount(ids, minlength=w.shape[0]).double()
        if self.gain_batches <= 0:
            return
        shape = tuple(w.shape)
        ref = nearest_type(candidate_types(shape, FALLBACK), shape)
        heads = [b.cpu() for b in batches[:self.gain_batches]]
        used = torch.unique(torch.cat([b.reshape(-1) for b in heads]))
        rows = w[used.to(w.device)].float()
        err = dequantize_tensor(quantize_tensor(rows, ref), ref).to(rows.device) - rows
        # the embedding module's own output scale (Gemma: sqrt(hidden)), else 1
        scale = float(getattr(module, "embed_scale", 1.0))
        self._embd_delta = [(err[torch.searchsorted(used, b)] * scale).cpu() for b in heads]
        self._outside_gains.setdefault("token_embd.weight", {})["lookup_reference"] = ref.name

    def _measure_outside(self, model, spec, device) -> None:
        """auto: token_embd and output at every candidate type, costs in the block tensors' units.

        output (or token_embd when tied, which then serves both): cost = sum_j imatrix_j *
        sum_v (W_vj - W_t,vj)^2, the squared logit error per token, imatrix of the head's input
        (the final norm's output on the gain batches, or the imatrix file's entry); scaled by
        its KLD gain: (KLD of the logits with the head at its ~4.5-bit reference, per unit of
        the KLD that a measured squared residual error at the last block gives) / that cost.
        token_embd (a lookup, not a matmul): cost = E_token ||E_t[id] - E[id]||^2, rows weighted
        by calibration frequency (lookup_weights), scaled by block 0's measured gain.
        Costs from a row sample (sample_rows, plus every row calibration looked up)."""
        from quantkit.methods.gguf_auto import (
            candidate_types,
            lookup_weights,
            pareto,
            row_errors,
            sample_rows,
            tensor_bytes,
        )

        mods = dict(model.named_modules())
        head = "output.weight" if "output.weight" in self.auto_shapes else "token_embd.weight"
        norm = mods.get(spec.final_norm)
        x = None
        if self._final_hidden is not None and norm is not None:
            with torch.no_grad():
                x = norm(self._final_hidden.to(device, norm.weight.dtype)).float()
        imat = self.imatrix.get(head)
        if imat is None and x is not None:
            imat = x.double().square().mean(0).float()
        for gname, full in (("token_embd.weight", spec.embed), ("output.weight", spec.lm_head)):
            if gname not in self.auto_shapes:
                continue
            t0 = time.perf_counter()
            w = mods[full].weight.data.to(device)
            shape = tuple(w.shape)
            types = candidate_types(shape, FALLBACK)
            lookup, is_head = gname == "token_embd.weight", gname == head
            qw = imat.to(device) if is_head and imat is not None else None
            gains = self._outside_gains.setdefault(gname, {})
            data: dict[str, torch.Tensor] = {}
            if is_head and qw is not None and x is not None and self._final_delta is not None:
                ref, ref_bytes = self._head_gain(w, x, norm, qw, types, shape, gains)
                data[ref.name] = ref_bytes
            uniform = sample_rows(shape[0])
            rows = uniform
            if lookup and self._embd_counts is not None:
                rows = torch.unique(torch.cat([uniform, self._embd_counts.nonzero().flatten()]))
            errs = row_errors(w[rows.to(w.device)], types, qw,
                              lambda a, t, imp: quantize_tensor(a, t, imp), dequantize_tensor)
            in_uniform = torch.isin(rows, uniform)
            weights = lookup_weights(rows, uniform, self._embd_counts) if lookup else None
            options, rel = [], {}
            norm_u = math.sqrt(float(w[uniform.to(w.device)].double().square().sum())) or 1e-30
            for t, (plain, weighted) in errs.items():
                cost = 0.0
                if lookup:
                    cost += float(gains.get("lookup_gain", 1.0)) * float((weights * plain).sum())
                if is_head:
                    cost += float(gains.get("head_gain", 1.0)) * shape[0] * float(weighted[in_uniform].mean())
                options.append(Option(t.name, tensor_bytes(t, shape), cost))
                rel[t.name] = math.sqrt(float(plain[in_uniform].sum())) / norm_u
            kept = pareto(options)  # the solver tries each (OUTSIDE), so not only the hull
            labels = {o.label for o in kept}
            self.measured[gname] = (full, kept, {k: v.cpu() for k, v in data.items() if k in labels}, None)
            self._outside[gname] = (w, qw)
            self._rel_error[gname] = {k: v for k, v in rel.items() if k in labels}
            self._seconds[gname] = time.perf_counter() - t0
            gains["cost_rows"] = len(rows)

    def _head_gain(self, w: torch.Tensor, x: torch.Tensor, norm, qw: torch.Tensor, types: list[Q],
                   shape: tuple[int, ...], gains: dict) -> tuple[Q, torch.Tensor]:
        """The output head's factor from squared logit error to block-output units, measured:
        (KLD with the head at its ~6.5-bit reference / KLD per unit of squared residual error
        at the last block) / the head's cost at that reference. The reference is encoded whole
        (its bytes are kept: written as they are if chosen); ~6.5 bits (Q6_K) rather than the
        block tensors' 4.5 because the gain assumes small perturbations anyway and Q6_K's
        encoder is ~10x faster than Q4_K's with an imatrix (vocab-sized tensors)."""
        from quantkit.methods.gguf_auto import KLD_TOKENS, mean_klds, nearest_type

        ref = nearest_type(types, shape, 6.5)
        w32 = w.float()
        data = quantize_tensor(w32, ref, qw)
        wq = dequantize_tensor(data, ref).to(w32.device)
        cost = float(((wq - w32).double().square().sum(0) * qw.double().reshape(-1)).sum())
        n = self._final_delta.shape[0]
        xs = x[:n]
        with torch.no_grad():
            xd = norm((self._final_hidden[:n] + self._final_delta).to(x.device, norm.weight.dtype)).float()
        kld_residual, kld_head = mean_klds(xs, w32, [(xd, w32), (xs, wq)])
        residual_sq = float(self._final_delta.double().square().sum(1).mean())
        if kld_residual > 0 and residual_sq > 0 and cost > 0:
            gains["head_gain"] = kld_head / (kld_residual / residual_sq) / cost
        gains.update(head_reference=ref.name, head_kld=kld_head, residual_kld=kld_residual,
                     residual_sq_error=residual_sq, kld_tokens=int(min(n, KLD_TOKENS)))
        return ref, data

    def _solve_auto(self, spec) -> dict[str, QuantResult]:
        """Every weight matrix's type from the measured options under the budget; the results
        (block tensors: replacing the stand-ins; token_embd / output: encoded whole now at the
        chosen type), keyed by full module name."""
        from quantkit.methods.gguf_auto import OUTSIDE, allocate

        missing = sorted(set(self.auto_shapes) - set(self.measured))
        if missing:
            raise SchemeMismatch(f"auto measured no options for {missing[:3]}.")
        candidates = {g: opts for g, (_, opts, _, _) in self.measured.items()}
        chosen = allocate(candidates, self.auto_budget, whole=OUTSIDE)
        results, tensors = {}, {}
        for gname, option in chosen.items():
            name, opts, data, bias = self.measured[gname]
            qtype = Q[option.label]
            block = int(layer_of(gname))
            full = f"{spec.block_path}.{block}.{name}" if block >= 0 else name
            n = self.auto_shapes[gname]
            if option.label not in data:  # token_embd / output: only rows were measured
                w, qw = self._outside[gname]
                data = {option.label: quantize_tensor(w.float(), qtype, qw).cpu()}
            res = self._result(name if block >= 0 else full, qtype, qtype, data[option.label], bias,
                               self._rel_error[gname][option.label])
            res.seconds = self._seconds.get(gname)
            results[full] = res
            tensors[gname] = {"type": qtype.name, "bytes": option.nbytes, "shape": list(n),
                              "cost": option.cost,
                              **({"block_gain": self.gains[gname]} if gname in self.gains else {}),
                              **({"gains": self._outside_gains[gname]}
                                 if self._outside_gains.get(gname) else {}),
                              "options": {o.label: [o.nbytes, o.cost] for o in opts}}
        self.measured.clear()
        self._outside.clear()
        self._final_hidden = self._final_delta = None
        used = sum(t["bytes"] for t in tensors.values())
        matrix_bytes = used + self.fixed_bytes
        counts: dict[str, int] = {}
        for t in tensors.values():
            counts[t["type"]] = counts.get(t["type"], 0) + 1
        self.allocation = {
            "target": {"bits_per_weight": self.budget.target_bpw, "size_bytes": self.budget.target_size},
            "sensitivity": "sum_j imatrix_j * sum_i (W_ij - dequantized_ij)^2 (the squared layer "
                           "output error per calibration token, diagonal input covariance)"
                           + (f" x block_gain (squared block-output error / that cost, the tensor "
                              f"alone at its option nearest 4.5 bpw, first {self.gain_batches} "
                              f"calibration batches)" if self.gains else "")
                           + "; token_embd: E_token ||E_t[id] - E[id]||^2 (rows weighted "
                             "0.9 by calibration frequency + 0.1 uniform) x lookup_gain (block "
                             "0's squared output error per unit of that input error); output "
                             "(token_embd when tied): sum_j imatrix_j * sum_v (W - W_t)^2 (the "
                             "head input's imatrix) x head_gain (its KLD at the ~4.5-bit "
                             "reference in units of the KLD per squared residual error at the "
                             "last block, / its cost there); both from a row sample",
            "solver": "greedy on each tensor's lower convex hull of (bytes, cost), then leftover fill",
            "budget_bytes": self.auto_budget, "chosen_bytes": used,
            "fixed": {n: self.plans[n].qtype.name for n in self.fixed_shapes},
            "fixed_bytes": self.fixed_bytes, "file_overhead_bytes_estimate": self.file_overhead_bytes,
            "bits_per_weight_matrices": 8 * matrix_bytes / self.matrix_params,
            "type_counts": dict(sorted(counts.items())),
            "tensors": dict(sorted(tensors.items(), key=lambda kv: (layer_of(kv[0]), kv[0]))),
        }
        log.info("auto: %d tensors, %s, %.4f bpw over the weight matrices", len(tensors),
                 counts, self.allocation["bits_per_weight_matrices"])
        return results

    # ------------------------------------------------------------------ after the blocks
    def quantize_rest(self, model, spec) -> dict[str, QuantResult]:
        """token_embd (and output when untied), which live outside the decoder blocks."""
        results: dict[str, QuantResult] = {}
        if self.auto:
            self._measure_outside(model, spec, "cuda" if torch.cuda.is_available() else "cpu")
            results = self._solve_auto(spec)
        elif self.preset.quantized:
            mods = dict(model.named_modules())
            device = "cuda" if torch.cuda.is_available() else "cpu"
            for full in (spec.embed, spec.lm_head, *(m for m, _ in spec.gguf_outer_embeds)):
                gname = gguf_linear_name(spec, full)
                if gname not in self.plans or full not in mods:
                    continue
                w = mods[full].weight.data.to(device)
                results[full] = self._quantize(full, gname, w, self.imatrix.get(gname))
        if self.collect and self.imatrix_out is not None and self.collected:
            save_imatrix(self.imatrix_out, self.collected, datasets=[self.imatrix_dataset or "quantkit"],
                         chunk_count=self.chunks[0], chunk_size=self.chunks[1])
        return results


# ---------------------------------------------------------------- the method's record ----


def _gguf_request(v: FlagValues, options: dict) -> MethodRequest:
    gguf_type = v["gguf_type"]
    # --calib given explicitly (not --imatrix): collect the imatrix from that data
    calib_given = "calib" in v.given
    # GPTQ rounding: the Hessian's diagonal weights the scale search unless --imatrix is given
    gptq_rounding = v["rounding"] == "gptq"
    # auto weighs every tensor's error by the activations: it always has an imatrix
    auto = str(gguf_type or "").lower() == "auto"
    options.update(gguf_type=gguf_type or "q4_k_m",
                   imatrix=v["imatrix"] or ("calib" if (calib_given or auto) and not gptq_rounding
                                            else None))
    if v["target_bpw"] is not None:
        options["target_bpw"] = v["target_bpw"]
    if v["target_size"] is not None:
        options["target_size"] = parse_size(v["target_size"], "--target-size")
    if gptq_rounding:
        options["rounding"] = "gptq"
    auto_group = v["group_size"] is None  # recorded as asked; K-quants fix their own blocks
    scheme = QuantScheme(kind="kquant", bits=v["bits"],
                         group_size=QuantScheme().group_size if auto_group else v["group_size"],
                         symmetric=v["sym"], act_order=v["act_order"], gguf_type=gguf_type)
    return MethodRequest(scheme, options, auto_group, v["fmt"])


def _check_gguf_flags(v: FlagValues) -> None:
    check_gptq_rounding_flags("gguf", v)
    calib, given, imatrix, rounding = v.calib, v.given, v["imatrix"], v.rounding
    auto = str(v["gguf_type"] or "").lower() == "auto"
    if calib and imatrix and rounding != "gptq" and not auto:
        raise QuantkitError(
            f"--imatrix {imatrix} and {calib[0]} both give the importance matrix: one is read "
            "from the file, the other collected from calibration data.",
            f"Drop {calib[0]} to use the file, or drop --imatrix to collect one.")
    for flag in ("target_bpw", "target_size"):
        if flag in given and not auto:
            raise QuantkitError(f"{given[flag]} sets the size budget of --gguf-type auto; "
                                 f"--gguf-type {v['gguf_type'] or 'q4_k_m'} has a "
                                 "fixed mix.", f"Pass --gguf-type auto, or drop {given[flag]}.")
    if auto and not ({"target_bpw", "target_size"} & set(given)):
        raise QuantkitError("--gguf-type auto needs a size budget.",
                             "Pass --target-bpw (e.g. 4.5) or --target-size (e.g. 80MB).")
    if auto and {"target_bpw", "target_size"} <= set(given):
        raise QuantkitError("--target-bpw and --target-size both set the budget of --gguf-type "
                             "auto.", "Pass one of them.")
    if calib and "calib" not in given and rounding != "gptq" and not auto:
        raise QuantkitError(
            f"{calib[0]} shapes the importance matrix that --method gguf collects only when "
            "--calib names the data.", f"Pass --calib SET (e.g. --calib mixed), or drop {calib[0]}.")


def _gguf_args(req) -> list[str]:
    o = req.method_options
    args = ["--gguf-type", str(o.get("gguf_type") or req.scheme.gguf_type)]
    for key in ("target_bpw", "target_size"):
        if o.get(key) is not None:
            args += ["--" + key.replace("_", "-"), str(o[key])]
    return args + rounding_args(req)


def _gguf_imatrix_arg(req) -> list[str]:
    imatrix = req.method_options.get("imatrix")
    return ["--imatrix", imatrix] if isinstance(imatrix, str) and imatrix != "calib" else []


def _gguf_reads_calibration(options: dict) -> bool:
    return options.get("imatrix") in ("calib", True) or options.get("rounding") == "gptq" or (
        options.get("gguf_type") == "auto" and options.get("gain_batches", 2) > 0)


def _nominal_bpw(scheme: QuantScheme, default: float) -> float:
    return bits_per_weight(str(scheme.gguf_type or "q4_k_m"), default)


def _gguf_disk(f: PlanFacts) -> int:
    return int(f.quantized * _nominal_bpw(f.scheme, 5.0) / 8 + f.outside * 2)


def _gguf_write(f: PlanFacts) -> int:
    """The writer stacks one block's experts into a 3-D tensor."""
    if not f.moe:
        return 0
    experts = [n * k for lin in f.linears for name, (n, k) in lin.items()
               if f.spec.is_expert_linear(name)]
    return int(f.spec.experts.count(f.config) * max(experts, default=0)
               * _nominal_bpw(f.scheme, 16.0) / 8)


RECORDS = (MethodRecord(
    name="gguf", quantizer=GGUFQuantizer, build=_gguf_request, check_flags=_check_gguf_flags,
    command_args=_gguf_args, command_tail=_gguf_imatrix_arg,
    reads_calibration=_gguf_reads_calibration, native_format="gguf",
    native_format_refusal=("--method gguf writes GGUF files; --format compressed-tensors cannot "
                           "hold K-quants.", "Drop --format, or pass --format gguf."),
    # K-quants need no statistics; an imatrix is gathered per expert (sq_mean)
    kv_cache_calibrates=False, plan_passes=1, plan_stats=lambda f: 2 * f.block_params * 4,
    plan_disk=_gguf_disk, plan_write=_gguf_write),)
