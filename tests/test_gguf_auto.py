"""`--gguf-type auto`: per-tensor GGML types chosen by measured sensitivity under a size budget.

The solver gives the bigger type to the tensor whose activations make its error costly; on
the tiny Llama the file meets --target-bpw / --target-size from its actual tensor bytes, the
chosen types (token_embd and output included) are in quantkit.metadata and `quantkit info`,
stock llama.cpp loads and generates from it, and at the bits of the uniform Q4_K_M mix its
KLD through llama.cpp's logits is lower; budgets that Q4_K_M's fixed token_embd/output made
impossible are met, a lower budget never buys a lower cost, bad budgets and flags are
refused with the possible range."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from gguf import GGML_QUANT_SIZES
from heldout import heldout_text

from quantkit.cli import main
from quantkit.errors import QuantkitError, SchemeMismatch
from quantkit.formats.gguf import gguf_metadata, read_gguf
from quantkit.ggml.catalogue import FALLBACK
from quantkit.ggml.codec import dequantize_tensor, quantize_tensor
from quantkit.info import artifact_info
from quantkit.methods.bit_allocation import Option, allocate, budget_range, hull
from quantkit.methods.gguf_auto import candidate_types, measure_options
from quantkit.methods.kquants import GGUFQuantizer
from quantkit.methods.options import parse_size
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

CALIB = {"calib_samples": 16, "calib_seqlen": 128}


@pytest.mark.fast
def test_hull_drops_options_that_never_win():
    opts = [Option("a", 10, 9.0), Option("b", 20, 8.9), Option("c", 30, 1.0), Option("d", 40, 1.5)]
    assert [o.label for o in hull(opts)] == ["a", "c"]  # b above the chord a-c, d dominated


@pytest.mark.fast
def test_whole_tensors_use_the_budget_the_hull_greedy_leaves_idle():
    """One big tensor whose hull jumps from 100 to 400 bytes (its 250-byte option lies above
    the chord) beside small ones: at a 300-byte budget the greedy on hulls cannot take the
    jump and leaves ~150 bytes idle; solved whole, the big tensor takes its 250-byte option."""
    big = [Option("a", 100, 100.0), Option("b", 250, 80.0), Option("c", 400, 1.0)]
    small = {f"s{i}": [Option("x", 10, 1.0), Option("y", 20, 0.5)] for i in range(3)}
    cands = {"big": big, **small}
    assert [o.label for o in hull(big)] == ["a", "c"]
    greedy = allocate(cands, 300)
    whole = allocate(cands, 300, whole=("big",))
    assert greedy["big"].label == "a" and sum(o.nbytes for o in greedy.values()) == 160
    assert whole["big"].label == "b" and sum(o.nbytes for o in whole.values()) <= 300
    assert sum(o.cost for o in whole.values()) < sum(o.cost for o in greedy.values())


def test_sensitive_tensor_gets_a_bigger_type_than_its_twins():
    """Three tensors of one shape and weights of one distribution; one's imatrix is scaled up
    (louder activations): under a budget between all-small and all-large it alone gets more
    bytes, and the total stays within the budget and close to it."""
    g = torch.Generator().manual_seed(0)
    imatrix = torch.rand(512, generator=g) + 0.5
    candidates = {}
    for name, scale in (("twin_a", 1.0), ("loud", 30.0), ("twin_b", 1.0)):
        w = torch.randn(64, 512, generator=g) * 0.04
        types = candidate_types(tuple(w.shape), FALLBACK)
        candidates[name], _, _ = measure_options(w, types, imatrix * scale, quantize_tensor, dequantize_tensor)
    smallest = sum(min(o.nbytes for o in v) for v in candidates.values())
    budget = smallest + 30_000
    chosen = allocate(candidates, budget)
    used = sum(o.nbytes for o in chosen.values())
    assert smallest < used <= budget and used > budget - 12_000, (used, budget)
    assert chosen["loud"].nbytes > max(chosen["twin_a"].nbytes, chosen["twin_b"].nbytes), chosen


@pytest.mark.fast
def test_bad_flags_are_refused_with_a_hint(tiny_llama):
    run = CliRunner()
    cases = [(["--gguf-type", "q4_k_m", "--target-bpw", "4.5"], "--gguf-type auto"),
             (["--gguf-type", "auto"], "needs a size budget"),
             (["--gguf-type", "auto", "--target-bpw", "4.5", "--target-size", "80MB"], "both"),
             (["--gguf-type", "auto", "--target-size", "eighty"], "not a size")]
    for flags, says in cases:
        r = run.invoke(main, ["plan", str(tiny_llama), "--method", "gguf", *flags])
        assert r.exit_code == 2 and says in r.output and "hint:" in r.output, (flags, r.output)
    assert parse_size("80MB") == 80_000_000 and parse_size("1.5KiB") == 1536
    with pytest.raises(QuantkitError):
        parse_size("-3MB")
    with pytest.raises(SchemeMismatch, match="--rounding gptq is not built"):
        GGUFQuantizer("auto", target_bpw=4.5, rounding="gptq")
    with pytest.raises(SchemeMismatch, match="fixed mix"):
        GGUFQuantizer("q4_k_m", target_bpw=4.5)


@pytest.mark.parametrize("target", [{"target_bpw": 2.0}, {"target_bpw": 9.0}])
def test_budget_outside_the_possible_range_is_refused_before_any_data(tiny_llama, tmp_path, target):
    with pytest.raises(SchemeMismatch, match="bits per weight are possible") as exc:
        _gguf(tiny_llama, tmp_path / "x.gguf", "auto", **target)
    assert ("below" if target["target_bpw"] < 5 else "above") in exc.value.message
    assert not (tmp_path / "x.gguf").exists()


# ---------------------------------------------------------------- the tiny Llama, end to end

def _gguf(model: Path, out: Path, gguf_type: str, **options) -> dict:
    return quantize(QuantizeRequest(model=str(model), method="gguf", format="gguf", out=out,
                                    scheme=QuantScheme(kind="kquant", gguf_type=gguf_type),
                                    method_options={"gguf_type": gguf_type, **options}, **CALIB))


@pytest.fixture(scope="module")
def auto_vs_q4km(tiny_llama, tmp_path_factory):
    """The tiny Llama (widths 256/512) as llama.cpp's imatrix Q4_K_M, and as auto at that
    file's bits per weight with the same imatrix file (and calibration windows for gains)."""
    root = tmp_path_factory.mktemp("gguf-auto")
    _gguf(tiny_llama, root / "q4km.gguf", "q4_k_m", imatrix="calib", imatrix_out=str(root / "imatrix.gguf"))
    target = artifact_info(root / "q4km.gguf")["bits_per_weight_with_embeddings"]
    meta = _gguf(tiny_llama, root / "auto.gguf", "auto", target_bpw=target,
                 imatrix=str(root / "imatrix.gguf"))
    return tiny_llama, root, target, meta


