"""quantkit vs llm-compressor, GPTQ and AWQ W4A16 g128, on one GPU, in one run.

Synthetic model with Llama-3.1-8B layer shapes (random bf16 weights: fine for time and memory,
meaningless for accuracy), `--layers` decoder blocks, `--samples` x `--seqlen` random calibration
tokens, the same for both tools. The peer side is benchmarks/llmcompressor_gpu_peer.py (the project's verified recipe)
(run as a subprocess so neither tool's memory pool affects the other).

Placement, like for like: both tools start from the model in CPU memory and move one decoder
block at a time to the GPU (llm-compressor's sequential pipeline with the model on the CPU,
`--model-device cpu`). `--placements` picks where quantkit keeps the calibration activations
between block forwards: `gpu` (on the GPU) and/or `offload` (pinned host memory, as
llm-compressor's intermediates cache does; quantkit.pipeline.offload), at
`--offload-batch` samples per forward (quantkit.pipeline.plan.OFFLOAD_BATCH, what quantize()
uses when it offloads).
Two timed scopes (`--scopes`), each the same for both tools and named in every row's `scope`:
- `memory`: from the model in CPU memory and the calibration token ids to the quantized
  weights in memory (quantkit: input capture + every block + results back on the CPU;
  llm-compressor: `oneshot`, its dataset preparation included). Loading the checkpoint and
  writing the artifact are outside it for both. Every row runs in a fresh process (quantkit's
  through `--row`), so none starts with kernels or pinned memory an earlier row warmed up.
- `disk`: from an HF safetensors checkpoint on disk to a compressed-tensors artifact on disk,
  what a user feels. The same synthetic model is written once (one shard per decoder block,
  index, config, a stand-in word-level tokenizer) with a calibration text file of random
  words; quantkit runs `quantkit quantize CKPT --calib FILE ... -o OUT` (its CLI, in a child
  process: benchmarks/quantkit_disk_run.py), llm-compressor `from_pretrained` (model on the
  CPU) + `oneshot` + `save_pretrained(save_compressed=True)` (llmcompressor_gpu_peer.py
  `--checkpoint`), both on the same calibration token ids (quantkit's windows of the text,
  saved for the peer). Each run is a fresh process after the page cache is dropped (where the
  kernel allows it); `seconds` starts after imports and CUDA start-up in both, and
  `process_seconds` is the whole child process (interpreter, imports, CUDA context included).
Every row records the commit (`git rev-parse HEAD`, or the file COMMIT beside benchmarks/ where
the tree was copied without .git) and the exact command; quantkit rows also hold `quantkit
plan`'s prediction of their peak (plus the 0.5 GiB CUDA context that the allocator's peak does
not see). `--check` first compares the offloaded and on-GPU paths on a small run (identical
codes, scales and zeros for GPTQ and AWQ).

Run on the GPU machine from the repo root (wheels for llm-compressor carried in .whl/):
  python3 benchmarks/gpu_quantkit_vs_llmcompressor.py --out $OUT/gpu.json
Writes one JSON file (both tools' rows) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


TIMED_SCOPES = {
    "memory": "model in CPU memory + calibration token ids -> quantized weights in memory "
              "(checkpoint load and artifact write excluded, for both tools; every row in a "
              "fresh process)",
    "disk": "HF safetensors checkpoint on disk -> compressed-tensors artifact on disk, each "
            "tool in a fresh process on the same calibration token ids (each row's page_cache "
            "says whether the page cache was dropped first); `seconds` from after imports and "
            "CUDA start-up to the artifact written, `process_seconds` the whole process",
}

# Llama-3.x layer shapes (hidden, intermediate, heads, kv heads); the peer script knows only 8b.
SHAPES = {"llama-3.1-8b": (4096, 14336, 32, 8), "llama-3.2-3b": (3072, 8192, 24, 8),
          "llama-2-13b": (5120, 13824, 40, 40), "tiny": (128, 256, 4, 2)}  # tiny: CPU dry runs
DEVICE = "cuda"  # --device cpu: a dry run of this script without a GPU (nothing is offloaded)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0


def synthetic_llama(n_layers: int, shape: str = "llama-3.1-8b"):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads, kv = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv, num_hidden_layers=n_layers, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 32 blocks of 8B in fp32 would be 32 GB to init
    try:
        # random init is minutes for 8B on the CPU, seconds on the GPU
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model = model.to("cpu")  # quantkit streams blocks to the GPU
    torch.cuda.empty_cache()
    model.eval()
    return model


def git_commit() -> str:
    """HEAD of this checkout; for a copy without .git, the COMMIT file written beside
    benchmarks/ when it was copied (never the HEAD of a repository that merely holds the copy)."""
    root = Path(__file__).resolve().parents[1]
    stamp = root / "COMMIT"
    if stamp.is_file():
        return stamp.read_text().strip()
    try:
        top, head = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root,
                                   capture_output=True, text=True, check=True).stdout.split()
    except (OSError, ValueError, subprocess.CalledProcessError):
        return "unknown"
    return head if Path(top).resolve() == root else "unknown"


def _quantizer_and_scheme(method: str):
    from quantkit.methods import get_quantizer
    from quantkit.types import QuantScheme

    # "gptq-layer-sequential": GPTQ with --no-true-sequential (llm-compressor's order)
    base, _, mode = method.partition("-")
    sym = base == "gptq"  # the peer's recipes: GPTQ W4A16 (sym), AWQ W4A16_ASYM
    scheme = QuantScheme(bits=4, group_size=128, symmetric=sym)
    return get_quantizer(base, **({"true_sequential": False} if mode else {})), scheme, base, mode


def _quantize(model, method: str, batches, offload: bool, on_progress=None):
    from quantkit.arch import spec_for_config
    from quantkit.pipeline.blocks import quantize_blocks

    quantizer, scheme, _, _ = _quantizer_and_scheme(method)
    return quantize_blocks(model, spec_for_config(model.config), quantizer, scheme, batches,
                           device=DEVICE, compute_dtype=torch.bfloat16, on_progress=on_progress,
                           offload_activations=offload)


def planned_peak_gib(method: str, args, batch: int, offload: bool) -> float:
    """`quantkit plan`'s GPU peak for this run (context included)."""
    from transformers import LlamaConfig

    from quantkit.arch import spec_for_config
    from quantkit.pipeline.plan import estimate

    hidden, inter, heads, kv = SHAPES[args.shape]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv, num_hidden_layers=args.layers, vocab_size=128256,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    _, scheme, base, mode = _quantizer_and_scheme(method)
    plan = estimate(cfg, spec_for_config(cfg), method=base, scheme=scheme,
                    calib_samples=args.samples, calib_seqlen=args.seqlen, calibrated=True,
                    device="cuda", calib_batch=batch, true_sequential=not mode)
    return (plan.peak_gpu_offloaded_bytes if offload else plan.peak_gpu_bytes) / 2**30


