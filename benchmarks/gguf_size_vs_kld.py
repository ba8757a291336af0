"""Size-vs-KLD curve of GGUF files, through llama.cpp's logits: llama.cpp's own imatrix
quantizer vs quantkit's RTN grid vs quantkit's GPTQ error feedback vs `--gguf-type auto`,
on one model, one imatrix and one held-out text.

  python benchmarks/gguf_size_vs_kld.py [--model tiny|smollm2-135m|DIR]
        [--types q2_k,q3_k_m,q4_k_m,q5_k_m,q6_k,q8_0] [--calib-samples 16] [--calib-seqlen 512]
        [--windows 8] [--gptq-v-hessian tokens|attention|both] [--report reports/NAME.html]
        [--out FILE]

`--model tiny` builds the tiny random bf16 Llama of tests/tiny_models.py (widths 256/512,
every Linear a multiple of 256, so no row-width fallbacks; seeded, so the same model every
run). Files per type T (all written in one run, in a temp dir):
  base              the 16-bit GGUF (quantkit's converter): the reference of every KLD
  llamacpp-T        llama.cpp's llama_model_quantize(base, T, imatrix)
  rtn-T             quantkit --method gguf --gguf-type T with the same imatrix file (llama.cpp's
                    grid and rounding; the bytes are compared with llamacpp-T's)
  gptq-T            quantkit --method gptq --format gguf --gguf-type T with the same imatrix
                    file (its scale search) and the same calibration windows (the Hessians)
  gptqv-T           with --gptq-v-hessian attention|both: the same with v_proj's Hessian from
                    the block's attention probabilities (--gptq-v-hessian attention); `attention`
                    writes it instead of gptq-T, `both` beside it
  auto-T            quantkit --gguf-type auto --target-bpw B, B = llamacpp-T's bits per weight
                    over its weight matrices (block Linears + token_embd/output), same imatrix
                    file (auto chooses token_embd / output too); refused budgets (outside
                    what auto's candidates can make) are recorded as such
The imatrix is collected once by quantkit's calibration loop (bit-exact with llama-imatrix's
sums, see gguf_vs_llamacpp.py). Scores: gguf_vs_llamacpp._score (PPL and mean KL(base || file)
over the second half of 512-token windows of the `mixed` held-out split). With --report the
files are also handed to `quantkit compare --base MODEL` (its own eval convention: HF base
logits vs each file's llama.cpp logits) for the self-contained HTML page.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from gguf_vs_llamacpp import _llama_cpp, _model_dir, _quantkit, _same_tensors, _score  # noqa: E402

from quantkit.info import artifact_info  # noqa: E402
from quantkit.machine import cpu_info  # noqa: E402
from quantkit.methods.imatrix import load_imatrix  # noqa: E402

TYPES = "q2_k,q3_k_m,q4_k_m,q5_k_m,q6_k,q8_0"


def _model(spec: str, work: Path) -> str:
    if spec != "tiny":
        return spec
    from tiny_models import make_tiny_model

    return str(make_tiny_model(work / "tiny-llama", "llama"))


def _timed(fn, *a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    return round(time.perf_counter() - t, 1), out


class _Curve:
    """The files of the curve, one type at a time: each type's files are scored as soon as
    they are written and the results JSON is rewritten, so a run cut short keeps its points."""

    def __init__(self, args, model: str, work: Path, res: dict, out: Path) -> None:
        self.args, self.model, self.work, self.res, self.out = args, model, work, res, out
        self.llama_model, self.llama_quantize = _llama_cpp()
        self.calib = {"calib_samples": args.calib_samples, "calib_seqlen": args.calib_seqlen}
        self.paths = {"base": work / "base.gguf"}
        self.imatrix = work / "imatrix.gguf"
        self.values = None
        res.update(sizes_bytes={}, bpw={}, quality={})
        raw = json.loads((_model_dir(model) / "config.json").read_text())
        float_type = "f16" if raw.get("dtype", raw.get("torch_dtype")) == "float16" else "bf16"
        self._seconds("convert_16bit", _quantkit(model, self.paths["base"], float_type))
        from quantkit.calibration import load_heldout_text

        text, self.heldout = load_heldout_text("mixed")
        base = self.llama_model(self.paths["base"], n_ctx=512)
        self.ids = base.tokenize(text)
        base.close()

    def _seconds(self, key: str, timed: tuple):
        self.res["seconds"][key] = round(timed[0], 1)
        return timed[1]

    def run_type(self, t: str) -> None:
        work, model, imatrix, res = self.work, self.model, self.imatrix, self.res
        rtn = work / f"rtn-{t}.gguf"
        if self.values is None:  # the first quantkit file also collects the imatrix every row uses
            meta = self._seconds(f"rtn-{t} (+ imatrix collection)", _quantkit(
                model, rtn, t, options={"imatrix": "calib", "imatrix_out": str(imatrix)}, **self.calib))
            res["calibration"] = meta["calibration"]
            self.values = {k: v.numpy() for k, v in load_imatrix(imatrix).values.items()}
        else:
            self._seconds(f"rtn-{t}", _quantkit(model, rtn, t, options={"imatrix": str(imatrix)}))
        ref = work / f"llamacpp-{t}.gguf"
        self._seconds(f"llamacpp-{t}", _timed(self.llama_quantize, self.paths["base"], ref, t,
                                              nthread=self.args.threads, imatrix=self.values))
        files = {"base": self.paths["base"], f"llamacpp-{t}": ref, f"rtn-{t}": rtn}
        target = artifact_info(ref)["bits_per_weight_with_embeddings"]
        point = {"type": t, "target_bpw_for_auto": target,
                 "rtn_bit_exact_with_llamacpp": _same_tensors(rtn, ref)}
        v_hessians = {"tokens": ["tokens"], "attention": ["attention"],
                      "both": ["tokens", "attention"]}[self.args.gptq_v_hessian]
        for v in v_hessians:
            kind = "gptq" if v == "tokens" else "gptqv"
            gptq = work / f"{kind}-{t}.gguf"
            meta_g = self._seconds(f"{kind}-{t}", _quantkit(
                model, gptq, t, options={"rounding": "gptq", "imatrix": str(imatrix),
                                         "damp": self.args.damp, "v_hessian": v}, **self.calib))
            point[f"{kind}_fallbacks"] = meta_g.get("fallbacks", {})
            files[f"{kind}-{t}"] = gptq
        auto = work / f"auto-{t}.gguf"
        try:
            meta_a = self._seconds(f"auto-{t}", _quantkit(
                model, auto, "auto", options={"imatrix": str(imatrix), "target_bpw": target},
                **self.calib))
            point["auto_type_counts"] = meta_a["gguf_auto"]["type_counts"]
            point["auto_outside_types"] = {n: v["type"] for n, v in meta_a["gguf_auto"]["tensors"].items()
                                           if not n.startswith("blk.")}
            files[f"auto-{t}"] = auto
        except Exception as exc:  # noqa: BLE001 - a refused budget is a result of the curve
            point["auto_refused"] = str(exc).splitlines()[0]
        res["points"][t] = point
        self.paths.update(files)
        for n, p in files.items():
            info = artifact_info(p)
            res["sizes_bytes"][n] = p.stat().st_size
            res["bpw"][n] = {"with_embeddings": info.get("bits_per_weight_with_embeddings"),
                             "block_linears": info.get("bits_per_weight_quantized")}
        quality = self._seconds(f"scoring-{t}", _timed(_score, self.llama_model, files, self.ids, 512,
                                                        self.args.windows))
        res["quality"].update({**quality, "heldout": self.heldout})
        res["table"] = _table(res)
        self.write()
        print(f"{t}: done ({json.dumps({k: v for k, v in res['seconds'].items() if t in k})})", flush=True)

    def write(self) -> None:
        self.res["machine"]["loadavg_end"] = os.getloadavg()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.res, indent=2, default=str) + "\n")
        tmp.replace(self.out)


def _table(res: dict) -> list[dict]:
    """One row per file: bits per weight, size, KLD, PPL, top-1, KLD ratio vs llama.cpp at T."""
    q = res["quality"]
    rows = []
    for t in res["types"]:
        if f"kld_llamacpp-{t}" not in q:  # not reached yet
            continue
        ref_kld = q[f"kld_llamacpp-{t}"]
        for kind in ("llamacpp", "rtn", "gptq", "gptqv", "auto"):
            name = f"{kind}-{t}"
            if f"kld_{name}" not in q:
                continue
            rows.append({"type": t, "method": kind, "file": name,
                         "size_bytes": res["sizes_bytes"][name],
                         "bpw_with_embeddings": res["bpw"][name]["with_embeddings"],
                         "bpw_block_linears": res["bpw"][name]["block_linears"],
                         "kld": q[f"kld_{name}"], "ppl": q[f"ppl_{name}"],
                         "same_top": q[f"same_top_{name}"],
                         "kld_ratio_vs_llamacpp": round(q[f"kld_{name}"] / ref_kld, 3),
                         "size_ratio_vs_llamacpp": round(
                             res["sizes_bytes"][name] / res["sizes_bytes"][f"llamacpp-{t}"], 4)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' (tests/tiny_models.py), an alias or a dir")
    ap.add_argument("--types", default=TYPES, help=f"llama.cpp ftypes (default {TYPES})")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8, help="512-token windows scored")
    ap.add_argument("--gptq-v-hessian", choices=("tokens", "attention", "both"), default="tokens",
                    help="v_proj's GPTQ Hessian: tokens (gptq-T), attention (gptqv-T) or both files")
    ap.add_argument("--report", type=Path, default=None, help="also write a `quantkit compare` page")
    ap.add_argument("--compare-windows", type=int, default=8, help="--max-windows of that compare")
    ap.add_argument("--out", type=Path, default=None,
                    help="results JSON (default benchmarks/results/gguf_size_vs_kld_<model>.json)")
    args = ap.parse_args()
    args.types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    out = args.out or REPO / "benchmarks" / "results" / f"gguf_size_vs_kld_{Path(args.model).name}.json"
    if args.report and args.report.resolve().with_suffix(".json") == out.resolve():
        sys.exit(f"error: the compare page's JSON twin would overwrite {out}\n"
                 "hint: name the page differently (e.g. reports/gguf_size_vs_kld_tiny.html)")

    import torch

    torch.set_num_threads(args.threads)
    if _llama_cpp() is None:
        sys.exit("error: llama-cpp-python is not installed\nhint: run in quantkit's .venv")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=REPO).stdout.strip()
    res: dict = {"benchmark": "gguf_size_vs_kld", "code": f"quantkit commit {commit or '?'}"
                 + (" (uncommitted changes)" if dirty else ""),
                 "command": " ".join([Path(sys.executable).name, *sys.argv]),
                 "model": args.model, "types": args.types, "threads": args.threads,
                 "gptq_v_hessian": args.gptq_v_hessian,
                 "calibration_windows": {"calib_samples": args.calib_samples,
                                         "calib_seqlen": args.calib_seqlen},
                 "machine": {"cpu": cpu_info()["model"], "cpus": os.cpu_count(), "platform": platform.platform(),
                             "loadavg_start": os.getloadavg(), "torch": torch.__version__},
                 "seconds": {}, "points": {}}
    work = Path(tempfile.mkdtemp(prefix="gguf-curve-"))
    t0 = time.perf_counter()
    try:
        model = _model(args.model, work)
        curve = _Curve(args, model, work, res, out)
        for t in args.types:
            curve.run_type(t)
        if args.report:
            report = args.report if args.report.is_absolute() else Path.cwd() / args.report
            cmd = [sys.executable, "-m", "quantkit.cli", "compare",
                   *[str(p) for n, p in curve.paths.items() if n != "base"], "--base", model,
                   "--report", str(report), "--max-windows", str(args.compare_windows),
                   "--title", f"GGUF size vs KLD: llama.cpp vs quantkit RTN / GPTQ / auto ({Path(args.model).name})"]
            res["seconds"]["compare_report"], r = _timed(
                subprocess.run, cmd, cwd=REPO, capture_output=True, text=True,
                env={**os.environ, "PYTHONPATH": str(REPO)})
            res["compare"] = {"report": str(args.report), "returncode": r.returncode,
                              "command": "quantkit compare <the files above> --base MODEL --report "
                                         f"{args.report} --max-windows {args.compare_windows}",
                              "stderr_tail": r.stderr[-2000:] if r.returncode else ""}
        res["seconds"]["total"] = round(time.perf_counter() - t0, 1)
        res["complete"] = True
        curve.write()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"seconds": res["seconds"], "points": res["points"]}, indent=2, default=str))
    for row in res.get("table", []):
        print(f"{row['file']:>16}  {row['bpw_with_embeddings']:.3f} bpw  {row['bpw_block_linears']:.3f} blk  "
              f"KLD {row['kld']:.5f}  x{row['kld_ratio_vs_llamacpp']:.3f}  size x{row['size_ratio_vs_llamacpp']}")


if __name__ == "__main__":
    main()
