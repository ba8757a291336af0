"""`--gguf-type auto`: each tensor's GGML type chosen by measured sensitivity under a size budget.

Sensitivity of a tensor W [N, K] at a type t (one encode + one decode, no extra forward):

    cost(W, t) = sum_j imatrix_j * sum_i (W_ij - deq(enc_t(W))_ij)^2

imatrix_j is the mean of x_j^2 over the calibration tokens reaching this Linear (llama.cpp's
importance matrix, from the shared pipeline or an imatrix file), so cost is E_x ||(W - W_t) x||^2
under a diagonal input covariance: the squared output error per token this tensor adds when
quantized at t, the same quantity llama.cpp's imatrix-weighted encoders minimise inside one
tensor. The encoder runs with that imatrix, so the bytes measured are the bytes written.
The choice is made by the format-neutral solver in quantkit.methods.bit_allocation.

token_embd and output are chosen in the same solve (GGUFQuantizer._measure_outside):
output's cost is the same imatrix-weighted error with the imatrix of its input (the final
norm's output), scaled to block-output units by its measured KLD gain; token_embd is a lookup,
so its cost is the squared error of the rows calibration looks up (by frequency, plus a
uniform share), scaled by block 0's measured response to it. Both from a row sample
(ROW_SAMPLE); the solver tries every combination of their options (OUTSIDE).

Candidate types: AUTO_CANDIDATES, each mapped through llama.cpp's row-width fallback
(Q4_K on 576-wide rows is written as Q5_0, ...), so sizes are the exact bytes of what the
writer stores for that shape; rows that are not a multiple of 256 wide also try Q4_1.
"""

from __future__ import annotations

import math

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from quantkit.errors import SchemeMismatch
from quantkit.methods.bit_allocation import Option, allocate, budget_range, hull, pareto

__all__ = ["AUTO_CANDIDATES", "written_type", "tensor_bytes", "candidate_types", "measure_options",
           "Budget", "allocate", "Option", "nearest_type", "sample_rows", "row_errors",
           "lookup_weights", "mean_klds", "pareto", "hull", "ROW_SAMPLE", "SEEN_SHARE", "KLD_TOKENS",
           "OUTSIDE"]

Q = GGMLQuantizationType
AUTO_CANDIDATES = (Q.Q2_K, Q.Q3_K, Q.IQ4_XS, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0)
# rows that are not a multiple of 256 wide have only the 32-wide types: the fallbacks of the
# candidates above (Q4_0, IQ4_NL, Q5_0, Q5_1, Q8_0) and Q4_1, which fills the 4.5 -> 5.5 gap
NARROW_EXTRA = (Q.Q4_1,)


def written_type(t: Q, ncols: int, fallback: dict[Q, Q]) -> Q:
    """What llama.cpp writes for type t on rows of `ncols`: t, its fallback, else F16."""
    if ncols % GGML_QUANT_SIZES[t][0]:
        t = fallback.get(t, t)
        if ncols % GGML_QUANT_SIZES[t][0]:
            t = Q.F16
    return t


