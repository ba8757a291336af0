"""Calibration data: built-in sets (calibration_sets/) and the one shared loader.

>>> calib = load_calibration("mixed", tokenizer, n_samples=128, seqlen=512, seed=0)
>>> for batch in calib.batches(8): ...  # int64 [8, 512] windows, no BOS inserted
>>> eval_text, prov = load_heldout_text("mixed")  # never overlaps the calib split
"""

from quantkit.calibration.loader import CalibrationData, load_calibration
from quantkit.calibration.sets import DEFAULT_SET, builtin_sets, calibration_sets_dir
from quantkit.calibration.sources import load_heldout_text, load_text

__all__ = [
    "CalibrationData",
    "DEFAULT_SET",
    "builtin_sets",
    "calibration_sets_dir",
    "load_calibration",
    "load_heldout_text",
    "load_text",
]