def check_offload(methods: list[str], shape: str) -> list[dict]:
    """Offloaded vs on-GPU activations on 2 blocks, 16 x 512 tokens: identical results?"""
    rows = []
    g = torch.Generator().manual_seed(1)
    batches = list(torch.randint(0, 128000, (16, 512), generator=g).split(4))
    for method in methods:
        got = {}
        for offload in (False, True):
            got[offload] = _quantize(synthetic_llama(2, shape), method, batches, offload)
        ref, off = got[False], got[True]
        same = all(torch.equal(getattr(ref[k], a), getattr(off[k], a))
                   for k in ref for a in ("codes", "scale", "zero"))
        row = {"check": "offload_vs_gpu", "method": method, "layers": 2, "tokens": "16 x 512",
               "tensors": len(ref), "identical": same and ref.keys() == off.keys()}
        print("CHECK " + json.dumps(row), flush=True)
        rows.append(row)
    return rows


def run_quantkit(method: str, args, offload: bool) -> dict:
    model = synthetic_llama(args.layers, args.shape)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128000, (args.samples, args.seqlen), generator=g)
    batch = args.offload_batch if offload else args.batch
    batches = list(ids.split(batch))
    _sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    per_block = []

    def progress(stage, done, total):
        _sync()
        per_block.append(time.perf_counter())

    t0 = time.perf_counter()
    results = _quantize(model, method, batches, offload, progress)
    _sync()
    dt = time.perf_counter() - t0
    blocks = [b - a for a, b in zip([t0] + per_block[:-1], per_block, strict=True)]
    errs = [r.loss for r in results.values() if r.loss is not None]
    peak = _peak_gib()
    planned = planned_peak_gib(method, args, batch, offload)
    row = {"tool": "quantkit", "scope": "memory", "method": method, "shape": args.shape,
           "layers": args.layers,
           "activations": "offload" if offload else "gpu", "batch": batch,
           "samples": args.samples,
           "seqlen": args.seqlen, "seconds": round(dt, 2),
           "seconds_per_layer": round(dt / args.layers, 2),
           "seconds_per_layer_after_first": round(sum(blocks[1:]) / max(len(blocks) - 1, 1), 2),
           "seconds_per_block": [round(b, 2) for b in blocks],  # the first holds input capture
           "projected_32_layers_s": round(dt / args.layers * 32, 1),
           "peak_gpu_gib": round(peak, 2),
           "plan_peak_gpu_gib": round(planned, 2),  # context included
           "plan_vs_measured_plus_context": round(planned / (peak + 0.5) - 1, 3),
           "mean_rel_error": round(sum(errs) / max(len(errs), 1), 5),
           "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
           "torch": torch.__version__}
    print("RESULT " + json.dumps(row), flush=True)
    del model, results
    torch.cuda.empty_cache()
    return row


