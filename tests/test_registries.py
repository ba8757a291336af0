"""The method and format registries: every name the CLI offers is registered once, every
record is complete, and the pipeline reads declared hooks instead of probing for them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from quantkit.formats import WRITERS, format_record, get_writer, kv_cache_formats
from quantkit.formats.common import FormatWriter
from quantkit.methods import CLI_METHODS, get_quantizer, method_record, registry
from quantkit.methods.options import FLAG_READERS, FLAGS
from quantkit.types import Quantizer

ROOT = Path(__file__).resolve().parents[1] / "quantkit"


def test_cli_methods_are_the_registered_ones():
    assert sorted(CLI_METHODS) == sorted(registry())
    for name, record in registry().items():
        assert record.name == name
    for flag, readers in FLAG_READERS.items():
        assert set(readers) <= set(registry()), flag
    assert len({f.name for f in FLAGS}) == len(FLAGS)


@pytest.mark.parametrize("name", sorted(CLI_METHODS))
def test_every_quantizer_derives_from_the_declared_base(name):
    options = {"scheme": "dynamic"} if name == "fp8" else {}
    assert isinstance(get_quantizer(name, **options), Quantizer)


def test_unknown_names_are_refused_with_the_registered_ones():
    from quantkit.errors import SchemeMismatch

    with pytest.raises(SchemeMismatch, match="Choose one of: rtn, gptq, gguf, fp8, awq, int8"):
        method_record("bogus")
    with pytest.raises(SchemeMismatch, match="Choose one of: compressed-tensors, gptq, gguf"):
        format_record("bogus")


@pytest.mark.parametrize("name", WRITERS)
def test_every_format_is_registered_under_its_writers_name(name):
    assert format_record(name).name == name
    writer = get_writer(name)
    assert writer.name == name and isinstance(writer, FormatWriter)


def test_kv_cache_formats():
    assert kv_cache_formats() == ("compressed-tensors", "fp8", "modelopt")


def test_the_pipeline_reads_quantizer_and_writer_hooks_without_probing():
    probes = re.compile(r"(hasattr|getattr)\((quantizer|writer)\b")
    for path in (ROOT / "pipeline").glob("*.py"):
        assert not probes.search(path.read_text()), path.name
