"""lm-evaluation-harness tasks through three backends, with per-sample results for flips.

  hf        quantkit's loader (stored weights dequantized) wrapped in lm-eval's HFLM
  llamacpp  an lm-eval LM over llama-cpp-python (GGUF files)
  vllm      lm-eval's own vLLM model, run inside vLLM's virtualenv (engines/vllm_lmeval_worker.py)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.eval.tasks import (
    OFFLINE_TASKS,
    offline_task_dir,
    only_offline,
    resolve_tasks,
    task_manager,
)
from quantkit.machine import cache_dir
from quantkit.readers import model_fingerprint

__all__ = ["run_tasks", "results_cache_path", "flips", "BACKENDS"]

BACKENDS = ("hf", "vllm", "llamacpp")
_PRIMARY = ("acc", "acc_norm", "word_perplexity", "exact_match", "bits_per_byte")


def _summarise(results: dict) -> tuple[dict, dict]:
    """{task: {metric: {value, stderr}}} and {task: [per-sample acc]} from lm-eval's output."""
    tasks = {}
    for task, res in results["results"].items():
        metrics = {}
        for key, value in res.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            name = key.split(",")[0]
            se = res.get(f"{name}_stderr,{key.split(',', 1)[1]}")
            metrics[name] = {"value": float(value),
                             "stderr": float(se) if isinstance(se, (int, float)) and not math.isnan(se) else None}
        tasks[task] = metrics
    samples = {}
    for task, rows in (results.get("samples") or {}).items():
        if rows and "acc" in rows[0]:
            samples[task] = [{"doc_id": int(r["doc_id"]), "acc": float(r["acc"])} for r in rows]
    return tasks, samples


def _evaluate_lm(lm, tasks: list[str], *, num_fewshot: int, limit: int | None, seed: int,
                 chat: bool) -> dict:
    import lm_eval

    # the names were checked by _run_uncached before the model loaded
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                   task_manager=task_manager(tasks), log_samples=True, random_seed=seed,
                                   numpy_random_seed=seed, torch_random_seed=seed,
                                   fewshot_random_seed=seed, apply_chat_template=chat,
                                   bootstrap_iters=100)


