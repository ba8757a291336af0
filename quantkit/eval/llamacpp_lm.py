"""An lm-eval LM over llama-cpp-python, so GGUF files take the same tasks as safetensors.

lm-eval's built-in `gguf` model is an HTTP client without loglikelihood_rolling; this one
calls llama.cpp in-process with logits for every position.
"""

from __future__ import annotations

import numpy as np
import torch
from lm_eval.api.model import LM

__all__ = ["LlamaCppLM"]


class LlamaCppLM(LM):
    def __init__(self, model_path: str, n_ctx: int = 2048, n_threads: int | None = None):
        super().__init__()
        from quantkit.engines.llamacpp import load_llama

        self.llm = load_llama(model_path, n_ctx=n_ctx, logits_all=True, n_threads=n_threads,
                              seed=0)
        self.n_ctx = n_ctx
        self.add_bos = self.llm._model.add_bos_token() if hasattr(self.llm, "_model") else False

    def _tok(self, text: str, bos: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=bos, special=False) if text else []

    def _eval_reusing_prefix(self, tokens: list[int]) -> None:
        """Bring llama.cpp's state to `tokens`, keeping the KV cache (and logits rows) of the
        longest prefix shared with the previous call: a multiple-choice item's continuations
        share its context, so the context is evaluated once instead of once per choice."""
        llm = self.llm
        limit = min(llm.n_tokens, len(tokens) - 1)  # at least the last token is evaluated
        same = np.asarray(llm.input_ids[:limit]) == np.asarray(tokens[:limit], dtype=np.intc)
        common = int(limit if same.all() else same.argmin())
        llm.n_tokens = common  # eval() drops the cache from here on
        llm.eval(tokens[common:])

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Sum of log p(continuation | context) and whether greedy decoding would produce it.
        Only the continuation's rows are normalised (log-sum-exp), not the whole sequence's."""
        whole = (context + continuation)[-self.n_ctx:]
        n_cont = len(continuation)
        self._eval_reusing_prefix(whole)
        end = len(whole)
        # llama.cpp's float32 logits, read in place: a rolling window's rows are ~500 x 49152,
        # and a float64 copy + exp of them cost far more per document than torch's logsumexp
        rows = torch.from_numpy(self.llm.scores[end - n_cont - 1: end - 1])
        lse = torch.logsumexp(rows, -1).double()
        cont = torch.tensor(continuation)
        picked = rows[torch.arange(n_cont), cont].double() - lse
        greedy = bool((rows.argmax(-1) == cont).all())
        return float(picked.sum()), greedy

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = req.args
            ctx = self._tok(context, bos=self.add_bos)
            whole = self._tok(context + continuation, bos=self.add_bos)
            cont = whole[len(ctx):] if whole[: len(ctx)] == ctx else self._tok(continuation)
            if not ctx:
                ctx = [self.llm.token_bos()]
            pairs.append((ctx, cont))
        # in token order, so that requests sharing a context follow each other (prefix reuse)
        order = sorted(range(len(pairs)), key=lambda i: pairs[i][0] + pairs[i][1])
        out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for i in order:
            out[i] = self._score(*pairs[i])
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
