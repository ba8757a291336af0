"""GPU disk-to-disk path pieces that also run on the CPU: the block read-ahead of
StreamingSource and the NaN/Inf scan that leaves the decoder blocks to the block loop."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.arch import spec_for_config
from quantkit.errors import BadWeights
from quantkit.methods import get_quantizer
from quantkit.model_io import load_config
from quantkit.pipeline.blocks import get_blocks, quantize_blocks
from quantkit.pipeline.streaming import ShardReader, StreamingSource, block_tensor, skeleton
from quantkit.readers import read_config_json, scan_finite
from quantkit.types import QuantScheme


def _open(path):
    config = load_config(path)
    spec = spec_for_config(read_config_json(path))
    reader = ShardReader(path, spec.checkpoint_name, spec)
    return skeleton(config, torch.float32), spec, reader


def _block_values(path, read_ahead: bool) -> list[dict[str, torch.Tensor]]:
    model, spec, reader = _open(path)
    source = StreamingSource(model, reader, spec, torch.float32, read_ahead=read_ahead)
    seen = []
    blocks = get_blocks(model, spec)
    for i, block in enumerate(blocks):
        source.load(i, block)
        # the next block is being read while this one "computes"; the last one reads none
        assert (source._ahead is not None) == (read_ahead and i + 1 < len(blocks))
        seen.append({k: v.clone() for k, v in block.state_dict().items()})
        source.release(i, block)
    assert source._pool is None or not read_ahead
    return seen


@pytest.mark.fast
def test_read_ahead_gives_the_same_block_tensors(tiny_llama):
    plain, ahead = _block_values(tiny_llama, False), _block_values(tiny_llama, True)
    assert len(plain) == len(ahead) >= 2
    for a, b in zip(plain, ahead, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.fast
def test_scan_leaves_block_tensors_to_the_block_loop(tiny_llama, tmp_path):
    """On a GPU quantize() scans only the tensors outside the decoder blocks up front; a NaN
    in a block is then refused by the block loop as it reads that block, with the same
    message, before anything is written."""
    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    tensors = load_file(d / "model.safetensors")
    bad = "model.layers.1.mlp.down_proj.weight"
    tensors[bad][3, 5] = float("nan")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    model, spec, reader = _open(d)
    with pytest.raises(BadWeights, match=f"Tensor {bad} contains 1 NaN/Inf"):
        scan_finite(d)
    scan_finite(d, checked_later=block_tensor(spec))  # the block is left to the loop
    source = StreamingSource(model, reader, spec, torch.float32, read_ahead=True)
    with pytest.raises(BadWeights, match=f"Tensor {bad} contains 1 NaN/Inf values; refusing"):
        quantize_blocks(model, spec, get_quantizer("rtn"), QuantScheme(bits=4, group_size=64),
                        None, device="cpu", compute_dtype=torch.float32, source=source)
    tensors[bad][3, 5] = 0.0
    tensors["model.embed_tokens.weight"][0, 0] = float("inf")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BadWeights, match="Tensor model.embed_tokens.weight contains 1 NaN/Inf"):
        scan_finite(d, checked_later=block_tensor(spec))  # outside the blocks: still scanned
