"""quantkit's HF -> GGUF K-quant path vs llama.cpp's quantizer, on the same model, in one run.

  python benchmarks/gguf_vs_llamacpp.py [--model smollm2-135m] [--gguf-type q4_k_m] [--repeats 3]
                                        [--threads 2] [--quality] [--out FILE.json]
  python benchmarks/gguf_vs_llamacpp.py --synthetic 4 --tokenizer DIR --device cuda
        (random weights in Llama-3.1-8B shapes, 4 layers: quantkit's speed on a GPU machine,
        where llama-cpp-python may be absent; the llama.cpp side then is skipped)

Timed (wall clock, same process, same CPU):
  quantkit  convert: HF checkpoint -> BF16/F16 GGUF (the input llama-quantize needs)
  quantkit  quantize: HF checkpoint -> Q4_K_M GGUF in one call (load, plan, encode, write)
  llama.cpp quantize: llama_model_quantize(BF16 GGUF -> Q4_K_M), `--threads` threads
Each side runs `--repeats` times; the ratio compares medians. Both sides' code is loaded
before their timed calls except quantkit's first call ("cold"), which also pays numba's
loading of the compiled encoders (reported separately: ratio_cold).
Both Q4_K_M files are compared tensor by tensor (bit_exact). With --quality, an imatrix is
collected through quantkit's calibration loop, both tools quantize with it (compared again),
and perplexity (llama.cpp convention: n_ctx windows, second half scored) and KL divergence
against the 16-bit GGUF are measured with llama.cpp on held-out text.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.formats.gguf import read_gguf  # noqa: E402
from quantkit.methods.imatrix import load_imatrix  # noqa: E402
from quantkit.pipeline.quantize import QuantizeRequest, quantize  # noqa: E402
from quantkit.types import QuantScheme  # noqa: E402


def _quantkit(model: str, out: Path, gguf_type: str, **kw) -> tuple[float, dict]:
    opts = {"gguf_type": gguf_type, **kw.pop("options", {})}
    t = time.perf_counter()
    meta = quantize(QuantizeRequest(model=model, method="gguf", format="gguf", out=out, force=True,
                                    scheme=QuantScheme(kind="kquant", gguf_type=gguf_type),
                                    method_options=opts, **kw))
    return time.perf_counter() - t, meta


def _synthetic_llama(out: Path, layers: int, tokenizer: Path) -> Path:
    """Random bf16 model with Llama-3.1-8B layer shapes and the given tokenizer's vocabulary."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=vocab,
                      rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.02)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer / f).is_file():
            shutil.copy2(tokenizer / f, out / f)
    return out


