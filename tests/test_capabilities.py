"""The engine probe (quantkit.engines.capabilities), `quantkit doctor`, the skip allow-list,
and engine failures a user can act on. The probe must agree with what vLLM really does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import run_cli
from vllm_checks import vllm_runs

from quantkit.engines.capabilities import (
    FP8_SLOW_FACTOR,
    explain_vllm_failure,
    vllm_cannot_run,
    vllm_capabilities,
    vllm_dtype,
    vllm_too_slow_to_time,
)
from quantkit.engines.vllm import run_vllm
from quantkit.errors import EngineError, QuantkitError
from quantkit.machine import torch_cpu_bf16_native
from quantkit.pipeline.quantize import CPU_DTYPE_ENV, compute_dtype_for
from quantkit.types import QuantScheme

REPO = Path(__file__).parents[1]


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return run_cli(args, env=env, timeout=timeout, cwd=REPO)


def test_probe_reads_vllm_ops_and_is_cached():
    caps = vllm_capabilities()
    assert caps.available, caps.error
    assert caps.version == "0.32.0" and caps.platform == "CpuPlatform"
    # the int4 kernel ships in vLLM's AVX512 builds (_C, _C_AVX512), not in _C_AVX2
    assert caps.kernel_library in ("_C", "_C_AVX512", "_C_AVX2")
    assert caps.int4_wna16 == (caps.kernel_library != "_C_AVX2")
    assert caps.int4_wna16 == (caps.ops["cpu_gemm_wna16"] is not None)
    assert caps.wna16_weight_types == ["uint4", "uint4b8"]
    cached = Path(caps.cache_file)
    stamp = cached.stat().st_mtime_ns
    assert json.loads(cached.read_text())["vllm_version"] == "0.32.0"
    from quantkit.engines import capabilities

    capabilities._capabilities.cache_clear()  # a new process: reads the cache, no new probe
    again = vllm_capabilities()
    assert again.to_dict() == caps.to_dict() and cached.stat().st_mtime_ns == stamp


def test_reason_phrases_follow_the_probe():
    caps = vllm_capabilities()
    int4 = vllm_cannot_run("int4")
    assert (int4 is None) == caps.int4_wna16
    # the three ways of naming a scheme agree
    assert vllm_cannot_run(QuantScheme(bits=4, group_size=64)) == int4
    assert vllm_cannot_run({"kind": "int", "bits": 4, "group_size": 64}) == int4
    if int4:
        assert int4 == "vLLM has no int4 CPU kernel on this CPU (cpu_gemm_wna16; needs AVX512)"
    assert (vllm_cannot_run({"kind": "fp8", "bits": 8, "group_size": 0}) is None) == caps.fp8_static
    assert (vllm_cannot_run("fp8-block") is None) == caps.fp8_block
    assert (vllm_cannot_run("fp8-dynamic") is None) == caps.fp8
    assert "llama.cpp" in vllm_cannot_run("gguf")
    with pytest.raises(ValueError, match="unknown scheme"):
        vllm_cannot_run("int4-but-not-really")
    log = "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"
    assert explain_vllm_failure(log) == ("vLLM has no int4 CPU kernel on this CPU "
                                         "(cpu_gemm_wna16; needs AVX512)")
    w8a16 = ("CPUWNA16LinearKernel cannot implement due to: Quant type (uint8b128) not supported "
             "by CPUWNA16, supported types are: (ScalarType.uint4, ScalarType.uint4b8)")
    assert explain_vllm_failure(w8a16) == vllm_cannot_run("int8")  # measured with RTN W8A16
    assert explain_vllm_failure("ValueError: something else") is None
    # FP4: vLLM's own kernel choice for one Linear (what its load calls), per scheme
    for kind, activations, group in (("nvfp4", None, 16), ("nvfp4", "dynamic", 16),
                                     ("mxfp4", None, 32)):
        ok, why = caps.kernels[f"choice:{kind}_{'w4a4' if activations else 'w4a16'}"]
        got = vllm_cannot_run({"kind": kind, "bits": 4, "group_size": group,
                               "activations": activations})
        assert (got is None) == ok, (kind, activations, got, why)
        assert got == vllm_cannot_run(kind + ("-w4a4" if activations else ""))
        assert ok or why.rstrip(". :") in got
    marlin = ("ValueError: Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported: "
              "Marlin FP4 not available")
    assert "MarlinNvFp4LinearKernel" in explain_vllm_failure(marlin)
    # FP8 runs wherever torch._scaled_mm does, but may be a scalar reference path: the probe
    # times it against bf16, and speed is not measured where it is far slower
    if caps.fp8:
        assert caps.fp8_vs_bf16_time is not None and caps.fp8_vs_bf16_time > 0
        slow = vllm_too_slow_to_time("fp8-dynamic")
        assert (slow is None) == (caps.fp8_vs_bf16_time <= FP8_SLOW_FACTOR)
    assert vllm_too_slow_to_time("int4") is None
    # quantized experts go through vLLM's fused-MoE kernels, not the Linear ones
    assert (vllm_cannot_run("int4", moe=True) is None) == (caps.int4_wna16 and caps.moe_quantized)
    assert vllm_cannot_run("fp8-dynamic", moe=True) == vllm_cannot_run("fp8-static", moe=True)
    assert "128x128 block-scaled experts" in vllm_cannot_run("fp8-dynamic", moe=True)
    assert explain_vllm_failure("ValueError: Unsupported FP8 MoE backend: NONE") == \
        vllm_cannot_run("fp8-dynamic", moe=True)
    assert "AMX" in explain_vllm_failure(
        "NotImplementedError: No WNA16 MoE backend supports the deployment configuration.")


def test_moe_routing_the_int4_moe_kernel_takes():
    """vLLM's int4 fused-MoE CPU kernel takes softmax routings only; the probe asks its class
    (CPUExpertsInt4) which. A model's routing is named as vLLM's get_routing_method_type does:
    a router with a score-correction bias scores by sigmoid (grouped: DeepSeekV3, else
    MiniMax2), Llama 4 has its own, a softmax router renormalising its top-k is
    RenormalizeNaive. Where the kernel runs at all (AMX), a sigmoid router is still refused."""
    import transformers

    from quantkit.engines.capabilities import VllmExperts, vllm_moe_activation, vllm_moe_routing

    caps = vllm_capabilities()
    bias = ["model.layers.0.mlp.gate.e_score_correction_bias"]
    qwen = transformers.Qwen3MoeConfig(norm_topk_prob=True).to_dict()
    assert vllm_moe_routing(qwen, []) == "RenormalizeNaive"
    assert vllm_moe_routing({**qwen, "norm_topk_prob": False}, []) == "Default"
    assert vllm_moe_routing(qwen, bias) == "MiniMax2"
    assert vllm_moe_routing({**qwen, "n_group": 2}, bias) == "DeepSeekV3"
    assert vllm_moe_routing(transformers.Qwen3Config().to_dict(), []) is None
    assert vllm_moe_routing(transformers.Llama4TextConfig().to_dict(), []) == "Llama4"
    # the experts' activation vLLM's model files pass (gpt_oss.py: swigluoai; default silu)
    assert vllm_moe_activation(qwen) == "silu"
    assert vllm_moe_activation(transformers.GptOssConfig().to_dict()) == "swigluoai"
    # discovered from the experts' act_fn: Nemotron-H's ungated relu^2 experts
    from discovered_families import _COMMON, FAMILIES

    nemotron = FAMILIES["nemotron_h"]
    config = getattr(transformers, nemotron.config_cls)(**{**_COMMON, **nemotron.settings})
    assert vllm_moe_activation({**config.to_dict(), "architectures": [nemotron.model_cls]}) == \
        "relu2_no_mul"
    if caps.moe_quantized:  # AMX: the kernel runs, softmax routings and SiLU experts only
        assert caps.moe_int4_routing == ["Default", "Renormalize", "RenormalizeNaive"]
        assert caps.moe_int4_activations == ["silu"]
        assert vllm_cannot_run("int4", experts=VllmExperts("RenormalizeNaive", "swigluoai")) == (
            "vLLM's int4 fused-MoE CPU kernel (CPUExpertsInt4) takes the experts' activations "
            "silu only, not this model's swigluoai")
    if vllm_cannot_run("int4", moe=True) is None:
        assert vllm_cannot_run("int4", experts=VllmExperts("RenormalizeNaive")) is None
        assert vllm_cannot_run("int4", experts=VllmExperts("MiniMax2")) == (
            "vLLM's int4 fused-MoE CPU kernel (CPUExpertsInt4) takes the routing methods "
            "Default, Renormalize, RenormalizeNaive only, not this model's MiniMax2")
        # Llama 4 multiplies the routing weight into the experts' input (at the first forward)
        assert vllm_cannot_run("int4", experts=VllmExperts("Llama4")) == explain_vllm_failure(
            "AssertionError: apply_router_weight_on_input is only implemented for topk=1")
        assert not caps.moe_int4_weight_on_input
    else:  # no kernel at all: that reason, whatever the routing
        assert vllm_cannot_run("int4", experts=VllmExperts("MiniMax2")) == \
            vllm_cannot_run("int4", moe=True)


@pytest.mark.engine
def test_probe_agrees_with_vllm_on_a_tiny_int4_artifact(tiny_llama, tmp_path):
    """Whichever way the probe answers, real vLLM does the same with a tiny int4 artifact."""
    from quantkit.pipeline.quantize import QuantizeRequest, quantize

    art = tmp_path / "tiny-w4"
    quantize(QuantizeRequest(model=str(tiny_llama), method="rtn",
                             scheme=QuantScheme(bits=4, group_size=64), out=art))
    prompt = [{"prompt": "The capital of France is", "max_tokens": 2}]
    if vllm_runs("int4"):
        res = run_vllm(art, generate=prompt, max_model_len=128)
        assert isinstance(res["generate"][0], str)
        return
    with pytest.raises(EngineError) as exc:
        run_vllm(art, generate=prompt, max_model_len=128)
    err = exc.value
    # the refusal is the one the probe predicted, said as the probe says it, log on disk
    assert err.reason == vllm_cannot_run("int4")
    assert err.message.endswith("(vLLM said: AttributeError: '_OpNamespace' '_C' object has no "
                                "attribute 'cpu_gemm_wna16').")
    assert "quantkit doctor" in err.hint and str(err.log_path) in err.hint
    assert err.log_path.read_text() == err.log and "CPUWNA16LinearKernel" in err.log


def test_doctor_text_and_json():
    caps = vllm_capabilities()
    res = _cli("doctor")
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert "Traceback" not in text + res.stderr
    assert f"compiled ops: {caps.kernel_library}" in text
    line = next(x for x in text.splitlines() if "int4 weight-only GEMM (cpu_gemm_wna16)" in x)
    assert line.split()[-1] == ("yes" if caps.int4_wna16 else "MISSING")
    int4_row = next(x for x in text.splitlines() if "int4 RTN / GPTQ / AWQ" in x)
    if not caps.int4_wna16:  # what it means, and what to use instead, on the next line
        assert int4_row.strip().startswith("NO") and vllm_cannot_run("int4") in int4_row
        after = text.splitlines()[text.splitlines().index(int4_row) + 1]
        assert "instead:" in after and "--speed-engine transformers" in after
    res = _cli("doctor", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["vllm"]["int4_wna16"] == caps.int4_wna16
    assert report["llamacpp"]["available"] and "AVX2" in report["llamacpp"]["features"]
    assert report["memory"]["available_bytes"] > 0 and report["cpu"]["cores"] >= 1
    rows = {r["what"]: r for r in report["what_runs_here"]}
    assert rows["GGUF artifacts (--method gguf) in llama.cpp"]["runs"]
    assert not rows["TensorRT-LLM"]["runs"]
    fp4 = rows["NVFP4 weight-only artifacts (--method nvfp4) in vLLM"]
    assert fp4["runs"] == (vllm_cannot_run("nvfp4") is None)
    assert fp4["runs"] or "Marlin" in fp4["reason"] or "kernel" in fp4["reason"]
    native = torch_cpu_bf16_native()
    assert report["torch"]["cpu_bf16_native"] == native
    assert ("CPU bf16 GEMM: native" if native else "CPU bf16 GEMM: emulated") in text


@pytest.mark.fast
def test_cpu_compute_dtype_follows_torch_and_the_checkpoint(monkeypatch):
    """Calibration on the CPU runs in bf16 only where torch says its bf16 GEMMs are native,
    only for bf16 checkpoints (no rounding of float16 / float32 weights), only when there is a
    forward to speed up, never under --reproducible; the environment variable overrides."""
    import torch

    bf16, f32 = torch.bfloat16, torch.float32
    monkeypatch.delenv(CPU_DTYPE_ENV, raising=False)
    assert compute_dtype_for("cpu", bf16, True) == (bf16 if torch_cpu_bf16_native() else f32)
    assert compute_dtype_for("cpu", bf16, False) == f32
    assert compute_dtype_for("cpu", torch.float16, True) == f32
    assert compute_dtype_for("cpu", f32, True) == f32
    assert compute_dtype_for("cpu", bf16, True, reproducible=True) == f32
    assert compute_dtype_for("cuda:0", f32, False) == bf16
    monkeypatch.setenv(CPU_DTYPE_ENV, "float32")
    assert compute_dtype_for("cpu", bf16, True) == f32
    monkeypatch.setenv(CPU_DTYPE_ENV, "bfloat16")
    assert compute_dtype_for("cpu", torch.float16, False) == bf16
    monkeypatch.setenv(CPU_DTYPE_ENV, "half")
    with pytest.raises(QuantkitError) as e:
        compute_dtype_for("cpu", bf16, True)
    assert CPU_DTYPE_ENV in e.value.message and "float32" in e.value.hint



def test_vllm_dtype_float32_only_where_bf16_is_emulated_and_the_kernel_takes_it(
        smollm_path, rtn4_artifact, tmp_path):
    """vLLM runs in float32 only where its torch emulates bf16 (the probe asks it; ~3x faster
    there: benchmarks/vllm_dtype_cpu.py) and only for checkpoints whose CPU kernels take
    float32 inputs; int4 (16-bit kernel inputs), FP8 KV caches and foreign quantized
    checkpoints keep bfloat16. Real vLLM's own answer is checked in test_engines_vllm."""
    caps = vllm_capabilities()
    # vLLM's torch and quantkit's answer alike about this CPU's bf16 GEMMs
    assert caps.bf16_native == torch_cpu_bf16_native()
    emulated = "bfloat16" if caps.bf16_native else "float32"
    assert vllm_dtype(smollm_path) == emulated  # a dense checkpoint
    assert vllm_dtype(rtn4_artifact) == "bfloat16"  # int4 weight-only
    foreign = tmp_path / "foreign"  # the same artifact without quantkit.json: scheme unknown
    shutil.copytree(rtn4_artifact, foreign)
    (foreign / "quantkit.json").unlink()
    assert vllm_dtype(foreign) == "bfloat16"
    meta = json.loads((rtn4_artifact / "quantkit.json").read_text())
    for scheme, kv in (({"kind": "int", "bits": 8, "group_size": -1, "activations": "dynamic"},
                        False),
                       ({"kind": "fp8", "bits": 8, "group_size": -1}, False),
                       ({"kind": "fp8", "bits": 8, "group_size": -1}, True),
                       ({"kind": "fp8", "bits": 8, "group_size": 128}, False)):
        (foreign / "quantkit.json").write_text(json.dumps({**meta, "scheme": scheme}))
        config = json.loads((rtn4_artifact / "config.json").read_text())
        if kv:
            config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float",
                                                                "dynamic": False}
        (foreign / "config.json").write_text(json.dumps(config))
        takes_float32 = scheme["group_size"] < 0 and not kv
        assert vllm_dtype(foreign) == (emulated if takes_float32 else "bfloat16"), (scheme, kv)
    # `compare --speed` reuses a stored vLLM speed only if it ran in the dtype chosen now
    # (records from before the float32 choice carry no dtype: they ran in bf16)
    from quantkit.report.compare import _same_dtype

    assert _same_dtype({"engine": "vllm", "dtype": emulated}, str(smollm_path))
    assert _same_dtype({"engine": "vllm"}, str(smollm_path)) == (emulated == "bfloat16")
    assert _same_dtype({"engine": "vllm", "dtype": "float32"}, str(rtn4_artifact)) is False


