"""llm-compressor as the reference writer, run in its own venv (scripts/setup.sh builds it):

    LLMC_PYTHON tests/llmc_reference.py MODEL_DIR IDS.pt OUT_ROOT PRESET...

For each compressed-tensors preset (NVFP4A16, NVFP4, MXFP4A16, W8A8, ...) it runs
llm-compressor's `oneshot` with `QuantizationModifier(targets="Linear", scheme=PRESET,
ignore=["lm_head"])` on the calibration windows of IDS.pt (int64 [n, seqlen], the ones
quantkit calibrates on) and saves the compressed artifact to OUT_ROOT/PRESET;
OUT_ROOT/outcome.json records "ok" or the reference's own error per preset. A preset written
PRESET+SQ<alpha> (e.g. W8A8+SQ0.5) runs `SmoothQuantModifier(smoothing_strength=alpha)` (its
default mappings: input norm -> q/k/v, post-attention norm -> gate/up) before the
QuantizationModifier, llm-compressor's W8A8 SmoothQuant recipe. It imports nothing of quantkit
(not installed there).

From quantkit's own venv, `run_reference` saves the windows, runs this file in the reference
venv and returns the artifacts (with the model's tokenizer copied in, so that quantkit's
loader and eval read them as well).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

LLMC_VENV = "llmcompressor-0.14.0.1"  # scripts/setup.sh builds it under $QK_CACHE/venvs
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def llmc_python() -> Path:
    """The reference venv's python (quantkit side: reads quantkit's cache dir)."""
    from quantkit.model_io import cache_dir

    python = cache_dir() / "venvs" / LLMC_VENV / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(f"llm-compressor venv missing at {python}: run scripts/setup.sh")
    return python


def run_reference(model_dir: Path, ids, root: Path, presets: list[str], *,
                  python: Path | None = None, timeout: int | None = 900) -> dict[str, Path | str]:
    """Run llm-compressor on `ids` (int64 [n, seqlen]) for each preset under root/llmc:
    preset -> its artifact directory, or the reference's own error message."""
    import shutil
    import subprocess

    import torch

    root = Path(root)
    ref_root = root / "llmc"
    ref_root.mkdir(parents=True, exist_ok=True)
    torch.save(ids, root / "ids.pt")
    proc = subprocess.run([str(python or llmc_python()), __file__, str(model_dir),
                           str(root / "ids.pt"), str(ref_root), *presets],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"llm-compressor reference failed:\n{proc.stderr[-3000:]}")
    outcome = json.loads((ref_root / "outcome.json").read_text())
    out: dict[str, Path | str] = {}
    for preset in presets:
        if outcome.get(preset) != "ok":
            out[preset] = outcome.get(preset, "no outcome recorded")
            continue
        out[preset] = ref_root / preset
        for f in TOKENIZER_FILES:
            if (Path(model_dir) / f).is_file():
                shutil.copy2(Path(model_dir) / f, out[preset] / f)
    return out


def main(model_dir: str, ids_file: str, out_root: str, presets: list[str]) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
    from transformers import AutoModelForCausalLM

    ids = torch.load(ids_file)
    data = Dataset.from_dict({"input_ids": [r.tolist() for r in ids],
                              "attention_mask": [[1] * ids.shape[1] for _ in ids]})
    outcome = {}
    for preset in presets:
        try:
            scheme, _, alpha = preset.partition("+SQ")
            recipe = [QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])]
            if alpha:
                recipe.insert(0, SmoothQuantModifier(smoothing_strength=float(alpha)))
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
            oneshot(model=model, dataset=data, num_calibration_samples=len(ids),
                    max_seq_length=ids.shape[1], recipe=recipe)
            model.save_pretrained(Path(out_root) / preset, save_compressed=True)
            outcome[preset] = "ok"
        except Exception as exc:  # noqa: BLE001 - the reference's own failure is the result
            outcome[preset] = f"{type(exc).__name__}: {exc}"
    (Path(out_root) / "outcome.json").write_text(json.dumps(outcome, indent=1))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
