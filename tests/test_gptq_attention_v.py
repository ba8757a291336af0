"""`--gptq-v-hessian attention`: GPTQ gives v_proj the attention-weighted Hessian
sum_h (A_h X)^T (A_h X) (quantkit.pipeline.attention_v) and changes nothing else; the option
reaches every GPTQ-family path, is recorded, and is refused where it is not built."""

from __future__ import annotations

import json

import pytest
import torch
from cli_runner import run_cli

from quantkit.arch import spec_for_config
from quantkit.methods.gptq import GPTQQuantizer
from quantkit.model_io import load_model
from quantkit.pipeline.attention_v import query_rows
from quantkit.pipeline.blocks import quantize_blocks
from quantkit.types import QuantScheme

V = "self_attn.v_proj"


class _Recorder(GPTQQuantizer):
    """GPTQ's statistics, recorded and left unused: no weight changes, so every block of
    both runs sees the float model and any difference is the option's alone."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: dict[str, torch.Tensor] = {}

    def quantize_block(self, ctx):
        for name, st in ctx.stats.items():
            self.seen[f"{ctx.index}.{name}"] = st["hessian"].clone()
            self.seen[f"{ctx.index}.{name}.tokens"] = st["tokens"]
        return {}


def _hessians(model_dir, batches, staged: bool, **kw) -> dict:
    model = load_model(model_dir)
    rec = _Recorder(**kw)
    quantize_blocks(model, spec_for_config(model.config), rec, QuantScheme(bits=4, group_size=64),
                    batches, staged=staged)
    return rec.seen


def _batches(seqlen: int = 48) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 49152, (2, seqlen), generator=gen) for _ in range(2)]


@pytest.mark.parametrize("staged", [True, False])
def test_only_v_proj_hessian_changes_and_it_is_the_attention_weighted_one(tiny_llama, staged):
    """Known answer: v_proj's H is sum over batches, sequences, query heads h (GQA: 4 query
    heads on 2 KV heads, all counted) and queries s of xbar xbar^T, xbar = A_h[s] X, from an
    eager forward of the float model; every other Linear's H and every token count is
    bitwise the default run's. Both pipeline paths (one staged forward, block replay)."""
    batches = _batches()
    base = _hessians(tiny_llama, batches, staged)
    att = _hessians(tiny_llama, batches, staged, v_hessian="attention")
    assert base.keys() == att.keys() and len(base) == 2 * 2 * 7
    for key in base:
        if key.endswith(V):
            assert not torch.allclose(base[key], att[key], rtol=0.05), key
        else:
            assert torch.equal(torch.as_tensor(base[key]), torch.as_tensor(att[key])), key

    for i, want in enumerate(_eager_attention_hessians(tiny_llama, batches)):
        got = att[f"{i}.{V}"].double()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max())), i
        assert att[f"{i}.{V}.tokens"] == 2 * 2 * 48  # the token count stays X's


