"""Shared fixtures: the built-in real model, its RTN artifacts, tiny random models."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# lm-eval results are reused within one test session only: a rerun never passes on old results
os.environ["QUANTKIT_LMEVAL_CACHE"] = tempfile.mkdtemp(prefix="quantkit-test-lmeval-")
atexit.register(shutil.rmtree, os.environ["QUANTKIT_LMEVAL_CACHE"], True)

from tiny_models import make_tiny_model  # noqa: E402

# the tiny MoE models every tests/test_moe_*.py shares, and the discovered families' models
# (tests/test_discovered_families*.py), built once per session
pytest_plugins = ["moe_models", "discovered_families"]


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    from quantkit.model_io import resolve_model

    return resolve_model("smollm2-135m").path


def _rtn(tmp_path_factory, bits: int) -> Path:
    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.types import QuantScheme

    out = tmp_path_factory.mktemp("session-rtn") / f"smollm2-rtn-w{bits}g64"
    quantize(QuantizeRequest(model="smollm2-135m", method="rtn",
                             scheme=QuantScheme(bits=bits, group_size=64), out=out))
    return out


@pytest.fixture(scope="session")
def rtn4_artifact(tmp_path_factory) -> Path:
    return _rtn(tmp_path_factory, 4)


@pytest.fixture(scope="session")
def rtn8_artifact(tmp_path_factory) -> Path:
    return _rtn(tmp_path_factory, 8)


@pytest.fixture(scope="session")
def smollm2_gptq_artifacts(tmp_path_factory) -> dict[str, Path]:
    """SmolLM2 GPTQ int4 g64 sym with static act-order (groups stay k // 64: RTN's storage
    scheme, the act-order vLLM 0.32 loads) as a GPTQ v1 checkpoint, 8 x 256 calibration tokens
    of `mixed`: loaded by real vLLM (test_gptq) and scored against RTN at the same scheme
    (test_accuracy_guards; without act-order these 2048 tokens gave KLD 0.364 vs RTN 0.399,
    0.91x). The compressed-tensors export of the same codes is checked on tiny models
    (test_gptq::test_quantize_end_to_end) and that format's int4 path in vLLM on SmolLM2 by
    test_engines_vllm / test_awq: a second SmolLM2 GPTQ run cost the CI budget ~2 min."""
    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.types import QuantScheme

    root = tmp_path_factory.mktemp("session-smollm2-gptq")
    out = {"gptq": root / "gptq"}
    quantize(QuantizeRequest(model="smollm2-135m", method="gptq",
                             scheme=QuantScheme(bits=4, group_size=64, act_order=True),
                             out=out["gptq"], format="gptq",
                             calib_samples=8, calib_seqlen=256))  # 2048 tokens > 1536
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("session-tiny") / "llama", "llama")


@pytest.fixture
def tiny_model_factory(tmp_path):
    def make(arch: str = "llama", name: str | None = None, **kw) -> Path:
        return make_tiny_model(tmp_path / (name or arch), arch, **kw)
    return make


# ------------------------------------ disk: a module's temporary dirs end with the module ----
# CI machines may have little free disk (a run died with ENOSPC at 75 %, its /tmp full of
# model copies). Passing tests' tmp_path dirs go at once (pyproject.toml:
# tmp_path_retention_policy = "failed"); the dirs a module's fixtures made with
# tmp_path_factory go when the module ends, unless one of its tests failed. Session-wide
# fixtures name theirs "session-*": they are kept until pytest removes the run's base dir.

_MODULES_WITH_FAILURES: set[str] = set()


@pytest.fixture(scope="module", autouse=True)
def _module_temp_dirs_removed_at_module_end(request, tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if request.node.nodeid in _MODULES_WITH_FAILURES:
        return  # kept for debugging, like a failed test's tmp_path
    for path in set(base.iterdir()) - before:
        if path.name.startswith("session-"):
            continue
        if path.is_symlink():  # pytest's "<name>current" link to the newest numbered dir
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------- skips: only those on the allow-list ----
# A skip must not stand in for a missing feature or a missing engine: every skip whose test id
# is not on tests/allowed_skips.txt (with the reason it may skip) fails the run.

_ALLOWED_SKIPS = Path(__file__).with_name("allowed_skips.txt")


def _allowed_skip_patterns() -> list[str]:
    """Test-id patterns (fnmatch) of tests/allowed_skips.txt: `PATTERN | why it may skip`."""
    patterns = []
    for line in _ALLOWED_SKIPS.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pattern, sep, why = line.partition("|")
        if not sep or not why.strip():
            raise pytest.UsageError(f"{_ALLOWED_SKIPS}: {line!r} has no '| reason'; every "
                                    "allowed skip states why it may skip")
        patterns.append(pattern.strip())
    return patterns


def _unlisted_skip(report) -> bool:
    from fnmatch import fnmatch

    if not report.skipped or hasattr(report, "wasxfail"):
        return False
    nodeid = report.nodeid or "?"
    return not any(fnmatch(nodeid, p) or nodeid.startswith(p) for p in _allowed_skip_patterns())


def _as_failure(report) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"skipped, and not on tests/allowed_skips.txt: {reason}\n"
                       "Make the test run (install what it needs: scripts/setup.sh), or add "
                       "'TEST_ID | why it may skip' to tests/allowed_skips.txt.")


def pytest_configure(config):
    """vLLM's fork server imports vLLM now, in the background, for the whole session: every
    vLLM run (here and in CLI subprocesses) forks from it instead of importing vLLM again
    (quantkit/engines/forkserver.py; QUANTKIT_FORKSERVER=off turns it off)."""
    from quantkit.engines.forkserver import SHARED_ENV
    from quantkit.engines.vllm import share_vllm_forkserver
    from quantkit.errors import EngineError

    if os.environ.get(SHARED_ENV, "").lower() in ("off", "0", "no"):
        return
    if config.getoption("markexpr", "").strip() == "fast":
        return  # the fast tier runs no engine: importing vLLM would only take a core from it
    try:
        share_vllm_forkserver()
    except EngineError:  # no vLLM venv: the engine tests say so themselves
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if _unlisted_skip(report):
        _as_failure(report)
    elif call.when == "call" and item.get_closest_marker("engine") and report.passed:
        report.user_properties.append(("engine_test_passed", item.nodeid))
    if report.failed:
        _MODULES_WITH_FAILURES.add(item.nodeid.split("::")[0])
    if call.when == "teardown":
        # carried on the report, so a controller process (pytest-xdist) could print it too
        from vllm_checks import ENGINE_CHECKS

        report.user_properties += [("engine_check", asdict(c)) for c in ENGINE_CHECKS
                                   if c.test == item.nodeid]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    if _unlisted_skip(report):  # e.g. a module-level importorskip
        _as_failure(report)


# --------------------------------------- end of run: real engine checks vs refusals ----

_ENGINE_TESTS_PASSED: list[str] = []
_ENGINE_CHECKS: list[dict] = []


def pytest_runtest_logreport(report):
    """Collect the engine records of every test, from this process or an xdist worker."""
    for key, value in getattr(report, "user_properties", ()):
        if key == "engine_test_passed":
            _ENGINE_TESTS_PASSED.append(value)
        elif key == "engine_check":
            _ENGINE_CHECKS.append(value)


def pytest_terminal_summary(terminalreporter):
    from vllm_checks import EngineCheck

    checks = [EngineCheck(**c) for c in _ENGINE_CHECKS]
    recorded = {c.test for c in checks}
    real = [c.test + f" [{c.kind}]" for c in checks if c.real]
    real += [t for t in _ENGINE_TESTS_PASSED if t not in recorded]  # engine tests with no probe
    refused = [c for c in checks if not c.real]
    if not real and not refused:
        return
    tr = terminalreporter
    tr.section("real-engine checks")
    tr.write_line(f"{len(real)} ran the real engine; {len(refused)} asserted the engine's refusal "
                  "(the probe said it has no kernel here; `quantkit doctor` says why)")
    reasons: dict[str, list[str]] = {}
    for c in refused:
        reasons.setdefault(f"{c.kind}: {c.reason}", []).append(c.test)
    for why, tests in reasons.items():
        tr.write_line(f"  refusal x{len(tests)}: {why}")
        for t in tests:
            tr.write_line(f"      {t}")