def run_quantkit_fresh(method: str, args, placement: str) -> dict | None:
    """run_quantkit in a fresh process of this script (`--row`), as the peer runs in its own:
    no row inherits kernels, cuBLAS handles or pinned memory another row warmed up."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", f"{method}:{placement}",
           "--layers", str(args.layers), "--shape", args.shape, "--samples", str(args.samples),
           "--seqlen", str(args.seqlen), "--batch", str(args.batch),
           "--offload-batch", str(args.offload_batch), "--device", args.device]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not rows:
        print(f"row failed (rc {proc.returncode}): {shlex.join(cmd)}\n{proc.stdout[-3000:]}\n"
              f"{proc.stderr[-5000:]}", flush=True)
        return None
    print("RESULT " + json.dumps(rows[0]), flush=True)
    return {**rows[0], "process": "fresh"}


def run_peer(methods: list[str], args) -> list[dict]:
    peer = Path(args.peer_script)
    cmd = [args.peer_python or sys.executable, str(peer), "--layers", str(args.layers), "--samples", str(args.samples),
           "--seqlen", str(args.seqlen), "--methods", ",".join(methods), "--model-device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    for r in rows:
        r["command"] = shlex.join(cmd)
        r["scope"] = "memory"
    if proc.returncode != 0 and not rows:
        print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
    return rows


# ---- disk scope: checkpoint on disk -> artifact on disk -------------------------------------

CALIB_SEED = 0
DROP_PAGE_CACHE = False  # --drop-page-cache (the GPU suite; it is the whole machine's cache)


SPECIAL_TOKENS = ("<unk>", "</s>")  # ids 0 and 1; calibration words are drawn from 2 up


def stand_in_tokenizer():
    """Word-level tokenizer over 128256 words (<unk>, </s>, w2 .. w128255), split on
    whitespace: the calibration text of random words becomes random token ids (no real
    tokenizer can be carried). The special tokens must not be substrings of words: special
    tokens are matched inside words ("t1" split "t16044" into two tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), 128256)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>",
                                   eos_token="</s>")


