"""Verified peer recipe (copied from the project's shared/bench/llmcompressor_gpu_peer.py so it travels
with the repo to the GPU machine). Used by gpu_quantkit_vs_llmcompressor.py.

Peer timing: llm-compressor GPTQ and AWQ (W4A16, group 128) on a synthetic model with
Llama-3.1-8B layer shapes (random bf16 weights), on one GPU.

Random weights are fine for TIME and MEMORY (the work per layer does not depend on the values);
they say nothing about accuracy. Prints one JSON line per method and a final table.
usage: python llmcompressor_gpu_peer.py [--layers 4] [--samples 128] [--seqlen 2048] [--methods gptq,awq]

Disk to disk (`--checkpoint DIR --calib-ids FILE --save OUT`, one method): what a user of
llm-compressor runs, timed from after the imports and the CUDA context to the artifact on disk:
`AutoModelForCausalLM.from_pretrained` (the model stays on the CPU, so the sequential pipeline
onloads one layer at a time, as above) + `oneshot` on the token ids in FILE +
`save_pretrained(OUT, save_compressed=True)` (compressed-tensors pack-quantized) and the
tokenizer. The row splits the time into load, oneshot and save.
"""
import argparse
import json
import time

import torch


def synthetic_llama_8b(n_layers, model_device="cpu"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        num_hidden_layers=n_layers, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"], torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):  # random init takes seconds here, minutes on the CPU
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    if model_device == "cpu":  # llm-compressor's big-model way: onload one layer at a time
        model = model.to("cpu")
        torch.cuda.empty_cache()
    # llm-compressor re-reads the config from model.name_or_path: give it a real directory.
    cfg.save_pretrained("/tmp/synthetic-llama-8b")
    stand_in_tokenizer().save_pretrained("/tmp/synthetic-llama-8b")
    model.name_or_path = model.config._name_or_path = "/tmp/synthetic-llama-8b"
    return model


def stand_in_tokenizer():
    """llm-compressor insists on a processor when given a dataset; the data is already token ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(128256)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1")


def calibration(samples, seqlen):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128000, (samples, seqlen), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * seqlen] * samples})


def make_recipe(method):
    if method == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier
        return GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
    if method == "awq":
        from llmcompressor.modifiers.awq import AWQModifier
        return AWQModifier(targets="Linear", scheme="W4A16_ASYM", ignore=["lm_head"])
    from llmcompressor.modifiers.quantization import QuantizationModifier
    return QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_from_checkpoint(method, args):
    """Checkpoint on disk -> compressed-tensors artifact on disk (see the module docstring)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cuda = torch.cuda.is_available()
    if cuda:
        torch.zeros(1, device="cuda")  # the CUDA context, outside the timer
    recipe = make_recipe(method)
    _sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    ids = load_file(args.calib_ids)["input_ids"][: args.samples, : args.seqlen]
    ds = Dataset.from_dict({"input_ids": ids.tolist(),
                            "attention_mask": [[1] * ids.shape[1]] * ids.shape[0]})
    t_load = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=args.seqlen,
            num_calibration_samples=args.samples, processor=tokenizer)
    _sync()
    t_oneshot = time.perf_counter()
    model.save_pretrained(args.save, save_compressed=True)
    tokenizer.save_pretrained(args.save)
    _sync()
    t_end = time.perf_counter()
    row = {
        "peer": "llm-compressor", "method": method, "layers": model.config.num_hidden_layers,
        "samples": int(ids.shape[0]), "seqlen": int(ids.shape[1]),
        "model_device": str(next(model.parameters()).device),
        "seconds": round(t_end - t0, 2),
        "phase_seconds": {"load": round(t_load - t0, 2), "oneshot": round(t_oneshot - t_load, 2),
                          "save": round(t_end - t_oneshot, 2)},
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0,
        "peak_gpu_reserved_gib":
            round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else 0.0,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
    }
    print("RESULT " + json.dumps(row), flush=True)
    return row


def run(method, args):
    from llmcompressor import oneshot

    recipe = make_recipe(method)
    model = synthetic_llama_8b(args.layers, args.model_device)
    ds = calibration(args.samples, args.seqlen)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=args.seqlen,
            num_calibration_samples=args.samples, processor=stand_in_tokenizer())
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    row = {
        "peer": "llm-compressor", "method": method, "layers": args.layers, "samples": args.samples,
        "seqlen": args.seqlen, "model_device": args.model_device, "seconds": round(dt, 2), "seconds_per_layer": round(dt / args.layers, 2),
        "projected_32_layers_s": round(dt / args.layers * 32, 1),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
    }
    print("RESULT " + json.dumps(row), flush=True)
    del model
    torch.cuda.empty_cache()
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--methods", default="gptq,awq")
    p.add_argument("--model-device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model waits between layers (cpu: as quantkit streams; cuda: all on the GPU)")
    p.add_argument("--checkpoint", default=None,
                   help="disk to disk: an HF checkpoint directory to quantize (one method)")
    p.add_argument("--calib-ids", default=None,
                   help="disk to disk: a safetensors file whose input_ids [samples, seqlen] calibrate")
    p.add_argument("--save", default=None, help="disk to disk: where the artifact goes")
    args = p.parse_args()
    if args.checkpoint:
        if not (args.calib_ids and args.save) or "," in args.methods:
            p.error("--checkpoint needs --calib-ids, --save and one method")
        run_from_checkpoint(args.methods, args)
        return
    rows = [run(m, args) for m in args.methods.split(",")]
    for r in rows:
        print(f"{r['method']:5s} {r['seconds']:8.1f} s  {r['seconds_per_layer']:6.1f} s/layer  "
              f"~{r['projected_32_layers_s']/60:5.1f} min for 32 layers  peak {r['peak_gpu_gib']} GiB  on {r['gpu']}")


if __name__ == "__main__":
    main()