def test_doctor_without_vllm_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    res = _cli("doctor")
    assert res.returncode == 0, res.stderr
    assert f"vLLM       not usable: vLLM is not installed where quantkit looks for it ({tmp_path}" \
        in res.stdout
    assert "instead: install vLLM (`bash scripts/setup.sh`" in res.stdout


@pytest.mark.engine
def test_eval_speed_of_int4_in_vllm_keeps_accuracy_and_says_what_to_do(rtn4_artifact, tmp_path):
    """issue 21: `quantkit eval INT4 --speed` on a CPU without vLLM's int4 kernel scores the
    held-out text, saves it, does not start vLLM, and ends with a sentence the user can act on;
    where the kernel exists the same command measures speed in vLLM."""
    out = tmp_path / "eval.json"
    res = _cli("eval", str(rtn4_artifact), "--ctx", "64", "--max-windows", "2", "--speed",
               "--speed-prompt", "16", "--speed-gen", "4", "--speed-batch", "1", "--repeats", "1",
               "--json", str(out))
    record = json.loads(out.read_text())
    assert record["metrics"]["ppl"]["value"] > 1  # the accuracy part, saved
    assert "Traceback" not in res.stdout + res.stderr
    if vllm_runs("int4"):
        assert res.returncode == 0, res.stderr
        assert record["speed"]["engine"] == "vllm" and record["speed"]["batch_1"]
        return
    assert res.returncode == 2, res.stdout + res.stderr
    err = " ".join(res.stderr.split())  # rich may wrap long lines
    assert f"error: --speed did not run: {rtn4_artifact} cannot run in vLLM here: " \
           f"{vllm_cannot_run('int4')}." in err
    assert f"Run `quantkit eval {rtn4_artifact} --speed --speed-engine transformers` instead" in err
    assert "quantkit doctor" in err
    assert f"saved in {out}" in err
    assert record["speed"] == {"engine": "vllm", "unmeasured": vllm_cannot_run("int4")}