def write_checkpoint(model, directory: Path, samples: int, seqlen: int) -> dict:
    """`model` as an HF checkpoint (one safetensors shard per decoder block and one for the
    rest, index, config, stand-in tokenizer), a calibration text of random words beside it, and
    the token ids quantkit's calibration loader takes from that text (the peer reads those, so
    both tools calibrate on the same ids). Returns the paths and how long the write took."""
    from safetensors.torch import save_file

    from quantkit.calibration.loader import sample_windows, tokenize_text

    t0 = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in model.state_dict().items():
        parts = name.split(".")
        block = parts[2] if name.startswith("model.layers.") else None
        file = f"model-block-{int(block):05d}.safetensors" if block else "model-rest.safetensors"
        shards.setdefault(file, {})[name] = t.detach().to("cpu", torch.bfloat16).contiguous()
    weight_map, total = {}, 0
    for file, tensors in shards.items():
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=1))
    config = model.config
    config.dtype = torch.bfloat16
    config.save_pretrained(directory)
    tokenizer = stand_in_tokenizer()
    tokenizer.save_pretrained(directory)
    # random words, a little more than samples x seqlen tokens; quantkit samples its windows
    g = torch.Generator().manual_seed(CALIB_SEED)
    words = torch.randint(len(SPECIAL_TOKENS), 128000, (samples * seqlen + seqlen,), generator=g)
    calib_text = directory.parent / "calibration.txt"
    calib_text.write_text(" ".join(f"w{i}" for i in words.tolist()) + "\n")
    text_ids = tokenize_text(calib_text.read_text(), tokenizer)
    if not torch.equal(text_ids, words):
        raise RuntimeError("the stand-in tokenizer does not map the calibration words 1:1")
    ids = sample_windows(text_ids, samples, seqlen, CALIB_SEED)  # load_calibration's windows
    calib_ids = directory.parent / "calibration_ids.safetensors"
    save_file({"input_ids": ids}, str(calib_ids))
    os.sync()
    return {"checkpoint": str(directory), "calib_text": str(calib_text),
            "calib_ids": str(calib_ids), "checkpoint_bytes": _dir_bytes(directory),
            "write_seconds": round(time.perf_counter() - t0, 2)}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def drop_page_cache() -> str:
    """Drop the kernel's page cache so each tool reads the checkpoint from disk, not memory
    (root on Linux); the row records whether it worked."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "dropped"
    except OSError as exc:
        return f"not dropped ({exc.strerror or exc})"


def describe_artifact(path: Path) -> dict:
    """Size, files and the quantization config of an artifact: both tools must write the same
    kind of thing (compressed-tensors pack-quantized, W4 g128)."""
    from safetensors import safe_open

    config = json.loads((path / "config.json").read_text())
    qc = config.get("quantization_config", {})
    groups = qc.get("config_groups", {})
    weights = [g.get("weights", {}) for g in groups.values()]
    tensors: list[str] = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            tensors.extend(h.keys())
    suffixes: dict[str, int] = {}
    for name in tensors:
        if ".layers." in name:
            key = name.rsplit(".", 1)[-1]
            suffixes[key] = suffixes.get(key, 0) + 1
    return {"artifact_bytes": _dir_bytes(path), "artifact_files": len(list(path.iterdir())),
            "format": qc.get("format"), "quant_method": qc.get("quant_method"),
            "weights": [{k: w.get(k) for k in ("num_bits", "group_size", "symmetric", "strategy")}
                        for w in weights],
            "block_tensor_kinds": dict(sorted(suffixes.items()))}


def _child(cmd: list[str], out_dir: Path, env: dict | None = None) -> tuple[list[dict], dict]:
    """Run one disk-scope child after dropping the page cache: its RESULT rows and what the
    parent saw (whole-process seconds, cache state, the artifact, GLIBC_TUNABLES)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    cache = drop_page_cache() if DROP_PAGE_CACHE else "not dropped (--drop-page-cache not given)"
    env = dict(os.environ) if env is None else env
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not rows:
        print(f"child failed (rc {proc.returncode}): {shlex.join(cmd)}\n{proc.stdout[-3000:]}\n"
              f"{proc.stderr[-5000:]}", flush=True)
        return [], {}
    seen = {"process_seconds": round(wall, 2), "page_cache": cache, "command": shlex.join(cmd),
            "glibc_tunables": env.get("GLIBC_TUNABLES")}
    if out_dir.is_dir():
        seen.update(describe_artifact(out_dir))
    shutil.rmtree(out_dir, ignore_errors=True)  # the disk holds one artifact at a time
    return rows, seen


def quantkit_cli_args(method: str, ckpt: dict, args, out_dir: Path) -> list[str]:
    """The `quantkit quantize` arguments a user types for this run (the peer's recipes: GPTQ
    W4A16 sym, AWQ W4A16 asym, group 128)."""
    base, _, mode = method.partition("-")
    return ["quantize", ckpt["checkpoint"], "--method", base, "--bits", "4",
            "--group-size", "128", "--sym" if base == "gptq" else "--asym",
            *(["--no-true-sequential"] if mode else []),
            "--calib", ckpt["calib_text"], "--calib-samples", str(args.samples),
            "--calib-seqlen", str(args.seqlen), "--seed", str(CALIB_SEED),
            "--format", "compressed-tensors", "-o", str(out_dir)]


