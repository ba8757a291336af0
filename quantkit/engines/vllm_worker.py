"""Runs inside vLLM's own virtualenv (it imports nothing from quantkit).

Usage: python vllm_worker.py REQUEST.json RESPONSE.json
Request: {"model": dir, "dtype": "bfloat16", "max_model_len": 2048,
          "generate": [{"prompt": str, "max_tokens": int}],
          "score": [[token ids], ...], "kv_cache_dtype": "auto" | "fp8", "kv_scales": bool,
          "score_topk": int (default 1), "track_weights": bool}
Response: {"vllm_version", "load_seconds", "dtype", "generate": [text], "kv_scales": {layer: [k, v]},
           "score": [
           {"logprobs": [float|null per position], "top1": [int|null per position],
            "top": [[[id, logprob] x score_topk] | null per position] (score_topk > 1 only)}],
           "weights": {"given", "loaded", "params", "unfilled", "packed", "kernels"} (track_weights)}
Scoring uses prompt_logprobs=score_topk: position i holds log p(token_i | tokens_<i), the argmax
token and the top-k tokens with their log-probs.
track_weights: the checkpoint names vLLM's loader was given, the parameter names the model's
load_weights says it filled, every parameter, and those left unfilled (vLLM's own
track_weights_loading exemptions applied: it runs that check only for unquantized models).
"""

import json
import os
import sys
import time