def _eager_attention_hessians(model_dir, batches) -> list[torch.Tensor]:
    """Per layer, sum_h (A_h X)^T (A_h X) from transformers' own eager forward (float64 sums)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    k = hf.config.hidden_size
    wants = []
    for i, layer in enumerate(hf.model.layers):
        xs = []
        hook = layer.self_attn.v_proj.register_forward_pre_hook(lambda _m, a, xs=xs: xs.append(a[0]))
        want = torch.zeros(k, k, dtype=torch.float64)
        with torch.no_grad():
            for ids in batches:
                out = hf(input_ids=ids, output_attentions=True)
                a, x = out.attentions[i].double(), xs[-1].double()  # [B, heads, S, S], [B, S, K]
                assert a.shape[1] == hf.config.num_attention_heads
                xbar = torch.einsum("bhst,btk->bhsk", a, x).reshape(-1, k)
                want += xbar.T @ xbar
        hook.remove()
        wants.append(want)
    return wants


@pytest.mark.fast
def test_sliding_window_mask_is_the_blocks_own(tmp_path):
    """Mistral with a 16-token window on 40-token sequences: SDPA's boolean mask (what the
    block's kwargs hold) made additive gives eager's sliding-window attention exactly."""
    import transformers

    cfg = transformers.MistralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=49152, sliding_window=16,
                                     max_position_embeddings=1024)
    cfg.architectures = ["MistralForCausalLM"]
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.04)
    model.save_pretrained(tmp_path / "mistral")
    batches = _batches(40)[:1]
    got = _hessians(tmp_path / "mistral", batches, False, v_hessian="attention")[f"0.{V}"].double()
    want = _eager_attention_hessians(tmp_path / "mistral", batches)[0]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    causal = _hessians(tmp_path / "mistral", batches, False)[f"0.{V}"].double()  # X^T X
    assert not torch.allclose(got / got.trace(), causal / causal.trace(), rtol=0.05)


@pytest.mark.fast
def test_one_sequence_at_a_time_and_query_rows_sampled(tiny_llama):
    """A budget that fits one sequence's weights slices the batch (and its batched kwargs)
    without changing the sum; max_rows below the length samples the query rows."""
    from quantkit.pipeline.attention_v import attention_v_hessian
    from quantkit.pipeline.blocks import get_blocks
    from quantkit.pipeline.capture import capture_block_inputs

    model = load_model(tiny_llama)
    spec = spec_for_config(model.config)
    blocks = get_blocks(model, spec)
    ids = torch.randint(0, 49152, (3, 96), generator=torch.Generator().manual_seed(1))
    inputs = capture_block_inputs(model, blocks, [ids], torch.float32)
    block = blocks[0].float()
    with torch.no_grad():
        xs = [block.input_layernorm(inputs.hidden[0])]
    whole = attention_v_hessian(block, spec.attention, xs, inputs.kwargs)
    single = attention_v_hessian(block, spec.attention, xs, inputs.kwargs, budget=1)
    assert torch.allclose(single, whole, rtol=1e-4, atol=1e-6 * float(whole.abs().max()))
    fewer = attention_v_hessian(block, spec.attention, xs, inputs.kwargs, max_rows=64)
    assert not torch.allclose(fewer * whole.trace() / fewer.trace(), whole, rtol=1e-3)
    assert model.config._attn_implementation == "sdpa"  # put back


@pytest.mark.fast
def test_query_rows_are_bounded_and_evenly_spread():
    assert torch.equal(query_rows(100), torch.arange(100))
    rows = query_rows(2048)
    assert len(rows) == 256 and rows[0] == 0 and rows[-1] == 2047
    assert (rows.diff() >= 7).all() and (rows.diff() <= 9).all()


def test_gptq_int4_records_the_option_and_loads(tiny_llama, tmp_path):
    """--method gptq with the option (the API's request): quantkit.json records it, the
    equivalent command carries the flag, quantkit's loader loads the artifact and it gives
    finite logits."""
    from quantkit.loader import load_artifact
    from quantkit.pipeline.quantize import QuantizeRequest, quantize

    out = tmp_path / "int4"
    req = QuantizeRequest(model=str(tiny_llama), method="gptq", out=out,
                          scheme=QuantScheme(bits=4, group_size=64), calib_samples=2,
                          calib_seqlen=64, method_options={"v_hessian": "attention"})
    quantize(req)
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["method_options"]["v_hessian"] == "attention"
    assert "--gptq-v-hessian attention" in req.cli_equivalent()
    loaded = load_artifact(out)
    with torch.no_grad():
        assert torch.isfinite(loaded.model(input_ids=torch.randint(0, 49152, (1, 16))).logits).all()


def test_cli_gptq_gguf_records_the_option_and_llama_cpp_loads_it(tiny_llama, tmp_path):
    """`quantkit quantize --method gptq --format gguf --gptq-v-hessian attention`: exit 0,
    quantkit.metadata records the option and the command, llama-cpp-python loads the file
    and gives finite logits."""
    pytest.importorskip("llama_cpp")
    from click.testing import CliRunner

    from quantkit.cli import main
    from quantkit.engines.llamacpp import LlamaCppModel
    from quantkit.formats.gguf import read_gguf

    gguf = tmp_path / "att.gguf"
    r = CliRunner().invoke(main, ["quantize", str(tiny_llama), "--method", "gptq", "--format",
                                  "gguf", "--gguf-type", "q4_k_m", "--calib-samples", "2",
                                  "--calib-seqlen", "64", "--gptq-v-hessian", "attention",
                                  "-o", str(gguf)])
    assert r.exit_code == 0, r.output
    meta = json.loads(read_gguf(gguf)[0]["quantkit.metadata"])
    assert meta["method_options"]["v_hessian"] == "attention"
    assert meta["method_options"]["rounding"] == "gptq"
    llm = LlamaCppModel(gguf, n_ctx=128, logits_all=True)
    try:
        assert torch.isfinite(torch.from_numpy(llm.logits([1, 2, 3, 4]))).all()
    finally:
        llm.close()


@pytest.mark.parametrize("method,options", [
    ("gptq", {}), ("gguf", {"rounding": "gptq", "gguf_type": "q4_k_m"}),
    ("int8", {"rounding": "gptq"}), ("nvfp4", {"rounding": "gptq"})])
def test_every_gptq_path_reads_the_option(tiny_llama, method, options):
    """Every quantizer that reads "hessian" takes v_hessian: block 0's v_proj comes out
    different, its q_proj (same input, same Hessian) identical."""
    from quantkit.methods import get_quantizer
    from quantkit.pipeline.quantize import linear_shapes

    schemes = {"gptq": QuantScheme(bits=4, group_size=64),
               "gguf": QuantScheme(kind="kquant", gguf_type="q4_k_m")}
    got = {}
    for v in ("tokens", "attention"):
        model = load_model(tiny_llama)
        spec = spec_for_config(model.config)
        quantizer = get_quantizer(method, **options, v_hessian=v)
        scheme = schemes.get(method) or quantizer.scheme
        quantizer.check(scheme)
        if hasattr(quantizer, "prepare"):
            quantizer.prepare(config=model.config, spec=spec, shapes=linear_shapes(model.config, spec))
        quantize_blocks(model, spec, quantizer, scheme, _batches(32)[:1])
        layer = model.model.layers[0].self_attn
        got[v] = (layer.q_proj.weight.detach().clone(), layer.v_proj.weight.detach().clone())
    assert torch.equal(got["tokens"][0], got["attention"][0])
    assert not torch.equal(got["tokens"][1], got["attention"][1])


def test_unsupported_architecture_and_rtn_rounding_are_refused(tiny_model_factory, tiny_llama, tmp_path):
    """phi3 (fused qkv_proj): exit 2, one clear error, no traceback, nothing written; the
    flag without --rounding gptq on a rounding method: exit 2."""
    phi3 = tiny_model_factory("phi3")
    out = tmp_path / "out"
    r = run_cli(["quantize", phi3, "--method", "gptq", "--gptq-v-hessian", "attention",
                 "--calib-samples", "2", "--calib-seqlen", "32", "-o", out])
    assert r.returncode == 2, r.stderr
    assert "not built for phi3" in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert not out.exists() and not any(tmp_path.glob(".out*"))
    r = run_cli(["quantize", tiny_llama, "--method", "gguf", "--gguf-type", "q4_k_m",
                 "--gptq-v-hessian", "attention", "-o", out])
    assert r.returncode == 2 and "--rounding gptq" in r.stderr, r.stderr
    assert not out.exists()


@pytest.mark.fast
def test_plan_counts_the_attention_forward(tiny_llama):
    """`quantkit plan --gptq-v-hessian attention` adds the eager forward's memory (attention
    weights of as many sequences as attention_v's budget takes, at least one, and their A_h X
    rows) and its time; the default plan is unchanged. At Llama-8B shapes (32 heads, 2048
    tokens) one sequence's weights (512 MiB) exceed the budget, so one at a time."""
    from click.testing import CliRunner
    from transformers import AutoConfig

    from quantkit.cli import main
    from quantkit.pipeline.attention_v import MAX_QUERY_ROWS, WEIGHTS_BUDGET
    from quantkit.pipeline.plan import _attention_v_bytes

    def plan(*flags) -> dict:
        res = CliRunner().invoke(main, ["plan", str(tiny_llama), "--method", "gptq", "--calib-samples",
                                        "8", "--calib-seqlen", "512", "--json", *flags])
        assert res.exit_code == 0, res.output
        out = json.loads(res.output)
        out.pop("available_ram_bytes")  # the machine's, read at each call
        return out

    base, tokens, att = plan(), plan("--gptq-v-hessian", "tokens"), plan("--gptq-v-hessian", "attention")
    assert base == tokens
    cfg = AutoConfig.from_pretrained(tiny_llama)
    heads = cfg.num_attention_heads
    # GPTQ's batches of 8 samples, all 8 within the budget: their weights + sampled rows
    extra = 8 * (heads * 512 * 512 * 4 + heads * MAX_QUERY_ROWS * cfg.hidden_size * 4)
    assert att["phase_bytes"]["blocks"] - base["phase_bytes"]["blocks"] == extra
    assert att["seconds"] > base["seconds"]
    assert _attention_v_bytes(8, 2048, 4096, 32) == 32 * 2048**2 * 4 + 32 * 256 * 4096 * 4
    assert 32 * 2048**2 * 4 > WEIGHTS_BUDGET
    assert _attention_v_bytes(8, 512, 576, 9) == 8 * (9 * 512**2 * 4 + 9 * 256 * 576 * 4)