def run_quantkit_disk(method: str, ckpt: dict, args, variant: str) -> dict | None:
    """`quantkit quantize` from the checkpoint to an artifact, in a child process. Variants:
    `default` (what the command picks: activations on the GPU when they fit, per-block resume
    checkpoints on), `offload` (activations in host memory, as quantize() picks when the GPU is
    short), `no-resume` (--no-resume: no per-block checkpoints written)."""
    out_dir = Path(args.workdir) / "artifact-quantkit"
    cli = quantkit_cli_args(method, ckpt, args, out_dir)
    if variant == "no-resume":
        cli.append("--no-resume")
    child = Path(__file__).with_name("quantkit_disk_run.py")
    cmd = [sys.executable, str(child), *(["--force-offload"] if variant == "offload" else []),
           "--", *cli]
    # the environment the `quantkit` command gives itself (quantkit.launch: malloc huge pages)
    from quantkit.machine import huge_page_env

    rows, seen = _child(cmd, out_dir, huge_page_env(dict(os.environ)))
    if not rows:
        return None
    row = {"tool": "quantkit", "scope": "disk", "method": method, "variant": variant,
           "shape": args.shape, "layers": args.layers, "samples": args.samples,
           "seqlen": args.seqlen, "cli": "quantkit " + shlex.join(cli), **rows[0], **seen}
    print("RESULT " + json.dumps(row), flush=True)
    return row


def run_peer_disk(method: str, ckpt: dict, args) -> dict | None:
    """llm-compressor from the same checkpoint: from_pretrained + oneshot + save_pretrained."""
    out_dir = Path(args.workdir) / "artifact-llmcompressor"
    cmd = [args.peer_python or sys.executable, str(Path(args.peer_script)),
           "--checkpoint", ckpt["checkpoint"], "--calib-ids", ckpt["calib_ids"],
           "--save", str(out_dir), "--methods", method.partition("-")[0],
           "--samples", str(args.samples), "--seqlen", str(args.seqlen)]
    rows, seen = _child(cmd, out_dir)
    if not rows:
        return None
    row = {"tool": "llm-compressor", "scope": "disk", "shape": args.shape, **rows[0], **seen}
    print("RESULT " + json.dumps(row), flush=True)
    return row


