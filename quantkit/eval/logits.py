"""Perplexity and KL divergence on held-out text, with the convention stated in every result.

Convention (defaults; every field is recorded):
  - text: the held-out split of a calibration set (documents joined by a blank line),
    tokenized once without special tokens;
  - windows: consecutive non-overlapping chunks of `ctx` tokens (remainder dropped), at most
    `max_windows` of them, taken from the start of the text;
  - BOS: when the tokenizer itself adds a BOS token, each window is BOS + (ctx - 1) text tokens;
    otherwise (SmolLM2) a window is ctx text tokens;
  - scored tokens: every token of a window that has at least one token before it in the
    window, i.e. ctx - 1 per window; PPL = exp(mean NLL) over all scored tokens.
KLD per scored position is KL(p_base || p_quant) over the full vocabulary, in float32.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

__all__ = ["PPLConvention", "make_windows", "score", "LogitsFn"]

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # [B, T] ids -> [B, T, V] logits


@dataclass(frozen=True)
class PPLConvention:
    ctx: int = 512
    max_windows: int = 32
    batch_size: int = 4

    def describe(self, tokenizer, text_info: dict, n_windows: int, bos: bool,
                 windows: torch.Tensor | None = None) -> dict:
        """The convention as recorded with results. The tokenizer is named by its vocabulary
        and the scored tokens by their hash, never by a path: quantized copies of one model
        share a tokenizer loaded from whichever directory came first, and records of the same
        tokens must compare equal (the demo's `eval` and `compare` runs did not)."""
        return {
            **asdict(self),
            "corpus": text_info.get("name") or text_info.get("path") or text_info.get("source"),
            "split": text_info.get("split", "heldout"),
            "join": "\\n\\n between documents",
            "stride": self.ctx,
            "overlap": False,
            "bos": "BOS + ctx-1 text tokens per window" if bos else "no BOS (tokenizer adds none)",
            "windows": n_windows,
            "scored_tokens": n_windows * (self.ctx - 1),
            "scored": "every token with >= 1 preceding token in its window",
            "tokenizer": _tokenizer_id(tokenizer),
            "tokens_sha256": None if windows is None else
            hashlib.sha256(windows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest(),
            "kld": "KL(p_base || p_quant), full vocabulary, float32",
        }


def _tokenizer_id(tokenizer) -> str:
    """'<class>, <n> tokens, vocab sha256 <first 16 hex>': the same for every copy of one
    tokenizer, wherever it was loaded from."""
    if tokenizer is None:
        return ""
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]
    return f"{type(tokenizer).__name__}, {len(vocab)} tokens, vocab sha256 {digest}"


def _adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == bos


def make_windows(tokenizer, text: str, conv: PPLConvention) -> tuple[torch.Tensor, bool]:
    """[W, ctx] token windows per the convention, and whether each starts with BOS."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = _adds_bos(tokenizer)
    step = conv.ctx - 1 if bos else conv.ctx
    n = min(len(ids) // step, conv.max_windows)
    if n == 0:
        raise ValueError(f"held-out text has {len(ids)} tokens, fewer than one window of {conv.ctx}")
    chunks = torch.tensor(ids[: n * step], dtype=torch.long).view(n, step)
    if bos:
        chunks = torch.cat([torch.full((n, 1), tokenizer.bos_token_id), chunks], dim=1)
    return chunks, bos


class _Acc:
    """Running sums for one model: NLL per token and, vs the base, KLD / top-1 / delta-p."""

    def __init__(self):
        self.nll: list[torch.Tensor] = []
        self.kld: list[torch.Tensor] = []
        self.top1: list[torch.Tensor] = []
        self.dp: list[torch.Tensor] = []

    def summary(self, with_base: bool) -> dict:
        nll = torch.cat(self.nll).double()
        mean, n = nll.mean().item(), nll.numel()
        se = nll.std().item() / math.sqrt(n)
        out = {"ppl": {"value": math.exp(mean), "stderr": math.exp(mean) * se},
               "nll": {"value": mean, "stderr": se}, "scored_tokens": n}
        if with_base and self.kld:
            kld = torch.cat(self.kld).double()
            top1 = torch.cat(self.top1).double()
            dp = torch.cat(self.dp).double()
            out["kld"] = {"mean": kld.mean().item(), "stderr": kld.std().item() / math.sqrt(n),
                          "median": kld.median().item(), "p99": torch.quantile(kld.float(), 0.99).item(),
                          "max": kld.max().item()}
            p = top1.mean().item()
            out["top1_agreement"] = {"value": p, "stderr": math.sqrt(max(p * (1 - p), 0) / n)}
            out["rms_delta_p"] = {"value": dp.pow(2).mean().sqrt().item()}
        return out


# rows of one window whose log-softmax and KLD terms are computed at once: [64, vocab] float32
# temporaries (12.6 MB for a 49k vocabulary) come from the heap and are reused, where whole-batch
# [batch, ctx, vocab] ones were each a fresh mmap the kernel faulted in and zeroed (SmolLM2, 4 x
# 512 tokens, base + one artifact: far less math time per batch on the CPU, same values)
SCORE_ROWS = 64


@torch.no_grad()
def score(models: dict[str, LogitsFn], windows: torch.Tensor, *, base: str | None = None,
          batch_size: int = 4, on_progress=None) -> dict[str, dict]:
    """PPL for every model and KLD/top-1/delta-p vs `base`, one pass over the windows.

    Each window is run through every model before the next, so the base's full
    distributions never need to be stored. Per-position values are computed SCORE_ROWS
    positions at a time: each position's numbers do not depend on the chunking.
    """
    accs = {name: _Acc() for name in models}
    total = windows.shape[0]
    for start in range(0, total, batch_size):
        batch = windows[start:start + batch_size]
        targets = batch[:, 1:]
        n_pos = targets.shape[1]
        spans = [(b, s, min(s + SCORE_ROWS, n_pos))
                 for b in range(batch.shape[0]) for s in range(0, n_pos, SCORE_ROWS)]
        base_logp: list[torch.Tensor] | None = None
        order = ([base] if base else []) + [m for m in models if m != base]
        for name in order:
            logits = models[name](batch)
            acc = accs[name]
            chunks = []
            for k, (b, s, e) in enumerate(spans):
                logp = torch.log_softmax(logits[b, s:e].float(), dim=-1)
                tgt = targets[b, s:e, None]
                tok_lp = logp.gather(-1, tgt)[..., 0]
                acc.nll.append(-tok_lp)
                if name == base:
                    chunks.append(logp)
                    continue
                if base_logp is not None:
                    bl = base_logp[k]
                    acc.kld.append((bl.exp() * (bl - logp)).sum(-1).clamp_min(0))
                    acc.top1.append((logp.argmax(-1) == bl.argmax(-1)).float())
                    acc.dp.append(tok_lp.exp() - bl.gather(-1, tgt)[..., 0].exp())
            del logits
            if name == base:
                base_logp = chunks
        if on_progress:
            on_progress("scoring held-out windows", min(start + batch_size, total), total)
    return {name: acc.summary(with_base=base is not None and name != base)
            for name, acc in accs.items()}
