"""Runs inside vLLM's own virtualenv (imports only quantkit's vLLM worker script): vLLM's MTP drafter of an
artifact, built and loaded by vLLM's own model loader, the way its speculative decoding does.

Usage: python vllm_mtp_worker.py ARTIFACT_DIR RESPONSE.json
The engine config comes from EngineArgs with speculative_config {"method": "mtp"}; the drafter
is vLLM's `get_model(vllm_config, model_config=draft_model_config)` (what its EAGLE/MTP
proposer calls), so the MTP class, its quantization config (the artifact's ignore list) and
its `load_weights` are vLLM's. Response: {"architecture", "given" (checkpoint names the loader
yielded), "loaded" (parameter names load_weights says it filled), "params" (every parameter),
"unquantized" (parameter names of modules built without a quantization method), "sums"
(each float parameter's sum, to compare with the stored tensor)}, or
{"error": text}.
"""

import json
import os
import sys

sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
# quantkit's own vLLM worker (a plain script of vLLM's venv too) holds the loader tracking
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "quantkit", "engines"))
from vllm_worker import track_weights  # noqa: E402


def main(model_dir: str, resp_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    args = EngineArgs(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                      distributed_executor_backend="uni")
    config = args.create_engine_config()
    draft = config.speculative_config.draft_model_config
    out: dict = {"architecture": draft.hf_config.architectures[0]}
    tracked = track_weights()  # vLLM's loader, recording what it read and filled
    import torch

    if not torch.accelerator.is_available():  # vLLM's CPU worker process does not reach
        torch.accelerator.empty_cache = lambda: None  # base_loader's empty_cache call
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method="tcp://127.0.0.1:29517",
                                     backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        model = get_model(vllm_config=config, model_config=draft)
    out["given"] = tracked.get("given", [])
    out["loaded"] = tracked.get("loaded")
    out["params"] = sorted(n for n, _ in model.named_parameters())
    unquantized = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__.startswith("Unquantized"):
            unquantized += [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
    out["unquantized"] = sorted(unquantized)
    out["sums"] = {n: float(p.float().sum()) for n, p in model.named_parameters()
                   if p.is_floating_point()}
    json.dump(out, open(resp_path, "w"))


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except Exception as exc:  # the refusal, for the test to assert on
        import traceback

        json.dump({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()},
                  open(sys.argv[2], "w"))
        raise
