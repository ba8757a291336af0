"""`quantkit eval`: one harness, one results schema (quantkit.eval/v1, see eval/schema.json)."""

from __future__ import annotations

import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

import quantkit
from quantkit.calibration import load_heldout_text
from quantkit.errors import QuantkitError
from quantkit.eval.logits import PPLConvention, make_windows, score
from quantkit.info import artifact_info
from quantkit.loader import load_artifact

__all__ = ["evaluate", "SCHEMA", "hardware"]

SCHEMA = "quantkit.eval/v1"


def hardware() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "python": sys.version.split()[0],
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _logits_fn(model):
    return lambda ids: model(input_ids=ids, use_cache=False).logits


def evaluate(artifacts: list[str], base: str | None = None, *, heldout: str = "mixed",
             conv: PPLConvention | None = None, on_progress=None, command: str = "") -> list[dict]:
    """Results records, one per artifact, sharing one pass of the base model over the text."""
    conv = conv or PPLConvention()
    loaded = {a: load_artifact(a) for a in artifacts}
    base_loaded = load_artifact(base) if base else None
    tok = (base_loaded or next(iter(loaded.values()))).tokenizer
    for a, lm in loaded.items():
        if lm.tokenizer.get_vocab() != tok.get_vocab():
            raise QuantkitError(f"{a} and the base model use different tokenizers; KLD needs one.",
                                "Compare an artifact against the model it was quantized from.")
    text, text_info = load_heldout_text(heldout)
    windows, bos = make_windows(tok, text, conv)
    fns = {a: _logits_fn(lm.model) for a, lm in loaded.items()}
    if base_loaded is not None:
        fns["__base__"] = _logits_fn(base_loaded.model)
    scores = score(fns, windows, base="__base__" if base_loaded else None,
                   batch_size=conv.batch_size, on_progress=on_progress)
    convention = conv.describe(tok, text_info, windows.shape[0], bos)
    records = []
    for a in artifacts:
        s = scores[a]
        metrics = {k: v for k, v in s.items() if k != "scored_tokens"}
        if base_loaded is not None:
            metrics["base_ppl"] = scores["__base__"]["ppl"]
        records.append({
            "schema": SCHEMA,
            "quantkit_version": quantkit.__version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "artifact": artifact_info(loaded[a].path),
            "base": artifact_info(base_loaded.path) if base_loaded else None,
            "engine": {"name": "quantkit-torch", "version": torch.__version__,
                       "dtype": "float32", "device": "cpu",
                       "note": "quantkit's loader: stored weights dequantized exactly"},
            "hardware": hardware(),
            "convention": convention,
            "heldout": text_info,
            "metrics": metrics,
            "command": command,
        })
    return records