def test_file_meets_the_bpw_budget_and_records_its_types(auto_vs_q4km):
    model, root, target, meta = auto_vs_q4km
    info = artifact_info(root / "auto.gguf")
    bpw = info["bits_per_weight_with_embeddings"]  # from the file's tensor bytes
    assert target - 0.02 < bpw <= target, (bpw, target)
    kv, tensors = read_gguf(root / "auto.gguf")
    recorded = gguf_metadata(root / "auto.gguf", kv)["gguf_auto"]
    assert recorded["chosen_bytes"] <= recorded["budget_bytes"]
    assert recorded["chosen_bytes"] > 0.95 * recorded["budget_bytes"]
    written = {n: t.qtype.name for n, t in tensors.items() if len(t.shape) == 2}
    assert {"token_embd.weight", "output.weight"} <= set(written)  # chosen too, not fixed
    assert {n: t["type"] for n, t in recorded["tensors"].items()} == written
    assert recorded["fixed"] == {}
    gains = {n: recorded["tensors"][n]["gains"] for n in ("token_embd.weight", "output.weight")}
    assert gains["token_embd.weight"]["lookup_gain"] > 0 and gains["output.weight"]["head_gain"] > 0
    assert len(set(written.values())) > 1  # a mix, not one type
    assert info["auto_types"]["tensors"] == written
    r = CliRunner().invoke(main, ["info", str(root / "auto.gguf")])
    assert r.exit_code == 0 and "types chosen by --gguf-type auto" in r.output
    assert all(n in r.output for n in written)
    assert "--target-bpw" in meta["command"]


def test_auto_loads_in_llama_cpp_and_beats_uniform_q4_k_m_kld(auto_vs_q4km):
    """Same bits per weight as the uniform Q4_K_M (same imatrix): KLD to the float model
    through llama.cpp's logits on held-out text is lower."""
    pytest.importorskip("llama_cpp")
    from gguf_reference import assert_generates
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.engines.llamacpp import LlamaCppModel

    model, root, _, _ = auto_vs_q4km
    assert_generates(root / "auto.gguf")
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    windows = [tok.encode(heldout_text(src)[:6000], add_special_tokens=False)[:256]
               for src in ("README.md", "tests/test_gguf.py", "quantkit/cli.py", "quantkit/info.py")]
    with torch.no_grad():
        refs = [torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1) for ids in windows]
    kld = {}
    for name in ("auto", "q4km"):
        llm = LlamaCppModel(root / f"{name}.gguf", n_ctx=512, logits_all=True)
        try:
            kld[name] = sum(float((ref.exp() * (ref - torch.log_softmax(
                torch.from_numpy(llm.logits(ids)).double(), -1))).sum(-1).mean())
                for ids, ref in zip(windows, refs, strict=True)) / len(windows)
        finally:
            llm.close()
    print("KLD through llama.cpp:", kld)
    # the goal; measured 0.0031 vs 0.0113 (0.28x) with token_embd/output chosen too
    # (0.0070 vs 0.0112, 0.63x, when they kept Q4_K_M's types)
    assert kld["auto"] < 0.7 * kld["q4km"], kld


