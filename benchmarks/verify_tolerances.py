"""The tolerances of `quantkit verify`, measured on good artifacts.

Quantizes good artifacts (SmolLM2 RTN int4 in vLLM; on a tiny Llama: RTN / GPTQ / AWQ int4
compressed-tensors, GPTQ act-order, per-channel, int8 weight-only, GPTQ v1, AutoAWQ
GEMM, NVFP4 and MXFP4 in vLLM where it runs them on this CPU; int8 W8A8 and FP8 dynamic
(fidelity only); the tests' tiny Qwen3-MoE (RTN / GPTQ int4, FP8 128-blocks) and the hybrid
Qwen3-Next (Gated DeltaNet + MoE), RTN / GPTQ int4, in
vLLM where it runs their experts (int4 fused-MoE CPU kernel: AMX); GGUF Q8_0, Q6_K-bearing
Q4_K_M, Q5_K_M, Q4_0, Q3_K_M, Q2_K, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S / IQ2_M, IQ3_XXS, IQ3_S,
Q5_0 and Q4_1 in llama.cpp, and Q4_K_M of the tiny Qwen3-MoE, Qwen3-Next and Granite 4
hybrid; RTN / GPTQ int4, NVFP4 and MXFP4 as MLX checkpoints in mlx-lm,
SmolLM2 RTN int4 and NVFP4 among them), runs
verify on each with the bounds disabled, and writes
  benchmarks/results/verify_tolerances.json   every measurement + the tolerances
  quantkit/verify/tolerances.json             the tolerances verify applies
Bounds: relative RMSE per type 2x the worst measured (dense: 0.01, bf16 rounding is
~0.002); parity per engine:kind:dtype mean KLD 3x the worst measured, top-1 agreement the
lowest measured minus 0.05; the dense vectors of AWQ / SmoothQuant artifacts (norm weights
divided by the smoothing scales) have their own key, dense:folded, 2x the worst measured.
Usage: python benchmarks/verify_tolerances.py [WORKDIR] [--only LABEL ...]: `--only`
re-measures those rows and keeps the others from the last results file; `--from-results`
re-derives the bounds from the last results file without re-measuring.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_models import make_tiny_model  # noqa: E402

from quantkit.methods.fp4 import fp4_scheme  # noqa: E402
from quantkit.methods.fp8 import fp8_scheme  # noqa: E402
from quantkit.methods.int8 import int8_scheme  # noqa: E402
from quantkit.pipeline.quantize import QuantizeRequest, quantize  # noqa: E402
from quantkit.types import QuantScheme  # noqa: E402
from quantkit.verify import tensors as verify_tensors  # noqa: E402
from quantkit.verify import verify  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "verify_tolerances.json"


def _artifacts(work: Path, only: list[str]) -> list[tuple[str, Path, str, bool]]:
    """(label, path, engine, run the engine); `only`: just these labels (all when empty)."""
    tiny = make_tiny_model(work / "tiny", "llama") if not (work / "tiny").exists() else work / "tiny"
    g = QuantScheme(bits=4, group_size=64)

    def tiny_moe() -> Path:  # the tests' tiny Qwen3-MoE (hidden 256, 8 experts of 256, top-2)
        path = work / "tiny-moe"
        return path if path.exists() else make_tiny_model(path, "qwen3_moe")

    def family(name: str) -> Path:  # a hybrid family's tiny model, as tests/ builds it
        from discovered_families import FAMILIES, make_model

        f, path = FAMILIES[name], work / name
        return path if path.exists() else make_model(path, f.config_cls, f.model_cls,
                                                     f.settings, f.tied)
    calib = dict(calib_samples=8, calib_seqlen=64)
    imatrix = dict(calib="mixed", **calib)  # the IQ types' importance matrix, collected
    moe_plans = [  # models built only when their rows are asked for
        ("tiny moe rtn int4 g64", tiny_moe, dict(method="rtn", scheme=g)),
        ("tiny moe gptq int4 g64", tiny_moe, dict(method="gptq", scheme=g, **calib)),
        ("tiny moe fp8 block", tiny_moe, dict(method="fp8", scheme=fp8_scheme("block"),
                                              method_options={"scheme": "block"})),
        ("qwen3_next rtn int4 g64", lambda: family("qwen3_next"), dict(method="rtn", scheme=g)),
        ("qwen3_next gptq int4 g64", lambda: family("qwen3_next"),
         dict(method="gptq", scheme=g, calib="mixed", **calib)),
    ]
    plans = [
        ("smollm2 rtn int4 g64", "smollm2-135m", dict(method="rtn", scheme=g), "vllm", True),
        # MLX runs bf16 against quantkit's float32 decode: a real model's depth shows in the
        # KLD (the tiny rows alone gave a bound SmolLM2's good artifacts exceed)
        # llama.cpp's quantized matmuls round their inputs to Q8 blocks: through 30 layers
        # that is far more KLD than the tiny rows show (SmolLM2's BF16 file: 1.2e-4)
        ("smollm2 gguf q4_k_m", "smollm2-135m", dict(method="gguf", format="gguf",
                                                     scheme=QuantScheme(kind="kquant",
                                                                        gguf_type="q4_k_m"),
                                                     method_options={"gguf_type": "q4_k_m"}),
         "llamacpp", True),
        ("smollm2 rtn int4 g64 mlx", "smollm2-135m", dict(method="rtn", format="mlx", scheme=g,
                                                          symmetric_auto=True), "mlx", True),
        ("smollm2 nvfp4 mlx", "smollm2-135m", dict(method="nvfp4", format="mlx",
                                                   scheme=fp4_scheme("nvfp4")), "mlx", True),
        ("tiny nvfp4 mlx", tiny, dict(method="nvfp4", format="mlx", scheme=fp4_scheme("nvfp4")),
         "mlx", True),
        ("tiny mxfp4 mlx", tiny, dict(method="mxfp4", format="mlx", scheme=fp4_scheme("mxfp4")),
         "mlx", True),
        ("tiny rtn int4 g64", tiny, dict(method="rtn", scheme=g), "vllm", True),
        ("tiny gptq int4 g64", tiny, dict(method="gptq", scheme=g, calib_samples=8,
                                          calib_seqlen=64), "vllm", True),
        ("tiny int8 w8a8", tiny, dict(method="int8", scheme=int8_scheme("dynamic"),
                                      calib_samples=8, calib_seqlen=64,
                                      method_options={"scheme": "dynamic"}), "vllm", False),
        ("tiny fp8 dynamic", tiny, dict(method="fp8", scheme=fp8_scheme("dynamic"),
                                        method_options={"scheme": "dynamic"}), "vllm", False),
        ("tiny awq int4 g64", tiny, dict(method="awq", scheme=g, calib_samples=8,
                                         calib_seqlen=64), "vllm", True),
        ("tiny gptq int4 g64 act-order", tiny, dict(
            method="gptq", scheme=QuantScheme(bits=4, group_size=64, act_order=True),
            calib_samples=8, calib_seqlen=64), "vllm", True),
        ("tiny rtn int4 per-channel", tiny, dict(method="rtn", scheme=QuantScheme(
            bits=4, group_size=-1)), "vllm", True),
        ("tiny rtn int8 g128 weight-only", tiny, dict(method="rtn", scheme=QuantScheme(
            bits=8, group_size=128)), "vllm", True),
        ("tiny gptq v1 int4 g64", tiny, dict(method="gptq", format="gptq", scheme=g,
                                             calib_samples=8, calib_seqlen=64), "vllm", True),
        ("tiny autoawq gemm int4 g64", tiny, dict(method="awq", format="awq", scheme=g,
                                                  calib_samples=8, calib_seqlen=64), "vllm", True),
        ("tiny nvfp4 w4a16", tiny, dict(method="nvfp4", scheme=fp4_scheme("nvfp4")), "vllm", True),
        ("tiny mxfp4 w4a16", tiny, dict(method="mxfp4", scheme=fp4_scheme("mxfp4")), "vllm", True),
        *[(f"tiny gguf {t}", tiny, dict(method="gguf", format="gguf", scheme=QuantScheme(
            kind="kquant", gguf_type=t), method_options={"gguf_type": t}), "llamacpp", True)
          for t in ("q4_0", "q5_k_m", "q3_k_m", "q2_k", "iq4_xs")],
        # the remaining tensor types of llama.cpp's presets: IQ2_XXS, IQ2_XS, IQ2_S (iq2_m),
        # IQ3_XXS (+ IQ3_S, IQ2_S), IQ3_S (imatrix from 8 x 64 tokens of `mixed`), Q5_0, Q4_1
        *[(f"tiny gguf {t}", tiny, dict(method="gguf", format="gguf", scheme=QuantScheme(
            kind="kquant", gguf_type=t), method_options={"gguf_type": t, "imatrix": "calib"},
            **imatrix), "llamacpp", True)
          for t in ("iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xxs", "iq3_s")],
        *[(f"tiny gguf {t}", tiny, dict(method="gguf", format="gguf", scheme=QuantScheme(
            kind="kquant", gguf_type=t), method_options={"gguf_type": t}), "llamacpp", True)
          for t in ("q5_0", "q4_1")],
        ("tiny rtn int4 g64 mlx", tiny, dict(method="rtn", format="mlx", scheme=g,
                                             symmetric_auto=True), "mlx", True),
        ("tiny gptq int4 g64 mlx", tiny, dict(method="gptq", format="mlx", scheme=g,
                                              symmetric_auto=True, calib_samples=8,
                                              calib_seqlen=64), "mlx", True),
        ("tiny gguf q8_0", tiny, dict(method="gguf", format="gguf", scheme=QuantScheme(
            kind="kquant", gguf_type="q8_0"), method_options={"gguf_type": "q8_0"}),
         "llamacpp", True),
        ("tiny gguf q4_k_m", tiny, dict(method="gguf", format="gguf", scheme=QuantScheme(
            kind="kquant", gguf_type="q4_k_m"), method_options={"gguf_type": "q4_k_m"}),
         "llamacpp", True),
    ]
    plans += [(label, make, kw, "vllm", True) for label, make, kw in moe_plans]
    # GGUF of the MoE and hybrid families in llama.cpp: experts stacked, in_proj_qkvz split,
    # Mamba2 tensors transformed (formats.gguf.gguf_pieces, the layout verify compares with)
    k4 = dict(method="gguf", format="gguf", scheme=QuantScheme(kind="kquant", gguf_type="q4_k_m"),
              method_options={"gguf_type": "q4_k_m"})
    plans += [(f"{label} gguf q4_k_m", make, k4, "llamacpp", True) for label, make in (
        ("tiny moe", tiny_moe), ("qwen3_next", lambda: family("qwen3_next")),
        ("granitemoehybrid", lambda: family("granitemoehybrid")))]
    out = []
    for label, model, kw, engine, run in plans:
        if only and label not in only:
            continue
        path = work / (label.replace(" ", "-") + (".gguf" if engine == "llamacpp" else ""))
        if not path.exists():
            model = model() if callable(model) else model
            quantize(QuantizeRequest(model=str(model), out=path, **kw))
        out.append((label, path, engine, run))
    return out


def _write(measured: list[dict], tolerances: dict) -> None:
    command = "python benchmarks/verify_tolerances.py WORKDIR"
    if "--only" in sys.argv:  # the rows it re-measured, on top of the runs before
        previous = json.loads(RESULTS.read_text())["command"] if RESULTS.is_file() else command
        command = previous + "; then python benchmarks/verify_tolerances.py " + " ".join(
            f'"{a}"' if " " in a else a for a in sys.argv[1:])
    RESULTS.write_text(json.dumps({"command": command,
                                   "measured": measured, "tolerances": tolerances}, indent=2))
    verify_tensors.TOLERANCES_FILE.write_text(json.dumps(tolerances, indent=2) + "\n")
    print(json.dumps(tolerances, indent=2))


def tolerances_from(measured: list[dict]) -> dict:
    """The bounds from the measurements (the rule in the module docstring)."""
    rel: dict[str, float] = {"dense": 0.01}
    for row in measured:
        for kind, v in (row["rel_rmse"] or {}).items():
            if kind != "dense":
                rel[kind] = max(rel.get(kind, 0.0), round(2 * v, 4))
    parity: dict[str, dict] = {"vllm": {}, "llamacpp": {}, "mlx": {}}
    for row in measured:
        if row["parity"]:
            cur = parity[row["engine"]].setdefault(row["parity_key"], {"kld": 0.0, "top1": 1.0})
            cur["kld"] = max(cur["kld"], round(3 * row["parity"]["mean_kld"], 5))
            cur["top1"] = min(cur["top1"], round(row["parity"]["top1"] - 0.05, 3))
    return {"rel_rmse": rel, "parity": parity}


def main() -> None:
    if sys.argv[1:2] == ["--from-results"]:  # re-derive the bounds from the last run
        measured = json.loads(RESULTS.read_text())["measured"]
        _write(measured, tolerances_from(measured))
        return
    args = sys.argv[1:]
    only = [args[i + 1] for i, a in enumerate(args) if a == "--only"]  # re-measure these rows
    args = [a for i, a in enumerate(args) if a != "--only" and (i == 0 or args[i - 1] != "--only")]
    work = Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="verify-tol-"))
    work.mkdir(parents=True, exist_ok=True)
    open_bounds = {"rel_rmse": {}, "parity": {"vllm": {"any": {"kld": 1e9, "top1": 0.0}},
                                               "llamacpp": {"any": {"kld": 1e9, "top1": 0.0}},
                                               "mlx": {"any": {"kld": 1e9, "top1": 0.0}}}}
    original = verify_tensors.TOLERANCES_FILE
    tmp = work / "open-tolerances.json"
    tmp.write_text(json.dumps(open_bounds))
    verify_tensors.TOLERANCES_FILE = tmp
    measured = []
    try:
        for label, path, engine, run in _artifacts(work, only):
            res = verify(path, engine, run_engine=run, on_progress=lambda s, lb=label: print(lb, s))
            parity = res.checks["parity"].measured
            key = parity.get("tolerance_key")  # the key verify looked its bounds up by
            row = {"artifact": label, "engine": engine, "engine_version": res.engine_version,
                   "kernel": res.kernel, "dtype": res.dtype,
                   "rel_rmse": res.checks["fidelity"].measured.get("worst_rel_rmse"),
                   "parity_key": key,
                   "parity": {k: parity[k] for k in ("mean_kld", "top1", "positions")} if parity else None,
                   "statuses": {n: c.status for n, c in res.checks.items()}}
            print(json.dumps(row))
            measured.append(row)
    finally:
        verify_tensors.TOLERANCES_FILE = original
    if only:  # the other rows as the last results file has them, in its order
        fresh = {row["artifact"]: row for row in measured}
        measured = [fresh.pop(row["artifact"], row)
                    for row in json.loads(RESULTS.read_text())["measured"]] + list(fresh.values())
    tolerances = tolerances_from(measured)
    _write(measured, tolerances)

if __name__ == "__main__":
    main()