_SKIPPING_TESTS = '''
import pytest
from vllm_checks import engine_check


def test_listed_skip():
    pytest.skip("allowed here")


def test_unlisted_skip():
    pytest.skip("a missing feature")


def test_refusal_recorded():
    engine_check("vllm int4", real=False, reason="no kernel here")
'''


def test_unlisted_skip_fails_the_run_and_refusals_are_summarised(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    for f in ("conftest.py", "vllm_checks.py", "tiny_models.py", "moe_models.py",
              "discovered_families.py"):
        shutil.copy2(REPO / "tests" / f, tests / f)
    (tests / "allowed_skips.txt").write_text(
        "# comment\ntests/test_s.py::test_listed_skip | a reason\n")
    (tests / "test_s.py").write_text(_SKIPPING_TESTS)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/test_s.py"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    out = res.stdout
    assert res.returncode == 1, out
    assert "1 failed, 1 passed, 1 skipped" in out
    assert "skipped, and not on tests/allowed_skips.txt" in out and "a missing feature" in out
    assert "0 ran the real engine; 1 asserted the engine's refusal" in out
    assert "refusal x1: vllm int4: no kernel here" in out


def test_the_quantkit_command_starts_with_malloc_huge_pages_where_they_help():
    """The `quantkit` command (quantkit.launch) starts itself again with glibc's malloc asking
    for transparent huge pages where the kernel's THP mode is madvise (a CPU GPTQ run of SmolLM2
    spent ~11 % of its time faulting in fresh 4 KiB pages), keeps the user's other tunables,
    and leaves malloc alone when asked (QUANTKIT_HUGE_PAGES=0) or when GLIBC_TUNABLES already
    names hugetlb. `quantkit doctor` reports the state of its own process."""
    from quantkit.machine import _glibc_version, _thp_mode, huge_page_env

    script = Path(sys.executable).parent / "quantkit"
    assert script.is_file(), f"{script}: the console script of this venv"
    mode, glibc = _thp_mode(), _glibc_version()
    helps = mode == "madvise" and glibc is not None and glibc >= (2, 35)

    def doctor_state(**extra: str) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("QUANTKIT_HUGE_PAGES",)}
        env.update(extra)
        r = subprocess.run([str(script), "doctor", "--json"], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)["memory"]["malloc_huge_pages"]

    state = doctor_state(GLIBC_TUNABLES="glibc.malloc.arena_max=4")
    if helps:
        assert state["on"] and "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1" in state["why"], state
    else:
        assert state["on"] == (mode == "always"), state
    off = doctor_state(GLIBC_TUNABLES="", QUANTKIT_HUGE_PAGES="0")
    assert off["on"] == (mode == "always"), off
    assert huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None
    assert huge_page_env({"QUANTKIT_HUGE_PAGES": "0"}) is None
    assert (huge_page_env({}) is not None) == helps


def test_speed_is_reused_only_under_the_same_malloc_setting(monkeypatch):
    """A speed record measured with glibc's malloc huge pages on is not reused by a process
    without them (or the other way round): fresh memory comes at a different speed."""
    from quantkit.eval.speed import speed_settings
    from quantkit.report.compare import _speed_reusable

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    with_pages = speed_settings("llamacpp")
    monkeypatch.setenv("GLIBC_TUNABLES", "")
    monkeypatch.setenv("QUANTKIT_HUGE_PAGES", "0")
    without = speed_settings("llamacpp")
    if with_pages["malloc_huge_pages"] == without["malloc_huge_pages"]:  # THP mode always
        assert with_pages["malloc_huge_pages"] is True
        return
    assert with_pages["malloc_huge_pages"] is True and without["malloc_huge_pages"] is False
    stored = {"engine": "llamacpp", "settings": with_pages}
    assert _speed_reusable(stored, with_pages)
    assert not _speed_reusable(stored, without)