def tensor_bytes(t: Q, shape: tuple[int, ...]) -> int:
    """Exact bytes of a tensor of `shape` (rows of shape[-1]) stored as GGML type t."""
    block, size = GGML_QUANT_SIZES[t]
    return math.prod(shape[:-1]) * (shape[-1] // block) * size


def candidate_types(shape: tuple[int, ...], fallback: dict[Q, Q]) -> list[Q]:
    """The distinct written types of AUTO_CANDIDATES for this shape, smallest first."""
    types = {written_type(t, shape[-1], fallback) for t in AUTO_CANDIDATES}
    if shape[-1] % 256:
        types |= {t for t in NARROW_EXTRA if shape[-1] % GGML_QUANT_SIZES[t][0] == 0}
    return sorted(types, key=lambda t: tensor_bytes(t, shape))


def measure_options(w: torch.Tensor, types: list[Q], imatrix: torch.Tensor | None, encode, decode
                    ) -> tuple[list[Option], dict[str, torch.Tensor], dict[str, float]]:
    """Encode w at every type; return the options on the lower convex hull of (bytes, cost),
    the bytes of those options (the others are dropped at once: they are never chosen) and
    each kept option's relative error ||W - W_t|| / ||W||.

    encode(w, t, imatrix) -> bytes, decode(bytes, t) -> float32 weights (the quantizer's own).
    Without an imatrix every column weighs 1 (the plain squared error)."""
    w32 = w.detach().float()
    imp = (torch.ones(w32.shape[1], dtype=torch.float64, device=w32.device) if imatrix is None
           else imatrix.to(device=w32.device, dtype=torch.float64).reshape(-1))
    norm = float(w32.double().norm()) or 1e-30
    options, data, rel = [], {}, {}
    for t in types:
        b = encode(w32, t, imatrix)
        col = (decode(b, t).to(w32.device) - w32).double().square().sum(0)
        options.append(Option(t.name, int(b.numel()), float((col * imp).sum())))
        data[t.name] = b
        rel[t.name] = math.sqrt(float(col.sum())) / norm
    kept = hull(options)
    labels = {o.label for o in kept}
    return kept, {k: v for k, v in data.items() if k in labels}, {k: rel[k] for k in labels}


# token_embd / output (vocab rows): the costs of every candidate come from a sample of rows
# (vocab 49k-256k rows x 7 types is tens of seconds of encoding; a row's encoding does not
# depend on the other rows, and the summed error of 4096 evenly spread rows estimates the
# whole tensor's to a few %, while the candidates' costs differ by factors of 2-4); only the
# chosen type (and the ~4.5-bit reference of the output's gain) is encoded whole
ROW_SAMPLE = 2048
# token_embd's row weights: this share by calibration token frequency, the rest uniform (rows
# the calibration text never looked up are still looked up by other text)
SEEN_SHARE = 0.9
# tokens whose logits measure the output head's KLD gain (3 passes over the vocabulary)
KLD_TOKENS = 512
# the tensors outside the blocks: few and (on small models) most of the bytes, so the solver
# tries every combination of their options (bit_allocation.allocate's `whole`)
OUTSIDE = ("token_embd.weight", "output.weight")


def nearest_type(types: list[Q], shape: tuple[int, ...], bits: float = 4.5) -> Q:
    """The type whose bits per weight on this shape are nearest `bits` (the gains' reference)."""
    n = math.prod(shape)
    return min(types, key=lambda t: abs(8 * tensor_bytes(t, shape) / n - bits))


def sample_rows(n_rows: int, k: int = ROW_SAMPLE) -> torch.Tensor:
    """Every ceil(n/k)-th row: spread evenly over the vocabulary, whose ids are ordered
    (byte tokens, then BPE merges by rank), so a stride sees every kind of token."""
    return torch.arange(0, n_rows, max(1, -(-n_rows // k)))


def row_errors(rows: torch.Tensor, types: list[Q], imatrix: torch.Tensor | None, encode, decode
               ) -> dict[Q, tuple[torch.Tensor, torch.Tensor]]:
    """Per type: (squared error per row, imatrix-weighted squared error per row), float64 [R].
    The encoder gets the imatrix (what would be written); without one both are the plain error."""
    w32 = rows.detach().float()
    out = {}
    for t in types:
        sq = (decode(encode(w32, t, imatrix), t).to(w32.device) - w32).double().square()
        plain = sq.sum(1)
        weighted = plain if imatrix is None else \
            (sq * imatrix.to(sq.device, torch.float64).reshape(1, -1)).sum(1)
        out[t] = (plain.cpu(), weighted.cpu())
    return out


def lookup_weights(rows: torch.Tensor, uniform: torch.Tensor, counts: torch.Tensor | None
                   ) -> torch.Tensor:
    """Weight of each of `rows` (sorted ids) in token_embd's cost E_token ||E_q[id] - E[id]||^2:
    SEEN_SHARE by calibration frequency (counts [V]) plus the rest spread over the `uniform`
    sample (standing for every row); without counts, the uniform sample alone."""
    in_uniform = torch.isin(rows, uniform).double()
    if counts is None or float(counts.sum()) <= 0:
        return in_uniform / len(uniform)
    freq = counts.double()[rows] / float(counts.sum())
    return SEEN_SHARE * freq + (1 - SEEN_SHARE) * in_uniform / len(uniform)


def mean_klds(x: torch.Tensor, w: torch.Tensor, perturbed: list[tuple[torch.Tensor, torch.Tensor]],
              chunk: int = 128) -> list[float]:
    """Mean over tokens of KL(softmax(x w^T) || softmax(x' w'^T)) for each (x', w') in
    `perturbed`: the head's logits with a perturbed input or weight. float64 softmax (the
    KLDs of a 6-bit head are ~1e-5), the reference's once per chunk."""
    totals = [0.0] * len(perturbed)
    for i in range(0, x.shape[0], chunk):
        p = torch.log_softmax((x[i:i + chunk] @ w.T).double(), -1)
        pe = p.exp()
        for k, (xq, wq) in enumerate(perturbed):
            q = torch.log_softmax((xq[i:i + chunk] @ wq.T).double(), -1)
            totals[k] += float((pe * (p - q)).sum())
    return [t / max(1, x.shape[0]) for t in totals]


class Budget:
    """The byte budget of the tensors auto chooses, from --target-bpw or --target-size.

    target_bpw counts every weight matrix of the file (block Linears, token_embd, output; all
    of them chosen by auto):
    8 * their bytes / their weights, what `quantkit info` shows as "Linears +
    embeddings/output". target_size counts the whole file: the fixed tensors, the 1-D
    tensors and the metadata (`overhead_bytes`, estimated by the writer) come off it first.
    """

    def __init__(self, target_bpw: float | None, target_size: int | None):
        if (target_bpw is None) == (target_size is None):
            raise SchemeMismatch("--gguf-type auto needs exactly one size budget: --target-bpw "
                                 "or --target-size.",
                                 "e.g. --target-bpw 4.5, or --target-size 80MB.")
        if target_bpw is not None and not target_bpw > 0:
            raise SchemeMismatch(f"--target-bpw must be > 0, got {target_bpw}.", "e.g. --target-bpw 4.5.")
        if target_size is not None and not target_size > 0:
            raise SchemeMismatch(f"--target-size must be > 0, got {target_size}.", "e.g. --target-size 80MB.")
        self.target_bpw, self.target_size = target_bpw, target_size

    def for_choice(self, matrix_params: int, fixed_bytes: int, overhead_bytes: int) -> int:
        """Bytes left for the chosen tensors."""
        if self.target_bpw is not None:
            return int(self.target_bpw * matrix_params // 8) - fixed_bytes
        return int(self.target_size) - fixed_bytes - overhead_bytes

    def describe(self) -> str:
        return (f"--target-bpw {self.target_bpw}" if self.target_bpw is not None
                else f"--target-size {self.target_size} bytes")

    def check(self, sizes: dict[str, list[int]], matrix_params: int, fixed_bytes: int,
              overhead_bytes: int) -> int:
        """The budget for the chosen tensors; refuse one outside what the candidates can make."""
        lo, hi = budget_range({n: [Option("", s, 0.0) for s in v] for n, v in sizes.items()})
        budget = self.for_choice(matrix_params, fixed_bytes, overhead_bytes)
        if lo <= budget <= hi:
            return budget
        if self.target_bpw is not None:
            lo_b, hi_b = (8 * (x + fixed_bytes) / matrix_params for x in (lo, hi))
            possible = f"{lo_b:.3f} to {hi_b:.3f} bits per weight"
            hint = f"Pass a --target-bpw from {math.ceil(lo_b * 1000) / 1000:.3f} to {hi_b:.3f}"
        else:
            lo_s, hi_s = (x + fixed_bytes + overhead_bytes for x in (lo, hi))
            possible = f"{lo_s:,} to {hi_s:,} bytes ({lo_s / 1e6:.1f} to {hi_s / 1e6:.1f} MB)"
            hint = f"Pass a --target-size from {lo_s} to {hi_s} bytes"
        side = "below the smallest" if budget < lo else "above the largest"
        raise SchemeMismatch(
            f"{self.describe()} is {side} file the auto candidates "
            f"({', '.join(t.name for t in AUTO_CANDIDATES)}, with llama.cpp's row-width "
            f"fallbacks) can make for this model: {possible} are possible.",
            hint + (", or a fixed --gguf-type (q8_0, f16, bf16) for a bigger file." if budget > lo
                    else ", or a smaller model."))
