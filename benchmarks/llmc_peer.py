"""What the SmolLM2 benchmarks that put llm-compressor beside quantkit share: quantkit's
calibration windows, llm-compressor's artifacts of the same presets made from them (the
reference runner tests/llmc_reference.py, in its own venv), and one `quantkit eval` pass that
scores every artifact against the same base on the same held-out windows.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the reference runner lives beside the tests using it

from llmc_reference import llmc_python, run_reference  # noqa: E402

__all__ = ["calibration_ids", "llmc_artifacts", "score", "default_llmc_python"]


def default_llmc_python() -> str:
    """scripts/setup.sh's llm-compressor 0.14.0.1 venv under quantkit's cache."""
    try:
        return str(llmc_python())
    except FileNotFoundError:
        return ""


def calibration_ids(model_dir: Path, samples: int, seqlen: int, seed: int = 0,
                    calib: str = "mixed") -> torch.Tensor:
    """The int64 [samples, seqlen] windows quantkit's pipeline calibrates on for these settings."""
    from quantkit.calibration import load_calibration
    from quantkit.model_io import load_tokenizer

    return load_calibration(calib, load_tokenizer(model_dir), n_samples=samples, seqlen=seqlen,
                            seed=seed).input_ids


def llmc_artifacts(model_dir: Path, ids: torch.Tensor, work: Path, presets: dict[str, str],
                   python: str | None = None) -> tuple[dict[str, Path], dict[str, str], float]:
    """llm-compressor's artifact for each {row name: preset} (those it wrote), every preset's
    outcome ("ok" or its own error) and the seconds the reference run took."""
    t0 = time.perf_counter()
    got = run_reference(model_dir, ids, work, list(presets.values()),
                        python=Path(python) if python else None, timeout=None)
    seconds = round(time.perf_counter() - t0, 1)
    arts = {name: got[p] for name, p in presets.items() if isinstance(got[p], Path)}
    outcome = {p: "ok" if isinstance(r, Path) else r for p, r in got.items()}
    return arts, outcome, seconds


def score(arts: dict[str, Path], model: str, max_windows: int = 32,
          seconds: dict[str, float] | None = None) -> tuple[dict[str, dict], list[dict], float]:
    """One quantkit eval pass over every artifact (KLD / PPL / top-1 vs `model` on held-out
    `mixed`): rows by name, the raw records, and the pass's seconds."""
    from quantkit.eval.harness import evaluate
    from quantkit.eval.logits import PPLConvention
    from quantkit.info import artifact_info

    t0 = time.perf_counter()
    records = evaluate([str(a) for a in arts.values()], model,
                       conv=PPLConvention(max_windows=max_windows))
    eval_s = round(time.perf_counter() - t0, 1)
    rows = {}
    for (name, art), rec in zip(arts.items(), records, strict=True):
        m, info = rec["metrics"], artifact_info(art)
        rows[name] = {"kld_mean": m["kld"]["mean"], "kld_stderr": m["kld"]["stderr"],
                      "ppl": m["ppl"]["value"], "top1_agreement": m["top1_agreement"]["value"],
                      "bits_per_weight_quantized": info.get("bits_per_weight_quantized"),
                      "quantize_s": (seconds or {}).get(name)}
    return rows, records, eval_s