# this folder holds quantkit/engines/vllm.py; keep it from shadowing the real vllm package
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def main(req_path: str, resp_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm import LLM, SamplingParams

    req = json.load(open(req_path))
    tracked = track_weights() if req.get("track_weights") else None
    t0 = time.perf_counter()
    llm = LLM(model=req["model"], dtype=req.get("dtype", "bfloat16"), enforce_eager=True,
              max_model_len=req.get("max_model_len", 2048), gpu_memory_utilization=0.3,
              seed=0, trust_remote_code=False, kv_cache_dtype=req.get("kv_cache_dtype", "auto"),
              distributed_executor_backend="uni")  # one process: see quantkit.engines.vllm_venv.vllm_env
    load_seconds = time.perf_counter() - t0
    # the activation dtype vLLM settled on (what it runs, not only what was asked)
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    out = {"vllm_version": vllm.__version__, "load_seconds": load_seconds, "dtype": dtype}
    if tracked is not None:
        tracked["kernels"] = llm.apply_model(_kernels)[0]
        out["weights"] = tracked
    if req.get("kv_scales"):  # the k/v scales vLLM's attention layers use (one float each)
        def scales(model):
            return {n: [m._k_scale_float, m._v_scale_float] for n, m in model.named_modules()
                    if hasattr(m, "_k_scale_float")}
        out["kv_scales"] = llm.apply_model(scales)[0]
    if req.get("generate"):
        prompts = [g["prompt"] for g in req["generate"]]
        params = [SamplingParams(temperature=0.0, max_tokens=g.get("max_tokens", 16))
                  for g in req["generate"]]
        res = llm.generate(prompts, params, use_tqdm=False)
        out["generate"] = [r.outputs[0].text for r in res]
    if req.get("score"):
        topk = int(req.get("score_topk") or 1)
        params = SamplingParams(max_tokens=1, prompt_logprobs=topk, temperature=0.0)
        res = llm.generate([{"prompt_token_ids": ids} for ids in req["score"]], params,
                           use_tqdm=False)
        scored = []
        for r, ids in zip(res, req["score"], strict=True):
            lps, top1, top = [], [], []
            for pos, entry in enumerate(r.prompt_logprobs):
                if entry is None:
                    lps.append(None)
                    top1.append(None)
                    top.append(None)
                    continue
                top.append([[int(tid), float(lp.logprob)] for tid, lp in entry.items()])
                actual = entry.get(ids[pos])
                lps.append(None if actual is None else float(actual.logprob))
                best = [tid for tid, lp in entry.items() if lp.rank == 1]
                top1.append(int(best[0]) if best else None)
            scored.append({"logprobs": lps, "top1": top1, **({"top": top} if topk > 1 else {})})
        out["score"] = scored
    if req.get("speed"):
        out["speed"] = _speed(llm, SamplingParams, req["speed"])
    json.dump(out, open(resp_path, "w"))


def track_weights() -> dict:
    """Wrap vLLM's default loader so the load records what it read and what it filled."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    tracked: dict = {}
    original = DefaultModelLoader.load_weights

    def load_weights(self, model, model_config):
        given, real_all = [], self.get_all_weights
        real_load = model.load_weights

        def get_all_weights(mc, m):
            for name, tensor in real_all(mc, m):
                given.append(name)
                yield name, tensor

        def model_load_weights(weights):
            loaded = real_load(weights)
            tracked["loaded"] = None if loaded is None else sorted(loaded)
            return loaded

        # a parameter counts as filled when its own weight loader took a tensor, too: some
        # model files (granitemoehybrid.py's quantized experts) load through it without
        # adding the name to the set load_weights returns
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        called: set[str] = set()
        wrapped = []
        for pname, param in model.named_parameters():
            loader = getattr(param, "weight_loader", None)
            # the default loader stays itself: model files compare with it (llama4.py,
            # gpt_oss.py) and its loads are in load_weights' own set
            if callable(loader) and loader is not default_weight_loader:
                def recording(*args, _loader=loader, _name=pname, **kwargs):
                    result = _loader(*args, **kwargs)
                    if result is not False:  # FusedMoE's return_success=False: not its shard
                        called.add(_name)
                    return result
                param.weight_loader = recording
                wrapped.append((param, loader))
        self.get_all_weights, model.load_weights = get_all_weights, model_load_weights
        try:
            original(self, model, model_config)
        finally:
            del self.get_all_weights
            model.__dict__.pop("load_weights", None)
            for param, loader in wrapped:
                param.weight_loader = loader
        params = sorted(name for name, _ in model.named_parameters())
        tracked.update(given=given, params=params,
                       packed={k: list(v) for k, v in
                               (getattr(model, "packed_modules_mapping", None) or {}).items()})
        if tracked.get("loaded") is not None:
            filled = set(tracked["loaded"]) | called
            try:  # adds the parameters vLLM exempts (KV-cache scales, config-built ones)
                self.track_weights_loading(model, filled,
                                           quantized=model_config.quantization is not None)
            except ValueError:
                pass
            tracked["unfilled"] = sorted(set(params) - filled)

    DefaultModelLoader.load_weights = load_weights
    return tracked


def _kernels(model) -> dict:
    """{quant method / scheme / kernel class names: number of modules} of the loaded model."""
    found: dict = {}
    for _name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        parts = [type(method).__name__]
        scheme = getattr(module, "scheme", None)
        if scheme is not None:
            parts.append(type(scheme).__name__)
        kernel = getattr(scheme, "kernel", None) or getattr(method, "kernel", None)
        if kernel is not None:
            parts.append(type(kernel).__name__)
        experts = getattr(method, "experts_cls", None)  # a FusedMoE method's experts kernel
        if isinstance(experts, type):
            parts.append(experts.__name__)
        key = " / ".join(parts)
        found[key] = found.get(key, 0) + 1
    return found


def _speed(llm, SamplingParams, cfg: dict) -> dict:
    """Prefill / decode tokens/s and time to first token, per batch size, median of repeats
    (fewer once a batch size's timed runs have taken `repeat_budget_s` seconds)."""
    import random
    import statistics
    import threading

    import psutil

    peak = [0]
    stop = threading.Event()

    def watch():  # RSS of this process and the engine core it spawned
        me = psutil.Process()
        while not stop.is_set():
            try:
                rss = me.memory_info().rss + sum(c.memory_info().rss for c in me.children(True))
                peak[0] = max(peak[0], rss)
            except psutil.Error:
                pass
            stop.wait(0.1)

    threading.Thread(target=watch, daemon=True).start()
    rng = random.Random(0)
    p_len, g_len = cfg["prompt_tokens"], cfg["gen_tokens"]
    result = {}
    for batch in cfg["batches"]:
        prompts = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(p_len)]}
                   for _ in range(batch)]
        first = SamplingParams(max_tokens=1, temperature=0.0)
        full = SamplingParams(max_tokens=g_len, min_tokens=g_len, ignore_eos=True, temperature=0.0)
        llm.generate(prompts, first, use_tqdm=False)  # warm-up
        ttft, total = [], []
        budget = cfg.get("repeat_budget_s", float("inf"))  # as quantkit.eval.speed._time_runs
        while len(ttft) < cfg["repeats"] and (not ttft or sum(ttft) + sum(total) < budget):
            t0 = time.perf_counter()
            llm.generate(prompts, first, use_tqdm=False)
            ttft.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            llm.generate(prompts, full, use_tqdm=False)
            total.append(time.perf_counter() - t0)
        pre = [batch * p_len / t for t in ttft]
        dec = [batch * (g_len - 1) / max(tt - t1, 1e-9) for tt, t1 in zip(total, ttft, strict=True)]
        result[f"batch_{batch}"] = {
            name: {"median": statistics.median(v), "min": min(v), "max": max(v), "values": v}
            for name, v in (("prefill_tok_s", pre), ("decode_tok_s", dec), ("ttft_s", ttft))}
    stop.set()
    result["peak_rss_bytes"] = peak[0]
    return result


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