def run_tasks(artifact: str, tasks: list[str], *, backend: str = "hf", num_fewshot: int = 0,
              limit: int | None = None, batch_size: int = 8, seed: int = 1234,
              chat: bool = False, reuse: bool = False) -> dict:
    """Run lm-eval `tasks` on `artifact`; returns metrics, per-sample accs and the settings.

    reuse=True: results of the same unchanged model directory, tasks and settings are read
    from (and saved to) the results cache (`results_cache_path`); the returned dict then
    names the file under "cached". Meant for the base model, which every eval of its
    quantized versions runs again.
    """
    settings = {"backend": backend, "num_fewshot": num_fewshot, "limit": limit,
                "batch_size": batch_size, "seed": seed, "chat_template": chat}
    stored = results_cache_path(artifact, tasks, settings) if reuse else None
    if stored is not None and stored.is_file():
        return {**json.loads(stored.read_text()), "cached": str(stored)}
    out = _run_uncached(artifact, tasks, settings)
    if stored is not None:
        stored.parent.mkdir(parents=True, exist_ok=True)
        tmp = stored.with_name(f"{stored.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(out))
        tmp.replace(stored)
    return out


def results_cache_path(artifact: str, tasks: list[str], settings: dict) -> Path | None:
    """Where the results of a model directory for these tasks and settings are kept, or None
    where they cannot be keyed safely: only Hugging Face directories (config hash + each
    weight file's name, size and mtime) and quantkit's built-in tasks (their data is hashed
    into the task folder's name); Hub tasks read datasets that may change underneath.
    Folder: $QUANTKIT_LMEVAL_CACHE, else <quantkit cache>/lmeval-results."""
    from quantkit import __version__
    from quantkit.model_io import resolve_model

    if not set(tasks) <= set(OFFLINE_TASKS):
        return None
    path = Path(artifact)
    if not path.exists():
        try:
            path = resolve_model(str(artifact)).path
        except QuantkitError:
            return None
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        return None
    fields = {"model": model_fingerprint(path), "path": str(path.resolve()),
              "tasks": sorted(tasks), "settings": settings, "task_data": offline_task_dir().name,
              "lm_eval": _lm_eval_version(), "quantkit": __version__}
    if settings.get("backend") == "vllm":  # float32 or bf16 here: engines.capabilities.vllm_dtype
        from quantkit.engines.capabilities import vllm_dtype

        fields["dtype"] = vllm_dtype(path)
    key = json.dumps(fields, sort_keys=True)
    root = Path(os.environ.get("QUANTKIT_LMEVAL_CACHE") or cache_dir() / "lmeval-results")
    return root / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _run_uncached(artifact: str, tasks: list[str], settings: dict) -> dict:
    backend, num_fewshot, limit = settings["backend"], settings["num_fewshot"], settings["limit"]
    batch_size, seed, chat = settings["batch_size"], settings["seed"], settings["chat_template"]
    resolve_tasks(tasks, task_manager(tasks))  # a bad task name fails before the model loads
    if backend == "hf":
        from lm_eval.models.huggingface import HFLM

        from quantkit.loader import load_artifact

        loaded = load_artifact(artifact)
        lm = HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=batch_size,
                  max_length=2048)  # same window as the llama.cpp and vLLM backends
        raw = _evaluate_lm(lm, tasks, num_fewshot=num_fewshot, limit=limit, seed=seed, chat=chat)
    elif backend == "llamacpp":
        from quantkit.eval.llamacpp_lm import LlamaCppLM

        lm = LlamaCppLM(str(artifact))
        raw = _evaluate_lm(lm, tasks, num_fewshot=num_fewshot, limit=limit, seed=seed, chat=chat)
    elif backend == "vllm":
        raw = _run_vllm_lmeval(artifact, tasks, settings)
    else:
        raise QuantkitError(f"Unknown backend {backend!r}.", f"Choose one of {', '.join(BACKENDS)}.")
    metrics, samples = _summarise(raw)
    out = {"tasks": metrics, "samples": samples, "settings": settings,
           "lm_eval_version": _lm_eval_version()}
    if "dtype" in raw:  # vLLM's activation dtype (engines.capabilities.vllm_dtype)
        out["engine_dtype"] = raw["dtype"]
    return out


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def _run_vllm_lmeval(artifact: str, tasks: list[str], settings: dict) -> dict:
    from quantkit.engines.capabilities import vllm_dtype
    from quantkit.engines.vllm import run_vllm_worker, vllm_failure

    worker = Path(__file__).parents[1] / "engines" / "vllm_lmeval_worker.py"
    dtype = vllm_dtype(Path(artifact))
    with tempfile.TemporaryDirectory(prefix="quantkit-lmeval-") as tmp:
        req, resp = Path(tmp) / "req.json", Path(tmp) / "resp.json"
        req.write_text(json.dumps({"model": str(Path(artifact).resolve()), "tasks": tasks,
                                   "dtype": dtype,
                                   "include_path": str(offline_task_dir()),
                                   "include_defaults": not only_offline(tasks), **settings}))
        proc = run_vllm_worker(worker, [str(req), str(resp)], cwd=Path(tmp))
        if proc.returncode != 0 or not resp.is_file():
            raise vllm_failure(f"lm-eval in vLLM failed on {artifact}", proc.log, proc.returncode)
        return {**json.loads(resp.read_text()), "dtype": dtype}


def flips(base: dict, other: dict) -> dict:
    """Share of per-sample answers that changed correct<->incorrect (Dutta et al. 2024)."""
    out = {}
    for task, rows in other.get("samples", {}).items():
        ref = {r["doc_id"]: r["acc"] for r in base.get("samples", {}).get(task, [])}
        pairs = [(ref[r["doc_id"]], r["acc"]) for r in rows if r["doc_id"] in ref]
        if pairs:
            changed = sum((a >= 0.5) != (b >= 0.5) for a, b in pairs)
            out[task] = {"value": changed / len(pairs), "n": len(pairs),
                         "correct_to_wrong": sum(a >= 0.5 > b for a, b in pairs) / len(pairs),
                         "wrong_to_correct": sum(b >= 0.5 > a for a, b in pairs) / len(pairs)}
    return out