def _same_tensors(a: Path, b: Path) -> bool:
    ta, tb = read_gguf(a)[1], read_gguf(b)[1]
    return set(ta) == set(tb) and all(
        ta[n].qtype == tb[n].qtype and np.array_equal(ta[n].data, tb[n].data) for n in tb)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _score(llama_model, paths: dict[str, Path], ids: list[int], n_ctx: int, max_windows: int) -> dict:
    """PPL of each model and mean KL(base || model) over the scored (second-half) positions."""
    windows = [ids[i:i + n_ctx] for i in range(0, len(ids) - n_ctx + 1, n_ctx)][:max_windows]
    logp = {}
    for name, path in paths.items():
        llm = llama_model(path, n_ctx=n_ctx, logits_all=True)
        logp[name] = [_log_softmax(llm.logits(w)[n_ctx // 2 - 1:-1]) for w in windows]
        llm.close()
    out = {"windows": len(windows), "n_ctx": n_ctx, "scored_tokens": len(windows) * (n_ctx // 2)}
    for name in paths:
        nll = [-lp[np.arange(len(lp)), w[n_ctx // 2:]] for lp, w in zip(logp[name], windows, strict=True)]
        out[f"ppl_{name}"] = float(np.exp(np.concatenate(nll).mean()))
        if name != "base":
            kld = [(np.exp(b) * (b - q)).sum(-1) for b, q in zip(logp["base"], logp[name], strict=True)]
            same = [(b.argmax(-1) == q.argmax(-1)) for b, q in zip(logp["base"], logp[name], strict=True)]
            out[f"kld_{name}"] = float(np.concatenate(kld).mean())
            out[f"same_top_{name}"] = float(np.concatenate(same).mean())
    return out


def _llama_cpp():
    """(LlamaCppModel, llama_quantize), or None where llama-cpp-python is not installed."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from quantkit.engines.llamacpp import LlamaCppModel, llama_quantize

    return LlamaCppModel, llama_quantize


def _run(args, work: Path, res: dict) -> None:
    raw = json.loads((_model_dir(args.model) / "config.json").read_text())
    float_type = "f16" if raw.get("dtype", raw.get("torch_dtype")) == "float16" else "bf16"
    t_conv, _ = _quantkit(args.model, work / "base.gguf", float_type, device=args.device)
    runs = [_quantkit(args.model, work / "qk.gguf", args.gguf_type, device=args.device)
            for _ in range(args.repeats + 1)]
    t_cold, meta = runs[0]
    t_qk = statistics.median(t for t, _ in runs[1:])
    res["quantkit_device"] = meta["device"]
    res["seconds"] = {"quantkit_convert_16bit": round(t_conv, 2),
                      "quantkit_convert_and_quantize": round(t_qk, 2),
                      "quantkit_convert_and_quantize_runs": [round(t, 2) for t, _ in runs[1:]],
                      "quantkit_convert_and_quantize_cold": round(t_cold, 2),
                      "quantkit_quantize_step": runs[-1][1]["seconds"]["quantize"]}
    res["sizes_mb"] = {p.stem: round(p.stat().st_size / 2**20, 2) for p in (work / "base.gguf", work / "qk.gguf")}
    engine = _llama_cpp()
    if engine is None:
        res["llama_cpp"] = "llama-cpp-python not installed: llama.cpp side skipped"
        return
    llama_model, llama_quantize = engine
    t_lls = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        llama_quantize(work / "base.gguf", work / "ref.gguf", args.gguf_type, nthread=args.threads)
        t_lls.append(time.perf_counter() - t)
    t_ll = statistics.median(t_lls)
    res["seconds"]["llama_cpp_quantize"] = round(t_ll, 2)
    res["seconds"]["llama_cpp_quantize_runs"] = [round(t, 2) for t in t_lls]
    res["ratio_quantkit_vs_llama_cpp_quantize"] = round(t_qk / t_ll, 2)
    res["ratio_cold"] = round(t_cold / t_ll, 2)
    res["ratio_quantkit_vs_quantkit_convert_plus_llama_cpp_quantize"] = round(t_qk / (t_conv + t_ll), 2)
    res["bit_exact"] = _same_tensors(work / "qk.gguf", work / "ref.gguf")
    if not args.quality:
        return
    t_im, meta_im = _quantkit(args.model, work / "qk_imat.gguf", args.gguf_type, device=args.device,
                              options={"imatrix": "calib", "imatrix_out": str(work / "imatrix.gguf")},
                              calib_samples=args.calib_samples, calib_seqlen=512)
    values = {k: v.numpy() for k, v in load_imatrix(work / "imatrix.gguf").values.items()}
    llama_quantize(work / "base.gguf", work / "ref_imat.gguf", args.gguf_type, nthread=args.threads,
                   imatrix=values)
    res["seconds"]["quantkit_with_imatrix_from_calibration"] = round(t_im, 2)
    res["bit_exact_with_imatrix"] = _same_tensors(work / "qk_imat.gguf", work / "ref_imat.gguf")
    res["calibration"] = meta_im["calibration"]
    from quantkit.calibration import load_heldout_text

    text, prov = load_heldout_text("mixed")
    base = llama_model(work / "base.gguf", n_ctx=512)
    ids = base.tokenize(text)
    base.close()
    paths = {"base": work / "base.gguf", "q": work / "qk.gguf", "q_imatrix": work / "qk_imat.gguf"}
    res["quality"] = {**_score(llama_model, paths, ids, 512, args.windows), "heldout": prov}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--gguf-type", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side (median)")
    ap.add_argument("--device", default=None, help="quantkit's device (default: cuda if present)")
    ap.add_argument("--quality", action="store_true")
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--windows", type=int, default=16, help="512-token windows scored for PPL/KLD")
    ap.add_argument("--synthetic", type=int, default=0, metavar="LAYERS")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer dir for --synthetic")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gguf_vs_llamacpp.json")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="gguf-bench-"))
    try:
        if args.synthetic:
            t = time.perf_counter()
            tok = args.tokenizer or _model_dir("smollm2-135m")
            args.model = str(_synthetic_llama(work / "synthetic", args.synthetic, tok))
            print(f"built the synthetic model in {time.perf_counter() - t:.1f}s", flush=True)
        res: dict = {"model": args.model, "synthetic_layers": args.synthetic or None,
                     "gguf_type": args.gguf_type, "threads": args.threads,
                     "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                 "loadavg_start": os.getloadavg(), "torch": torch.__version__,
                                 "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}}
        _run(args, work, res)
        res["machine"]["loadavg_end"] = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps(res, indent=2, default=str))


def _model_dir(spec: str) -> Path:
    """Local directory of a model spec (built-in alias, path or Hub id)."""
    from quantkit.model_io import resolve_model

    return resolve_model(spec).path


if __name__ == "__main__":
    main()
