"""Is GPTQ's Hessian right for v_proj? Its output reaches the block only through attention.

    python benchmarks/gptq_v_proj_attention_hessian.py [--model smollm2-135m] [--layers 2,15,28]
        [--calib-samples 16] [--heldout-windows 8] [--gguf-type Q5_0] [--out FILE]

GPTQ minimises tr(E H E^T) with H = X^T X, every token weighted alike. But v_proj's output is
only ever used as sum_t a_st v_t: the error that reaches the attention output of query s is
E xbar_s with xbar_s = sum_t a_st x_t (attention weights of the query heads that read this KV
head). So the Hessian that measures v_proj's real output error is, per KV head g,
H_att,g = sum_{h in g} sum_s xbar_hs xbar_hs^T (rows of g only). Attention sinks make the two
very different: much of each query's weight sits on the first token, which X^T X counts once.

For each listed block of the unquantized float32 model (eager attention, real weights), on the
calibration windows and separately on held-out windows: v_proj's relative error
tr(E H_att E^T) / tr(W H_att W^T) for
  rtn        llama.cpp's encoder of `--gguf-type` with imatrix diag(X^T X)
  gptq_std   GPTQ onto the same grid with H = X^T X (what quantkit and every GPTQ tool do)
  gptq_att   GPTQ onto the same grid with H_att, one solve per KV head
  gptq_att_sum  GPTQ with one Hessian for the whole tensor: H_att summed over the KV heads
printed as ratios to rtn. The end-to-end effect on the file is in gguf_gptq_by_tensor_kind.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402

from quantkit.calibration.loader import load_calibration, tokenize_text  # noqa: E402
from quantkit.calibration.sources import load_heldout_text  # noqa: E402
from quantkit.ggml.codec import dequantize_tensor, quantize_tensor  # noqa: E402
from quantkit.methods.gguf_gptq import gptq_ggml, hessian_factor  # noqa: E402
from quantkit.model_io import resolve_model  # noqa: E402


def _hessians(model, layers: list[int], windows: torch.Tensor) -> tuple[dict, dict]:
    """(X^T X, H_att per KV head) of each listed block's v_proj input, float64."""
    cfg = model.config
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    width = cfg.hidden_size
    seen: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].self_attn.v_proj.register_forward_hook(
        lambda _m, a, _o, i=i: seen.__setitem__(i, a[0][0].detach())) for i in layers]
    h_std = {i: torch.zeros(width, width, dtype=torch.float64) for i in layers}
    h_att = {i: torch.zeros(nkv, width, width, dtype=torch.float64) for i in layers}
    try:
        with torch.no_grad():
            for w in range(windows.shape[0]):
                out = model(windows[w:w + 1], output_attentions=True)
                for i in layers:
                    x = seen[i].double()  # [S, H]
                    h_std[i] += x.T @ x
                    att = out.attentions[i][0].double()  # [heads, S, S]
                    for g in range(nkv):
                        for h in range(g * (nh // nkv), (g + 1) * (nh // nkv)):
                            xbar = att[h] @ x
                            h_att[i][g] += xbar.T @ xbar
    finally:
        for hook in hooks:
            hook.remove()
    return h_std, h_att


def _att_error(w: torch.Tensor, wq: torch.Tensor, h_att: torch.Tensor, head_dim: int) -> float:
    e, w64 = (w - wq).double(), w.double()
    num = den = 0.0
    for g in range(h_att.shape[0]):
        rows = slice(g * head_dim, (g + 1) * head_dim)
        num += float(torch.einsum("ij,jk,ik->", e[rows], h_att[g], e[rows]))
        den += float(torch.einsum("ij,jk,ik->", w64[rows], h_att[g], w64[rows]))
    return num / den


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", default="2,15,28")
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--heldout-windows", type=int, default=8)
    ap.add_argument("--gguf-type", default="Q5_0", help="the grid (SmolLM2's Q4_K_M writes attn_v as Q5_0)")
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).parent / "results" / "gptq_v_proj_attention_hessian_smollm2.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(args.model).path
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = [int(s) for s in args.layers.split(",")]
    qtype = GGMLQuantizationType[args.gguf_type.upper()]
    calib = load_calibration("mixed", tok, n_samples=args.calib_samples, seqlen=512).input_ids
    text, _ = load_heldout_text("mixed")
    held = tokenize_text(text, tok)[: args.heldout_windows * 512].reshape(args.heldout_windows, 512)
    t0, load_start = time.perf_counter(), os.getloadavg()
    h_std, h_att = _hessians(model, layers, calib)
    _, h_att_held = _hessians(model, layers, held)
    rows = []
    for i in layers:
        w = model.model.layers[i].self_attn.v_proj.weight.data.float()
        diag = h_std[i].diagonal().float().clone()
        rtn = dequantize_tensor(quantize_tensor(w, qtype, diag), qtype).reshape(w.shape)
        hinv, hdiag = hessian_factor(h_std[i].float(), args.damp)
        _, gptq_std = gptq_ggml(w, hinv, qtype, hdiag)
        gptq_att = torch.empty_like(w)
        for g in range(h_att[i].shape[0]):
            r = slice(g * head_dim, (g + 1) * head_dim)
            hinv_g, _ = hessian_factor(h_att[i][g].float(), args.damp)
            _, gptq_att[r] = gptq_ggml(w[r], hinv_g, qtype, diag)
        hinv_s, _ = hessian_factor(h_att[i].sum(0).float(), args.damp)
        _, gptq_att_sum = gptq_ggml(w, hinv_s, qtype, diag)
        row = {"block": i, "type": qtype.name}
        for name, wq in (("rtn", rtn), ("gptq_std", gptq_std), ("gptq_att", gptq_att),
                         ("gptq_att_sum", gptq_att_sum)):
            row[f"{name}_calib"] = _att_error(w, wq, h_att[i], head_dim)
            row[f"{name}_heldout"] = _att_error(w, wq, h_att_held[i], head_dim)
        for name in ("gptq_std", "gptq_att", "gptq_att_sum"):
            for split in ("calib", "heldout"):
                row[f"ratio_{name}_{split}"] = round(row[f"{name}_{split}"] / row[f"rtn_{split}"], 3)
        rows.append(row)
        print(f"block {i:2d} v_proj {qtype.name}: error under H_att / rtn's -- GPTQ(X^T X) calib "
              f"{row['ratio_gptq_std_calib']:.3f} held-out {row['ratio_gptq_std_heldout']:.3f}; "
              f"GPTQ(H_att) calib {row['ratio_gptq_att_calib']:.3f} held-out "
              f"{row['ratio_gptq_att_heldout']:.3f}; GPTQ(sum of H_att over KV heads) calib "
              f"{row['ratio_gptq_att_sum_calib']:.3f} held-out {row['ratio_gptq_att_sum_heldout']:.3f}",
              flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    res = {"benchmark": "gptq_v_proj_attention_hessian", "model": args.model, "commit": commit,
           "command": "python " + " ".join(sys.argv), "damp": args.damp,
           "calib_windows": [args.calib_samples, 512], "heldout_windows": [args.heldout_windows, 512],
           "seconds": round(time.perf_counter() - t0, 1),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
           "blocks": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=2) + "\n")
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
