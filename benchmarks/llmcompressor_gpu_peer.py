"""Verified peer recipe (copied from the project's shared/bench/llmcompressor_gpu_peer.py so it travels
with the repo to the GPU machine). Used by gpu_quantkit_vs_llmcompressor.py.

Peer timing: llm-compressor GPTQ and AWQ (W4A16, group 128) on a synthetic model with
Llama-3.1-8B layer shapes (random bf16 weights), on one GPU.

Random weights are fine for TIME and MEMORY (the work per layer does not depend on the values);
they say nothing about accuracy. Prints one JSON line per method and a final table.
usage: python llmcompressor_gpu_peer.py [--layers 4] [--samples 128] [--seqlen 2048] [--methods gptq,awq]
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


def run(method, args):
    from llmcompressor import oneshot

    if method == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier
        recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
    elif method == "awq":
        from llmcompressor.modifiers.awq import AWQModifier
        recipe = AWQModifier(targets="Linear", scheme="W4A16_ASYM", ignore=["lm_head"])
    else:
        from llmcompressor.modifiers.quantization import QuantizationModifier
        recipe = QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
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
    args = p.parse_args()
    rows = [run(m, args) for m in args.methods.split(",")]
    for r in rows:
        print(f"{r['method']:5s} {r['seconds']:8.1f} s  {r['seconds_per_layer']:6.1f} s/layer  "
              f"~{r['projected_32_layers_s']/60:5.1f} min for 32 layers  peak {r['peak_gpu_gib']} GiB  on {r['gpu']}")


if __name__ == "__main__":
    main()