def ratios(rows: list[dict]) -> list[dict]:
    """quantkit / llm-compressor time and peak for each scope and method, against the goals
    (GPTQ peak <= the peer's at equal placement, time <= 0.25x)."""
    out = []
    for r in rows:
        if r.get("tool") != "quantkit" or "seconds" not in r:
            continue
        base = r["method"].partition("-")[0]
        peer = next((p for p in rows if p.get("tool") == "llm-compressor"
                     and p.get("scope") == r["scope"] and p.get("method") == base), None)
        if peer is None:
            continue
        out.append({"scope": r["scope"], "method": r["method"],
                    "quantkit": r.get("variant") or r.get("activations"),
                    "time_ratio": round(r["seconds"] / peer["seconds"], 3),
                    "peak_ratio": round(r["peak_gpu_gib"] / max(peer["peak_gpu_gib"], 1e-9), 3),
                    **({"process_time_ratio": round(r["process_seconds"] / peer["process_seconds"], 3)}
                       if "process_seconds" in r and "process_seconds" in peer else {}),
                    "time_goal_0.25x": r["seconds"] <= 0.25 * peer["seconds"],
                    "peak_goal_le_peer": r["peak_gpu_gib"] <= peer["peak_gpu_gib"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8,
                   help="calibration samples per forward, activations on the GPU")
    p.add_argument("--offload-batch", type=int, default=None,
                   help="samples per forward with offloaded activations (default: the plan's "
                        "OFFLOAD_BATCH, what quantize() uses)")
    p.add_argument("--placements", default="gpu,offload",
                   help="where quantkit keeps the activations: gpu, offload or both")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--check", action="store_true",
                   help="first compare offloaded and on-GPU results on a small run")
    p.add_argument("--methods", default="gptq,awq",
                   help="gptq, gptq-layer-sequential (quantkit only), awq")
    p.add_argument("--tools", default="quantkit,llm-compressor")
    p.add_argument("--peer-script", default=str(Path(__file__).with_name("llmcompressor_gpu_peer.py")))
    p.add_argument("--peer-python", default=None,
                   help="the Python that has llm-compressor (default: this one)")
    p.add_argument("--scopes", default="memory,disk",
                   help="timed scopes: memory (model in memory -> weights in memory) and/or "
                        "disk (checkpoint on disk -> artifact on disk)")
    p.add_argument("--disk-variants", default="default,offload",
                   help="quantkit runs in the disk scope: default, offload, no-resume")
    p.add_argument("--drop-page-cache", action="store_true",
                   help="drop the kernel's page cache before each disk-scope run (root)")
    p.add_argument("--workdir", default="/tmp/quantkit-gpu-bench",
                   help="where the disk scope writes the checkpoint and the artifacts")
    p.add_argument("--out", default="benchmarks/results/gpu_quantkit_vs_llmcompressor.json")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # METHOD:PLACEMENT, one child row
    args = p.parse_args()
    global DEVICE, DROP_PAGE_CACHE
    DEVICE = args.device
    DROP_PAGE_CACHE = args.drop_page_cache
    if args.offload_batch is None:
        from quantkit.pipeline.plan import OFFLOAD_BATCH

        args.offload_batch = min(args.batch, OFFLOAD_BATCH)
    if args.row:  # run_quantkit_fresh's child: one memory-scope row, printed, nothing saved
        method, _, placement = args.row.partition(":")
        run_quantkit(method, args, placement == "offload")
        return
    methods = args.methods.split(",")
    command = shlex.join([sys.executable, *sys.argv])
    commit = git_commit()
    scopes = args.scopes.split(",")
    if "llm-compressor" in args.tools and args.shape != "llama-3.1-8b" and "memory" in scopes:
        p.error("the peer script builds Llama-3.1-8B shapes only (the disk scope takes any)")
    rows: list[dict] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(new: list[dict | None]) -> None:  # after every row: a cut run keeps the others
        new = [r for r in new if r]  # a failed child gives None (its output was printed)
        for r in new:
            r.setdefault("tool", r.get("peer", "quantkit"))
            r.setdefault("command", command)
            r["commit"] = commit
        rows.extend(new)
        out.write_text(json.dumps({"setup": vars(args), "command": command, "commit": commit,
                                   "timed_scopes": {k: TIMED_SCOPES[k] for k in scopes},
                                   "ratios_vs_llm_compressor": ratios(rows), "rows": rows},
                                  indent=2))

    if args.check:
        save(check_offload(methods, args.shape))
    if "memory" in scopes and "quantkit" in args.tools:
        for m in methods:
            for placement in args.placements.split(","):
                save([run_quantkit_fresh(m, args, placement)])
    if "memory" in scopes and "llm-compressor" in args.tools:
        save(run_peer(sorted({m.partition("-")[0] for m in methods}), args))
    if "disk" in scopes:
        work = Path(args.workdir)
        shutil.rmtree(work, ignore_errors=True)
        model = synthetic_llama(args.layers, args.shape)  # the same model as the memory scope
        ckpt = write_checkpoint(model, work / "checkpoint", args.samples, args.seqlen)
        del model
        print("CHECKPOINT " + json.dumps(ckpt), flush=True)
        save([{"check": "checkpoint_written", **ckpt}])
        for m in methods:
            if "quantkit" in args.tools:
                for variant in args.disk_variants.split(","):
                    save([run_quantkit_disk(m, ckpt, args, variant)])
        if "llm-compressor" in args.tools:
            for base in sorted({m.partition("-")[0] for m in methods}):
                save([run_peer_disk(base, ckpt, args)])
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'scope':6s} {'tool':15s} {'method':6s} {'quantkit run':12s} {'seconds':>8s} "
          f"{'process s':>9s} {'peak GiB':>9s} {'plan GiB':>9s}")
    for r in rows:
        if "seconds" not in r:
            continue
        print(f"{r['scope']:6s} {r['tool']:15s} {r['method']:6s} "
              f"{r.get('variant') or r.get('activations', '-'):12s} {r['seconds']:8.2f} "
              f"{r.get('process_seconds', float('nan')):9.2f} {r['peak_gpu_gib']:9.2f} "
              f"{r.get('plan_peak_gpu_gib', float('nan')):9.2f}")
    for q in ratios(rows):
        print("RATIO " + json.dumps(q))


if __name__ == "__main__":
    main()