def test_target_size_is_the_whole_file(auto_vs_q4km, tmp_path):
    """--target-size counts the whole file (metadata, tokenizer, norms): the file is at most
    that many bytes, and the writer's overhead estimate plus the chosen tensor bytes is the
    file's size to 1 % (imatrix cost alone, no calibration pass: fast). Not "close to the target":
    with token_embd/output chosen too, the next step of one of them can be bigger than what
    is left, and the cheapest choice can leave bytes unspent."""
    model, root, _, _ = auto_vs_q4km
    target = (root / "q4km.gguf").stat().st_size
    out = tmp_path / "sized.gguf"
    meta = _gguf(model, out, "auto", target_size=target, imatrix=str(root / "imatrix.gguf"),
                 gain_batches=0)
    size = out.stat().st_size
    auto = gguf_metadata(out, read_gguf(out)[0])["gguf_auto"]
    assert 0.9 * target < size <= target, (size, target)
    estimate = auto["chosen_bytes"] + auto["file_overhead_bytes_estimate"]  # an upper bound
    assert size <= estimate < 1.01 * size, (size, estimate)
    assert meta["calibration"] is None and "--target-size" in meta["command"]


def test_budgets_outside_q4_k_m_embeddings_range_are_met(auto_vs_q4km, tmp_path):
    """llama.cpp's Q2_K file on this model has 4.52 bits per weight; with Q4_K_M's fixed
    token_embd (Q4_K) / output (Q6_K), auto could make only 5.401-5.664 and refused it. Now
    the file meets it, token_embd/output take fewer bits than in the 5.5-bit file, and stock
    llama.cpp loads it (its token_embd type: get_rows on the CPU, where llama.cpp keeps the
    input layer) and generates. (Imatrix cost alone, no calibration pass: fast; the fixture's
    file has the gains.)"""
    pytest.importorskip("llama_cpp")
    from gguf_reference import assert_generates

    model, root, target_hi, _ = auto_vs_q4km
    out = tmp_path / "low.gguf"
    _gguf(model, out, "auto", target_bpw=4.52, imatrix=str(root / "imatrix.gguf"), gain_batches=0)
    bpw = artifact_info(out)["bits_per_weight_with_embeddings"]
    # within the budget and below the old range; not close to it here: without the gains the
    # solver measures output (5.5 bits) against token_embd (Q2_K) in other units, and no step
    # of the two fits the ~0.26 bits left (the benchmark's run with gains: 4.519)
    assert 4.0 < bpw <= 4.52 < 5.401, bpw
    low, high = (read_gguf(p)[1] for p in (out, root / "auto.gguf"))
    outside = ("token_embd.weight", "output.weight")
    bits = lambda t: GGML_QUANT_SIZES[t.qtype][1] / GGML_QUANT_SIZES[t.qtype][0]  # noqa: E731
    assert sum(bits(low[n]) for n in outside) < sum(bits(high[n]) for n in outside), \
        {n: (low[n].qtype.name, high[n].qtype.name) for n in outside}
    assert_generates(out)


def test_lower_budget_never_buys_a_lower_cost(auto_vs_q4km):
    """The recorded options of every tensor (token_embd / output included) through the solver
    over budgets from all-smallest to all-largest: each choice fits its budget, the summed
    measured cost never rises with the budget, and token_embd/output grow with it."""
    _, root, _, _ = auto_vs_q4km
    kv, _ = read_gguf(root / "auto.gguf")
    tensors = gguf_metadata(root / "auto.gguf", kv)["gguf_auto"]["tensors"]
    cands = {n: [Option(label, b, c) for label, (b, c) in t["options"].items()] for n, t in tensors.items()}
    lo, hi = budget_range(cands)
    outside = ("token_embd.weight", "output.weight")
    costs, sizes = [], []
    for k in range(13):
        budget = lo + (hi - lo) * k // 12
        chosen = allocate(cands, budget, whole=outside)
        used = sum(o.nbytes for o in chosen.values())
        assert used <= budget, (k, used, budget)
        costs.append(sum(o.cost for o in chosen.values()))
        sizes.append(sum(chosen[n].nbytes for n in outside))
    assert all(a >= b for a, b in zip(costs, costs[1:], strict=False)), costs
    assert sizes[0] < sizes[6] < sizes[-1], sizes
