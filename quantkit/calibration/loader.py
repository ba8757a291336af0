"""The one calibration-data loader every method (GPTQ, AWQ, ...) uses.

Why one loader: calibration data decides quantization quality, so how it is read, tokenized
and sampled must be identical across methods and recorded in each artifact's provenance.

Sampling: the whole text (documents joined with a blank line) is tokenized once with
`add_special_tokens=False` -- no BOS/EOS is inserted, windows are raw slices of the token
stream -- then `n_samples` windows of exactly `seqlen` tokens start at offsets drawn
uniformly (windows may overlap) from `torch.Generator().manual_seed(seed)`. Same text,
tokenizer and seed give the same tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from quantkit.calibration.sets import DEFAULT_SET
from quantkit.calibration.sources import load_text
from quantkit.errors import CalibrationError

__all__ = ["CalibrationData", "load_calibration", "tokenize_text", "sample_windows"]


@dataclass
class CalibrationData:
    """Token windows for calibration plus where they came from."""

    input_ids: torch.Tensor  # int64 [n_samples, seqlen]
    provenance: dict = field(default_factory=dict)

    @property
    def n_samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seqlen(self) -> int:
        return int(self.input_ids.shape[1])

    def __len__(self) -> int:
        return self.n_samples

    def batches(self, batch_size: int = 1) -> Iterator[torch.Tensor]:
        """Consecutive [<=batch_size, seqlen] slices, in sample order."""
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        for start in range(0, self.n_samples, batch_size):
            yield self.input_ids[start : start + batch_size]


def tokenize_text(text: str, tokenizer: Any) -> torch.Tensor:
    """Token ids of the whole text, int64 [n_tokens], no special tokens added."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.as_tensor(ids, dtype=torch.int64).flatten()


def sample_windows(ids: torch.Tensor, n_samples: int, seqlen: int, seed: int) -> torch.Tensor:
    """`n_samples` windows of `seqlen` tokens at seeded random offsets: [n_samples, seqlen]."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seqlen + 1, (n_samples,), generator=gen)
    return ids[starts[:, None] + torch.arange(seqlen)[None, :]].contiguous()


def load_calibration(
    source: str = DEFAULT_SET,
    tokenizer: Any = None,
    n_samples: int = 128,
    seqlen: int = 512,
    seed: int = 0,
    chat: bool = False,
    text_column: str | None = None,
) -> CalibrationData:
    """Calibration windows from a built-in set (calib split), a local file or an hf: dataset."""
    if tokenizer is None:
        raise CalibrationError("load_calibration needs a tokenizer", "pass the model's tokenizer")
    if n_samples < 1 or seqlen < 1:
        raise CalibrationError(
            f"n_samples ({n_samples}) and seqlen ({seqlen}) must both be at least 1",
            "pass a positive --calib-samples and --calib-seqlen",
        )
    text, prov = load_text(source, "calib", text_column=text_column, tokenizer=tokenizer, chat=chat)
    ids = tokenize_text(text, tokenizer)
    n_tokens = ids.numel()
    where = prov.get("name", source)
    if n_tokens < seqlen:
        raise CalibrationError(
            f"calibration text has {n_tokens} tokens, fewer than one sample of seqlen {seqlen} "
            f"({where})",
            "pass a longer calibration file or a shorter --calib-seqlen",
        )
    if n_tokens < n_samples * seqlen:
        raise CalibrationError(
            f"calibration text has {n_tokens} tokens, fewer than the {n_samples} x {seqlen} = "
            f"{n_samples * seqlen} requested ({where}): the source is shorter than requested",
            f"pass fewer --calib-samples (at most {n_tokens // seqlen} at this seqlen), "
            "a shorter --calib-seqlen, or a longer calibration source",
        )
    input_ids = sample_windows(ids, n_samples, seqlen, seed)
    prov.update(
        n_samples=n_samples,
        seqlen=seqlen,
        seed=seed,
        n_tokens=n_tokens,
        tokenizer=getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__,
        sampling="uniform random window starts, torch.Generator().manual_seed(seed); "
        "no BOS inserted; add_special_tokens=False",
    )
    return CalibrationData(input_ids=input_ids, provenance=prov)
