"""Speed and memory of an artifact in the engine it is meant for.

Definitions (the same for every engine; recorded with the numbers):
  ttft_s          wall time of a request for 1 new token after a prompt of `prompt_tokens`
  prefill_tok_s   batch * prompt_tokens / ttft_s
  decode_tok_s    batch * (gen_tokens - 1) / (time for gen_tokens new tokens - ttft_s)
Random prompt token ids (seeded), greedy, EOS ignored; one warm-up run, then `repeats` runs,
or fewer (at least one) once a batch size's timed runs have taken `repeat_budget_s` seconds:
median, min, max and all values are kept. Peak memory is the resident set size of the engine's
process tree, sampled every 0.1 s: llama.cpp and vLLM each run in a process of their own, so
what the caller holds (torch, models it evaluated) is not counted.

Where an engine cannot run an artifact, `speed_or_reason` keeps the engine's own refusal as one
short phrase (`unmeasured_reason`) instead of a number, so a report can say why.
"""

from __future__ import annotations

import multiprocessing
import random
import re
import statistics
import subprocess
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import psutil

from quantkit.errors import QuantkitError

__all__ = ["REPEAT_BUDGET_S", "measure_speed", "speed_or_reason", "speed_settings", "unmeasured_reason",
           "default_engine", "vllm_blocker", "ENGINES"]

ENGINES = ("vllm", "llamacpp", "transformers")

REPEAT_BUDGET_S = 15.0
"""Timed runs of one batch size stop repeating after this many seconds: a path that decodes at
~2 tok/s (vLLM's FP8 Linears on an AVX2 CPU: ~18 s a run) is timed once instead of three times,
which cost the demo's `compare --speed` ~80 s; a run that long already averages 31 decode steps."""


def default_engine(artifact: str) -> str:
    if str(artifact).endswith(".gguf"):
        return "llamacpp"
    return "vllm"


def vllm_blocker(artifact: str) -> str | None:
    """Why vLLM cannot run `artifact` here, or cannot time it in reasonable time (the engine
    probe, before any work), or None.
    A model alias or directory without a quantization scheme is a dense model: it needs only
    a vLLM that starts."""
    from quantkit.engines.capabilities import (
        vllm_artifact_moe,
        vllm_cannot_run,
        vllm_capabilities,
        vllm_too_slow_to_time,
    )

    path = Path(str(artifact))
    if path.suffix == ".gguf":
        return vllm_cannot_run("gguf")
    scheme, experts = None, None
    if path.is_dir():
        from quantkit.loader import artifact_meta

        scheme = artifact_meta(path).get("scheme")
        experts = vllm_artifact_moe(path)
    if scheme:
        return (vllm_cannot_run(scheme, experts=experts)
                or vllm_too_slow_to_time(scheme))
    caps = vllm_capabilities()
    return None if caps.available else f"vLLM cannot start here ({caps.error.rstrip('.')})"


class _PeakRSS:
    """Peak RSS of this process and its children, or (children_only) of the engine processes
    this one started."""

    def __init__(self, children_only: bool = False):
        self.peak = 0
        self.children_only = children_only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        me = psutil.Process()
        while not self._stop.is_set():
            try:
                own = 0 if self.children_only else me.memory_info().rss
                self.peak = max(self.peak, own + sum(
                    c.memory_info().rss for c in me.children(recursive=True)))
            except psutil.Error:
                pass
            self._stop.wait(0.1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def _time_runs(run_first, run_full, batch: int, p_len: int, g_len: int, repeats: int,
               budget_s: float) -> dict:
    run_full()  # warm-up
    ttft, total = [], []
    while len(ttft) < repeats and (not ttft or sum(ttft) + sum(total) < budget_s):
        t0 = time.perf_counter()
        run_first()
        ttft.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        run_full()
        total.append(time.perf_counter() - t0)
    return {"prefill_tok_s": _stats([batch * p_len / t for t in ttft]),
            "decode_tok_s": _stats([batch * (g_len - 1) / max(tt - t1, 1e-9)
                                    for tt, t1 in zip(total, ttft, strict=True)]),
            "ttft_s": _stats(ttft)}


def _prompts(batch: int, p_len: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 20000) for _ in range(p_len)] for _ in range(batch)]


