"""Runs inside vLLM's own virtualenv (it imports nothing from quantkit).

Usage: python vllm_worker.py REQUEST.json RESPONSE.json
Request: {"model": dir, "dtype": "bfloat16", "max_model_len": 2048,
          "generate": [{"prompt": str, "max_tokens": int}],
          "score": [[token ids], ...], "kv_cache_dtype": "auto" | "fp8", "kv_scales": bool}
Response: {"vllm_version", "load_seconds", "dtype", "generate": [text], "kv_scales": {layer: [k, v]},
           "score": [
           {"logprobs": [float|null per position], "top1": [int|null per position]}]}
Scoring uses prompt_logprobs=1: position i holds log p(token_i | tokens_<i) and the argmax token.
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
    t0 = time.perf_counter()
    llm = LLM(model=req["model"], dtype=req.get("dtype", "bfloat16"), enforce_eager=True,
              max_model_len=req.get("max_model_len", 2048), gpu_memory_utilization=0.3,
              seed=0, trust_remote_code=False, kv_cache_dtype=req.get("kv_cache_dtype", "auto"),
              distributed_executor_backend="uni")  # one process: see quantkit.engines.vllm_venv.vllm_env
    load_seconds = time.perf_counter() - t0
    # the activation dtype vLLM settled on (what it runs, not only what was asked)
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    out = {"vllm_version": vllm.__version__, "load_seconds": load_seconds, "dtype": dtype}
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
        params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
        res = llm.generate([{"prompt_token_ids": ids} for ids in req["score"]], params,
                           use_tqdm=False)
        scored = []
        for r, ids in zip(res, req["score"], strict=True):
            lps, top1 = [], []
            for pos, entry in enumerate(r.prompt_logprobs):
                if entry is None:
                    lps.append(None)
                    top1.append(None)
                    continue
                actual = entry.get(ids[pos])
                lps.append(None if actual is None else float(actual.logprob))
                best = [tid for tid, lp in entry.items() if lp.rank == 1]
                top1.append(int(best[0]) if best else None)
            scored.append({"logprobs": lps, "top1": top1})
        out["score"] = scored
    if req.get("speed"):
        out["speed"] = _speed(llm, SamplingParams, req["speed"])
    json.dump(out, open(resp_path, "w"))


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
