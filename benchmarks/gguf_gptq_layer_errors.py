"""Where GPTQ error feedback onto GGML grids gains, layer by layer: each block Linear's output
error under llama.cpp's imatrix rounding vs under quantkit's GPTQ-on-the-grid, on the
calibration tokens (what GPTQ minimizes) and on held-out tokens (whether the gain generalizes).

  python benchmarks/gguf_gptq_layer_errors.py [--model smollm2-135m] [--gguf-type q4_k_m]
        [--layers 0,15,29] [--calib-samples 16] [--heldout-windows 8] [--damp 0.01] [--out FILE]

For each listed block and each of its Linears (the GGML type llama.cpp's mix plans for it,
row-width fallbacks included): H = X^T X of the Linear's float32 inputs (the unquantized
model's forward, so every method sees the same inputs), RTN = llama.cpp's encoder weighted
by diag(H) (the imatrix of the same tokens, up to a constant), GPTQ = gguf_gptq.gptq_ggml with
the same weights for its scale search. Error = tr(E H E^T) / tr(W H W^T), E = W - W_quantized.
attn_q / attn_k are included (GGUF permutes their rows; the error is row-order independent).
This isolates the rounding method: an end-to-end KLD that does not follow these ratios is
lost between the layers' errors and the logits, not in the column loop.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from quantkit.calibration.loader import load_calibration, tokenize_text  # noqa: E402
from quantkit.calibration.sources import load_heldout_text  # noqa: E402
from quantkit.ggml.codec import dequantize_tensor, quantize_tensor  # noqa: E402
from quantkit.ggml.mix import plan_types  # noqa: E402
from quantkit.methods.gguf_gptq import gptq_ggml, hessian_factor  # noqa: E402
from quantkit.model_io import resolve_model  # noqa: E402

LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}


def _hessians(model, linears: dict[str, torch.nn.Module], windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """X^T X (float64) of each Linear's inputs over the windows, one forward per window."""
    sums: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def add(_mod, inp, _out) -> None:
            x = inp[0].reshape(-1, inp[0].shape[-1]).double()
            sums[name] = sums[name] + x.T @ x if name in sums else x.T @ x
        return add

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    with torch.no_grad():
        for i in range(windows.shape[0]):
            model(windows[i:i + 1])
    for h in handles:
        h.remove()
    return sums


def _relative_error(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor) -> float:
    e, w64 = (w - wq).double(), w.double()
    return float(torch.einsum("ij,jk,ik->", e, h, e) / torch.einsum("ij,jk,ik->", w64, h, w64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--gguf-type", default="q4_k_m")
    ap.add_argument("--layers", default="0,15,29", help="comma-separated block indices")
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--heldout-windows", type=int, default=8)
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).parent / "results" / "gguf_gptq_layer_errors.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(args.model).path
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = model.config
    blocks = model.model.layers
    layers = [int(s) for s in args.layers.split(",")]
    if any(not 0 <= i < len(blocks) for i in layers):
        sys.exit(f"error: --layers {args.layers} outside 0..{len(blocks) - 1}\n"
                 f"hint: pass block indices below {len(blocks)}")
    all_linears = {f"blk.{i}.{g}.weight": b.get_submodule(h)
                   for i, b in enumerate(blocks) for h, g in LINEARS.items()}
    shapes = {n: tuple(m.weight.shape) for n, m in all_linears.items()}
    shapes["token_embd.weight"] = tuple(model.model.embed_tokens.weight.shape)
    if not cfg.tie_word_embeddings:
        shapes["output.weight"] = tuple(model.lm_head.weight.shape)
    plans = plan_types(args.gguf_type, shapes, len(blocks), has_imatrix=True,
                       n_gqa=cfg.num_attention_heads // cfg.num_key_value_heads)
    linears = {n: m for n, m in all_linears.items() if int(n.split(".")[1]) in layers}
    calib = load_calibration("mixed", tok, n_samples=args.calib_samples, seqlen=512).input_ids
    text, _ = load_heldout_text("mixed")
    heldout = tokenize_text(text, tok)[: args.heldout_windows * 512].reshape(args.heldout_windows, 512)
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    h_calib = _hessians(model, linears, calib)
    h_held = _hessians(model, linears, heldout)
    rows = []
    for name, m in linears.items():
        w, h = m.weight.data.float(), h_calib[name]
        qtype = plans[name].qtype
        diag = h.diagonal().float().clone()
        rtn = dequantize_tensor(quantize_tensor(w, qtype, diag), qtype).reshape(w.shape)
        hinv, hdiag = hessian_factor(h.float(), args.damp, name)
        _, gptq = gptq_ggml(w, hinv, qtype, hdiag)
        row = {"tensor": name, "type": qtype.name,
               "rtn_calib": _relative_error(w, rtn, h), "gptq_calib": _relative_error(w, gptq, h),
               "rtn_heldout": _relative_error(w, rtn, h_held[name]),
               "gptq_heldout": _relative_error(w, gptq, h_held[name])}
        row["ratio_calib"] = round(row["gptq_calib"] / row["rtn_calib"], 3)
        row["ratio_heldout"] = round(row["gptq_heldout"] / row["rtn_heldout"], 3)
        rows.append(row)
        print(f"{name:28s} {qtype.name:5s} GPTQ / RTN output error: calib {row['ratio_calib']:.3f}, "
              f"held-out {row['ratio_heldout']:.3f}", flush=True)
    res = {"benchmark": "gguf_gptq_layer_errors", "model": args.model, "gguf_type": args.gguf_type,
           "command": "python " + " ".join(sys.argv), "damp": args.damp,
           "calib_windows": [args.calib_samples, 512], "heldout_windows": [args.heldout_windows, 512],
           "seconds": round(time.perf_counter() - t0, 1),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
           "tensors": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=2) + "\n")
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