def _llamacpp(artifact: str, p_len: int, g_len: int, batches: list[int], repeats: int,
              budget_s: float) -> dict:
    from quantkit.engines.llamacpp import load_llama
    from quantkit.readers import read_gguf

    read_gguf(artifact)  # before the clock starts: load_seconds is llama.cpp's load alone
    with _PeakRSS() as mem:
        t0 = time.perf_counter()
        llm = load_llama(artifact, n_ctx=p_len + g_len + 8, seed=0, header_checked=True)
        load = time.perf_counter() - t0
        out = {"load_seconds": load}
        eos = llm.token_eos()
        for batch in batches:
            if batch != 1:
                out[f"batch_{batch}"] = None  # llama-cpp-python runs one sequence at a time
                continue
            (prompt,) = _prompts(1, p_len)

            def first(prompt=prompt):
                llm.reset()
                llm.create_completion(prompt, max_tokens=1, temperature=0.0)

            def full(prompt=prompt):
                llm.reset()
                llm.create_completion(prompt, max_tokens=g_len, temperature=0.0,
                                      logit_bias={eos: -1e9})

            out[f"batch_{batch}"] = _time_runs(first, full, 1, p_len, g_len, repeats, budget_s)
    out["peak_rss_bytes"] = mem.peak
    return out


def _transformers(artifact: str, p_len: int, g_len: int, batches: list[int], repeats: int,
                  budget_s: float) -> dict:
    import torch

    from quantkit.loader import load_artifact

    with _PeakRSS() as mem:
        t0 = time.perf_counter()
        lm = load_artifact(artifact)
        out = {"load_seconds": time.perf_counter() - t0}
        for batch in batches:
            ids = torch.tensor(_prompts(batch, p_len))

            def gen(n, ids=ids):
                with torch.no_grad():
                    lm.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      pad_token_id=lm.tokenizer.pad_token_id)

            out[f"batch_{batch}"] = _time_runs(lambda: gen(1), lambda: gen(g_len), batch, p_len,
                                               g_len, repeats, budget_s)
    out["peak_rss_bytes"] = mem.peak
    return out


def speed_settings(engine: str, prompt_tokens: int = 256, gen_tokens: int = 32,
                   batches: tuple[int, ...] = (1, 8), repeats: int = 3,
                   repeat_budget_s: float = REPEAT_BUDGET_S) -> dict:
    """The settings a speed record is measured (and reused) under; malloc_huge_pages: whether
    this process (and the engine processes it starts) run with glibc's malloc huge pages
    (quantkit.launch), which changes how fast fresh memory comes."""
    from quantkit.machine import huge_page_state

    return {"engine": engine, "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
            "batches": list(batches), "repeats": repeats, "repeat_budget_s": repeat_budget_s,
            "malloc_huge_pages": huge_page_state()["on"], "warmup": 1,
            "definitions": __doc__.split("Definitions")[1].split("\n\n")[0].strip()}


def _llamacpp_isolated(artifact: str, p_len: int, g_len: int, batches: list[int],
                       repeats: int, budget_s: float) -> dict:
    """llama.cpp in a fresh process, so its peak memory is its own and a crash stays there."""
    with _PeakRSS(children_only=True) as mem, ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        res = pool.submit(_llamacpp, artifact, p_len, g_len, batches, repeats, budget_s).result()
    res["peak_rss_bytes"] = max(res.get("peak_rss_bytes", 0), mem.peak)
    return res


