"""Errors the core raises. The CLI prints message + hint and exits 2; nothing else is caught."""

from __future__ import annotations

__all__ = [
    "QuantkitError",
    "UnsupportedArchitecture",
    "SchemeMismatch",
    "CalibrationError",
    "ArtifactExists",
    "OutputPathError",
    "ModelLoadError",
    "BadWeights",
    "EngineError",
    "NotEnoughMemory",
    "RankFailed",
]


class QuantkitError(Exception):
    """An error the user can act on: `message` says what is wrong, `hint` what to do."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nHint: {self.hint}"


class UnsupportedArchitecture(QuantkitError):
    """The model's architecture has no row in quantkit.arch."""


class SchemeMismatch(QuantkitError):
    """The quantization scheme does not fit the model's shapes or the chosen format."""


class CalibrationError(QuantkitError):
    """Calibration data is missing, empty, too short or malformed."""


class ArtifactExists(QuantkitError):
    """The output path exists and --force was not given."""


class OutputPathError(QuantkitError):
    """The output path cannot be written, or writing it would destroy an input of the run."""


class ModelLoadError(QuantkitError):
    """A model directory, file, tokenizer or Hub id cannot be loaded."""


class BadWeights(QuantkitError):
    """A weight tensor holds NaN/Inf or cannot be quantized."""


class EngineError(QuantkitError):
    """An inference engine (vLLM, llama.cpp) is missing or refused the artifact."""


class NotEnoughMemory(QuantkitError):
    """The planned peak memory of a run exceeds what this machine or process may use."""


class RankFailed(QuantkitError):
    """One rank of a data-parallel run failed; every rank raises this, naming it, and nothing
    is written (quantkit.pipeline.distributed)."""
