"""llm-compressor as the reference writer, run in its own venv (scripts/setup.sh builds it):

    LLMC_PYTHON tests/llmc_reference.py MODEL_DIR IDS.pt OUT_ROOT PRESET...

For each compressed-tensors preset (NVFP4A16, NVFP4, MXFP4A16, ...) it runs llm-compressor's
`oneshot` with `QuantizationModifier(targets="Linear", scheme=PRESET, ignore=["lm_head"])` on
the calibration windows of IDS.pt (int64 [n, seqlen], the ones quantkit calibrates on) and
saves the compressed artifact to OUT_ROOT/PRESET; OUT_ROOT/outcome.json records "ok" or the
reference's own error per preset. It imports nothing of quantkit (not installed there).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path


def main(model_dir: str, ids_file: str, out_root: str, presets: list[str]) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    ids = torch.load(ids_file)
    data = Dataset.from_dict({"input_ids": [r.tolist() for r in ids],
                              "attention_mask": [[1] * ids.shape[1] for _ in ids]})
    outcome = {}
    for preset in presets:
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
            oneshot(model=model, dataset=data, num_calibration_samples=len(ids),
                    max_seq_length=ids.shape[1],
                    recipe=QuantizationModifier(targets="Linear", scheme=preset,
                                                ignore=["lm_head"]))
            model.save_pretrained(Path(out_root) / preset, save_compressed=True)
            outcome[preset] = "ok"
        except Exception as exc:  # noqa: BLE001 - the reference's own failure is the result
            outcome[preset] = f"{type(exc).__name__}: {exc}"
    (Path(out_root) / "outcome.json").write_text(json.dumps(outcome, indent=1))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