def measure_speed(artifact: str, engine: str | None = None, *, prompt_tokens: int = 256,
                  gen_tokens: int = 32, batches: tuple[int, ...] = (1, 8), repeats: int = 3,
                  repeat_budget_s: float = REPEAT_BUDGET_S) -> dict:
    """Speed/memory record for `artifact` in `engine` (default: the artifact's own engine)."""
    engine = engine or default_engine(artifact)
    settings = speed_settings(engine, prompt_tokens, gen_tokens, batches, repeats,
                              repeat_budget_s)
    if engine == "llamacpp":
        import llama_cpp

        res = _llamacpp_isolated(str(artifact), prompt_tokens, gen_tokens, list(batches), repeats,
                                 repeat_budget_s)
        version = llama_cpp.__version__
    elif engine == "transformers":
        import transformers

        res = _transformers(str(artifact), prompt_tokens, gen_tokens, list(batches), repeats,
                            repeat_budget_s)
        version = transformers.__version__
    elif engine == "vllm":
        from quantkit.engines.vllm import run_vllm

        with _PeakRSS(children_only=True) as mem:
            raw = run_vllm(Path(artifact), speed={"prompt_tokens": prompt_tokens,
                                                  "gen_tokens": gen_tokens,
                                                  "batches": list(batches), "repeats": repeats,
                                                  "repeat_budget_s": repeat_budget_s})
        res = {**raw["speed"], "load_seconds": raw["load_seconds"], "dtype": raw["dtype"]}
        res["peak_rss_bytes"] = max(res.get("peak_rss_bytes", 0), mem.peak)
        version = raw["vllm_version"]
    else:
        raise QuantkitError(f"Unknown engine {engine!r}.", f"Choose one of {', '.join(ENGINES)}.")
    return {"engine": engine, "engine_version": version, "settings": settings, **res}


ENGINE_NAMES = {"vllm": "vLLM", "llamacpp": "llama.cpp", "transformers": "transformers"}
"""How each speed engine's id is written for people (reports, messages)."""


def unmeasured_reason(exc: BaseException, engine: str) -> str:
    """Why `engine` could not measure an artifact here, in one short phrase, read from the
    engine's own failure (its refusal is the truth; nothing is predicted from CPU flags)."""
    name = ENGINE_NAMES.get(engine, engine)
    text = f"{getattr(exc, 'message', exc)}\n{getattr(exc, 'log', '')}"
    if engine == "vllm":  # the phrases of the engine probe: one wording in doctor and reports
        from quantkit.engines.capabilities import explain_vllm_failure

        known = explain_vllm_failure(text)
        if known:
            return known
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"{name} did not finish within {exc.timeout:.0f} s"
    if isinstance(exc, MemoryError) or re.search(r"out of memory|Cannot allocate memory", text, re.I):
        return f"not enough memory for {name} here"
    if isinstance(exc, (ImportError, ModuleNotFoundError)) or "is not installed" in text:
        return f"{name} is not installed here (scripts/setup.sh installs it)"
    cause = re.search(r"failed to run .*?: (\w+(?:Error|Exception): [^\n]*)", text)
    detail = cause.group(1) if cause else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return f"{name} failed: {detail[:90].rstrip()}" + ("…" if len(detail) > 90 else "")


def speed_or_reason(artifact: str, engine: str | None = None, **settings) -> dict:
    """measure_speed's record, or where the engine fails, {engine, settings, unmeasured: the
    reason phrase, error: the engine's message}: one artifact's failure loses nothing else."""
    engine = engine or default_engine(artifact)
    blocked = vllm_blocker(artifact) if engine == "vllm" else None
    if blocked:  # the engine probe says vLLM cannot run it here: no start-up spent on a refusal
        return {"engine": engine, "settings": speed_settings(engine, **settings),
                "unmeasured": blocked, "error": blocked}
    try:
        return measure_speed(artifact, engine, **settings)
    except Exception as exc:  # noqa: BLE001 - every engine failure becomes the cell's reason
        return {"engine": engine, "settings": speed_settings(engine, **settings),
                "unmeasured": unmeasured_reason(exc, engine),
                "error": str(getattr(exc, "message", exc))[:2000]}
