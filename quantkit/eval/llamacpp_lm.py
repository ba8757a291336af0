"""An lm-eval LM over llama-cpp-python, so GGUF files take the same tasks as safetensors.

lm-eval's built-in `gguf` model is an HTTP client without loglikelihood_rolling; this one
calls llama.cpp in-process with logits for every position.
"""

from __future__ import annotations

import numpy as np
from lm_eval.api.model import LM

__all__ = ["LlamaCppLM"]


class LlamaCppLM(LM):
    def __init__(self, model_path: str, n_ctx: int = 2048, n_threads: int | None = None):
        super().__init__()
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, logits_all=True,
                                   n_threads=n_threads, verbose=False, seed=0)
        self.n_ctx = n_ctx
        self.add_bos = self.llm._model.add_bos_token() if hasattr(self.llm, "_model") else False

    def _tok(self, text: str, bos: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=bos, special=False) if text else []

    def _logprobs(self, tokens: list[int]) -> np.ndarray:
        """log p(token_i | tokens_<i) rows for positions 0..n-2 (next-token distributions)."""
        self.llm.reset()
        self.llm.eval(tokens)
        logits = np.asarray(self.llm.scores[: len(tokens)], dtype=np.float64)
        logits -= logits.max(-1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(-1, keepdims=True))

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        whole = (context + continuation)[-self.n_ctx:]
        n_cont = len(continuation)
        lp = self._logprobs(whole)
        start = len(whole) - n_cont
        rows = lp[start - 1: len(whole) - 1]
        picked = rows[np.arange(n_cont), continuation]
        greedy = bool((rows.argmax(-1) == np.asarray(continuation)).all())
        return float(picked.sum()), greedy

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            ctx = self._tok(context, bos=self.add_bos)
            whole = self._tok(context + continuation, bos=self.add_bos)
            cont = whole[len(ctx):] if whole[: len(ctx)] == ctx else self._tok(continuation)
            if not ctx:
                ctx = [self.llm.token_bos()]
            out.append(self._score(ctx, cont))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        """lm-eval's own rolling windows (as HFLM builds them), scored by llama.cpp."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            (text,) = req.args
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self._tok(text), prefix_token=self.llm.token_bos(),
                max_seq_len=self.n_ctx, context_len=1))
            out.append(sum(self._score(list(ctx), list(cont))[0] for ctx, cont in windows))
        return out

    def generate_until(self, requests) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            until = kwargs.get("until") or []
            max_tokens = int(kwargs.get("max_gen_toks", 256))
            res = self.llm(context, max_tokens=max_tokens, temperature=0.0, stop=until or None)
            out.append(res["choices"][0]["text"])
        return out
