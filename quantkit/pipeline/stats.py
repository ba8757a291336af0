"""Per-Linear input statistics gathered by forward hooks while a block runs.

Each statistic is a running sum plus a token count, so batches can come in any size:
  hessian   sum_x x^T x           [K, K] float32  (GPTQ)
  sq_mean   sum_x x^2 per column  [K]    float32  (llama.cpp imatrix)
  absmean   sum_x |x| per column  [K]    float32  (AWQ)
"""

from __future__ import annotations

import torch

__all__ = ["StatCollector", "STATS"]

STATS = ("hessian", "sq_mean", "absmean")


class StatCollector:
    """Hooks `stats` onto `modules`; `.results[name][stat]` and `.results[name]["tokens"]`."""

    def __init__(self, modules: dict[str, torch.nn.Module], stats: tuple[str, ...]):
        unknown = set(stats) - set(STATS)
        if unknown:
            raise ValueError(f"unknown statistics {sorted(unknown)}; known: {STATS}")
        self.stats = stats
        self.results: dict[str, dict[str, torch.Tensor | int]] = {n: {"tokens": 0} for n in modules}
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str):
        def hook(_module, args, _output):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            rec = self.results[name]
            rec["tokens"] += x.shape[0]
            for stat in self.stats:
                if stat == "hessian":
                    upd = x.T @ x
                elif stat == "sq_mean":
                    upd = (x * x).sum(0)
                else:
                    upd = x.abs().sum(0)
                rec[stat] = upd if stat not in rec else rec[stat].add_(upd)
        return hook

    def close(self) -> dict[str, dict[str, torch.Tensor | int]]:
        for h in self._handles:
            h.remove()
        self._handles = []
        return self.results

    def __enter__(self) -> StatCollector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
