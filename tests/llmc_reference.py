"""llm-compressor as the reference writer, run in its own venv (scripts/setup.sh builds it):

    LLMC_PYTHON tests/llmc_reference.py MODEL_DIR IDS.pt OUT_ROOT PRESET...

For each compressed-tensors preset (NVFP4A16, NVFP4, MXFP4A16, W8A8, ...) it runs
llm-compressor's `oneshot` with `QuantizationModifier(targets="Linear", scheme=PRESET,
ignore=["lm_head"])` on the calibration windows of IDS.pt (int64 [n, seqlen], the ones
quantkit calibrates on) and saves the compressed artifact to OUT_ROOT/PRESET;
OUT_ROOT/outcome.json records "ok" or the reference's own error per preset. A preset written
PRESET+SQ<alpha> (e.g. W8A8+SQ0.5) runs `SmoothQuantModifier(smoothing_strength=alpha)` (its
default mappings: input norm -> q/k/v, post-attention norm -> gate/up) before the
QuantizationModifier, llm-compressor's W8A8 SmoothQuant recipe. W8A8-STATIC is W8A8 with static
per-tensor int8 inputs (compressed-tensors 0.19 has no preset for it: the W8A8 preset's
weights, input_activations {int8, symmetric, strategy tensor, dynamic false}, the recipe its
int8 static examples write), whose input observer is llm-compressor's default for static
inputs ("minmax": a moving average of each batch's min / max, averaging constant 0.01);
W8A8-STATIC@OBSERVER names another (e.g. static_minmax, the running min / max its FP8 preset
uses). Static presets calibrate with shuffle_calibration_samples=False, so that the windows
reach the order-dependent moving average in a known order (equal lengths: LengthAwareSampler's
argsort). It imports nothing of quantkit (not installed there).

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
STATIC_INT8 = "W8A8-STATIC"  # W8A8 with static per-tensor int8 inputs (no preset)


def llmc_python() -> Path:
    """The reference venv's python (quantkit side: reads quantkit's cache dir)."""
    from quantkit.machine import cache_dir

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
            scheme, _, observer = scheme.partition("@")
            static = scheme == STATIC_INT8
            if static:
                recipe = [QuantizationModifier(config_groups={"group_0": _static_int8(observer)},
                                               ignore=["lm_head"])]
            else:
                recipe = [QuantizationModifier(targets="Linear", scheme=scheme,
                                               ignore=["lm_head"])]
            if alpha:
                recipe.insert(0, SmoothQuantModifier(smoothing_strength=float(alpha)))
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
            oneshot(model=model, dataset=data, num_calibration_samples=len(ids),
                    max_seq_length=ids.shape[1], recipe=recipe,
                    shuffle_calibration_samples=not static)
            model.save_pretrained(Path(out_root) / preset, save_compressed=True)
            outcome[preset] = "ok"
        except Exception as exc:  # noqa: BLE001 - the reference's own failure is the result
            outcome[preset] = f"{type(exc).__name__}: {exc}"
    (Path(out_root) / "outcome.json").write_text(json.dumps(outcome, indent=1))


def _static_int8(observer: str):
    """The W8A8 preset's scheme with static per-tensor int8 inputs (observer: the named one,
    else llm-compressor's default for static inputs)."""
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme

    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    scheme.input_activations = QuantizationArgs(
        num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False,
        **({"observer": observer} if observer else {}))
    return scheme


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
