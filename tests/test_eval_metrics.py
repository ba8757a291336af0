"""Known answers for the eval metrics: KLD, top-1, PPL computed here by formula (numpy,
float64) and compared with what quantkit's real eval functions return.

The other eval tests only compare metrics with each other (int8 KLD < int4 KLD, ...): a scorer
that swapped the two distributions, or averaged per batch instead of per token, passes those.
Every case here is built so that such a bug changes the answer by far more than the tolerance
(each test checks that its wrong answer is really different first).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quantkit.eval.logits import PPLConvention, make_windows, score

RTOL = 1e-5  # the scorer works in float32; the references are float64


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl(logp: np.ndarray, logq: np.ndarray) -> np.ndarray:
    """KL(p || q) per position, over the last axis."""
    return (np.exp(logp) * (logp - logq)).sum(-1)


def reference(base_logits: np.ndarray, quant_logits: np.ndarray, windows: np.ndarray) -> dict:
    """The documented convention by formula: position t of a window predicts token t+1; every
    scored token of every window counts once (token mean, not a mean of window or batch means)."""
    lp = _log_softmax(base_logits[:, :-1].astype(np.float64))
    lq = _log_softmax(quant_logits[:, :-1].astype(np.float64))
    tgt = windows[:, 1:]
    tok_lp = np.take_along_axis(lp, tgt[..., None], -1)[..., 0].ravel()
    tok_lq = np.take_along_axis(lq, tgt[..., None], -1)[..., 0].ravel()
    kld = _kl(lp, lq).ravel()
    n = kld.size
    return {
        "n": n,
        "kld": kld,
        "kld_reversed": _kl(lq, lp).ravel(),
        "ppl_base": math.exp(-tok_lp.mean()),
        "ppl_quant": math.exp(-tok_lq.mean()),
        "nll_quant": -tok_lq,
        "top1": float((lp.argmax(-1) == lq.argmax(-1)).mean()),
        "rms_dp": math.sqrt(((np.exp(tok_lq) - np.exp(tok_lp)) ** 2).mean()),
    }


def _lookup_model(table: np.ndarray):
    """A 'model' whose logits for window w are table[w]: windows carry their index in token 0."""
    t = torch.from_numpy(table.astype(np.float32))
    return lambda ids: t[ids[:, 0]]


@pytest.fixture(scope="module")
def case():
    """3 windows of 4 tokens over a 6-token vocabulary, scored in batches of 2 and 1 (so a mean
    of batch means != the token mean); base distributions peaked, quantized ones flatter and
    shifted (so KL(p||q) != KL(q||p)); 9 scored tokens (an odd count: one median)."""
    rng = np.random.default_rng(7)
    n_windows, ctx, vocab = 3, 4, 6
    windows = rng.integers(0, vocab, size=(n_windows, ctx))
    windows[:, 0] = np.arange(n_windows)  # the lookup key
    base = rng.normal(0, 3.0, size=(n_windows, ctx, vocab))
    quant = 0.4 * base + rng.normal(0, 1.0, size=(n_windows, ctx, vocab))
    quant[2] += 2.5 * np.eye(vocab)[windows[2]]  # window 2 (the lone batch) much worse
    return windows, base, quant


def _score(case, batch_size=2):
    windows, base, quant = case
    return score({"base": _lookup_model(base), "quant": _lookup_model(quant)},
                 torch.from_numpy(windows), base="base", batch_size=batch_size)


@pytest.mark.fast
def test_the_case_separates_right_from_wrong_answers(case):
    """The traps are real: reversed KL and a mean of batch means differ clearly."""
    windows, base, quant = case
    ref = reference(base, quant, windows)
    assert abs(ref["kld_reversed"].mean() / ref["kld"].mean() - 1) > 0.2
    nll = ref["nll_quant"].reshape(3, 3)
    batch_mean = (nll[:2].mean() + nll[2].mean()) / 2
    assert abs(math.exp(batch_mean) / ref["ppl_quant"] - 1) > 0.05
    assert 0.2 < ref["top1"] < 0.9  # some positions agree, some do not


@pytest.mark.fast
def test_kld_statistics_by_formula(case):
    windows, base, quant = case
    ref = reference(base, quant, windows)
    got = _score(case)["quant"]
    kld = got["kld"]
    assert kld["mean"] == pytest.approx(ref["kld"].mean(), rel=RTOL)
    assert kld["median"] == pytest.approx(float(np.median(ref["kld"])), rel=RTOL)
    assert kld["p99"] == pytest.approx(float(np.quantile(ref["kld"], 0.99)), rel=RTOL)
    assert kld["max"] == pytest.approx(ref["kld"].max(), rel=RTOL)
    assert kld["stderr"] == pytest.approx(ref["kld"].std(ddof=1) / math.sqrt(ref["n"]), rel=1e-4)
    # and not the reverse direction
    assert kld["mean"] != pytest.approx(ref["kld_reversed"].mean(), rel=0.05)


@pytest.mark.fast
def test_ppl_top1_and_delta_p_by_formula(case):
    windows, base, quant = case
    ref = reference(base, quant, windows)
    res = _score(case)
    assert res["base"]["ppl"]["value"] == pytest.approx(ref["ppl_base"], rel=RTOL)
    assert res["quant"]["ppl"]["value"] == pytest.approx(ref["ppl_quant"], rel=RTOL)
    assert res["quant"]["scored_tokens"] == res["base"]["scored_tokens"] == ref["n"] == 9
    se = ref["nll_quant"].std(ddof=1) / math.sqrt(ref["n"])
    assert res["quant"]["nll"]["stderr"] == pytest.approx(se, rel=1e-4)
    assert res["quant"]["top1_agreement"]["value"] == pytest.approx(ref["top1"], abs=1e-12)
    assert res["quant"]["rms_delta_p"]["value"] == pytest.approx(ref["rms_dp"], rel=1e-4)
    assert "kld" not in res["base"]  # the base is not compared with itself


@pytest.mark.fast
@pytest.mark.parametrize("batch_size", [1, 2, 3, 4])
def test_batching_does_not_change_any_metric(case, batch_size):
    """Token means, whatever the batch split (2+1, 1+1+1, 3, one short batch of 3 for 4)."""
    ref = _score(case, batch_size=2)["quant"]
    got = _score(case, batch_size=batch_size)["quant"]
    for key in ("ppl", "nll"):
        assert got[key]["value"] == pytest.approx(ref[key]["value"], rel=RTOL)
    for stat in ("mean", "median", "p99", "max"):
        assert got["kld"][stat] == pytest.approx(ref["kld"][stat], rel=RTOL)


@pytest.mark.fast
@pytest.mark.parametrize("rows", [1, 2])
def test_row_chunks_do_not_change_any_metric(case, rows, monkeypatch):
    """score() works SCORE_ROWS positions at a time: with 1 or 2 rows per chunk (3 positions per
    window: several chunks, the last one short) and two compared models, every metric still
    equals the formula, so each chunk meets its own base chunk."""
    import quantkit.eval.logits

    monkeypatch.setattr(quantkit.eval.logits, "SCORE_ROWS", rows)
    windows, base, quant = case
    ref = reference(base, quant, windows)
    res = score({"base": _lookup_model(base), "same": _lookup_model(base),
                 "quant": _lookup_model(quant)}, torch.from_numpy(windows), base="base",
                batch_size=2)
    got = res["quant"]
    assert got["kld"]["mean"] == pytest.approx(ref["kld"].mean(), rel=RTOL)
    assert got["kld"]["max"] == pytest.approx(ref["kld"].max(), rel=RTOL)
    assert got["ppl"]["value"] == pytest.approx(ref["ppl_quant"], rel=RTOL)
    assert got["top1_agreement"]["value"] == pytest.approx(ref["top1"], abs=1e-12)
    assert got["rms_delta_p"]["value"] == pytest.approx(ref["rms_dp"], rel=1e-4)
    assert got["scored_tokens"] == ref["n"]
    assert res["same"]["kld"]["max"] == 0 and res["same"]["top1_agreement"]["value"] == 1


@pytest.mark.fast
def test_identical_models_score_zero_kld_and_full_agreement(case):
    windows, base, _ = case
    res = score({"base": _lookup_model(base), "same": _lookup_model(base)},
                torch.from_numpy(windows), base="base", batch_size=2)["same"]
    assert res["kld"]["max"] == pytest.approx(0.0, abs=1e-6)
    assert res["top1_agreement"]["value"] == 1.0
    assert res["ppl"]["value"] == pytest.approx(reference(base, base, windows)["ppl_base"], rel=RTOL)


# ---------------------------------------------------------------- make_windows

class _CharTokenizer:
    """One token per character; `bos` decides whether the tokenizer itself adds a BOS."""

    name_or_path = "chars"

    def __init__(self, bos: bool):
        self.bos_token_id = 0 if bos else None

    def __call__(self, text, add_special_tokens=True):
        ids = [ord(c) for c in text]
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return {"input_ids": ids}


@pytest.mark.fast
@pytest.mark.parametrize("bos", [False, True])
def test_make_windows_by_the_convention(bos):
    """Non-overlapping windows from the start, remainder dropped, at most max_windows; with a
    BOS-adding tokenizer each window is BOS + ctx-1 text tokens."""
    text = "abcdefghijklmnopqrstuvwxyz"
    tok = _CharTokenizer(bos)
    windows, got_bos = make_windows(tok, text, PPLConvention(ctx=5, max_windows=3))
    assert got_bos is bos
    step = 4 if bos else 5
    expect = [[ord(c) for c in text[i * step:(i + 1) * step]] for i in range(3)]
    if bos:
        expect = [[0, *row] for row in expect]
    assert windows.tolist() == expect
    # 26 characters hold 5 windows of 5 (one dropped letter): max_windows caps it, not the text
    assert make_windows(tok, text, PPLConvention(ctx=5, max_windows=99))[0].shape[0] == (6 if bos else 5)
    with pytest.raises(ValueError, match="fewer than one window"):
        make_windows(tok, "abc", PPLConvention(ctx=5))


# ---------------------------------------------------------------- the harness, end to end

def test_harness_scores_artifact_against_base_by_formula(tiny_model_factory):
    """`evaluate(artifact, base)` on two different tiny models: the record's PPL, base PPL,
    KLD (direction: base || artifact) and top-1 equal the formula on logits computed here with
    plain transformers on windows cut here by the documented convention."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.calibration import load_heldout_text
    from quantkit.eval.harness import evaluate

    base_dir = tiny_model_factory("llama", name="base", seed=1)
    art_dir = tiny_model_factory("llama", name="skewed", seed=1)
    # the "artifact": the base with 20 output rows x8, so it piles mass on 20 tokens where the
    # base has little: KL(base || art) ~ 0.6 but KL(art || base) ~ 2 (random logits of two
    # unrelated models give nearly symmetric KLs, which would not catch a swap)
    skewed = AutoModelForCausalLM.from_pretrained(art_dir)
    with torch.no_grad():
        skewed.lm_head.weight[:20].mul_(8)
    skewed.save_pretrained(art_dir)
    conv = PPLConvention(ctx=64, max_windows=3, batch_size=2)
    rec, = evaluate([str(art_dir)], str(base_dir), conv=conv)

    tok = AutoTokenizer.from_pretrained(base_dir)
    text, _ = load_heldout_text("mixed")
    ids = tok(text, add_special_tokens=False)["input_ids"][:3 * 64]  # SmolLM2's adds no BOS
    windows = torch.tensor(ids).view(3, 64)

    def logits(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            return model(input_ids=windows).logits.double().numpy()

    ref = reference(logits(base_dir), logits(art_dir), windows.numpy())
    m = rec["metrics"]
    assert abs(ref["kld_reversed"].mean() / ref["kld"].mean() - 1) > 0.2  # the direction shows
    assert m["kld"]["mean"] == pytest.approx(ref["kld"].mean(), rel=1e-4)
    assert m["kld"]["max"] == pytest.approx(ref["kld"].max(), rel=1e-4)
    assert m["ppl"]["value"] == pytest.approx(ref["ppl_quant"], rel=1e-5)
    assert m["base_ppl"]["value"] == pytest.approx(ref["ppl_base"], rel=1e-5)
    assert m["top1_agreement"]["value"] == pytest.approx(ref["top1"], abs=1e-12)
    assert rec["convention"]["scored_tokens"] == ref["n"] == 3 * 63
