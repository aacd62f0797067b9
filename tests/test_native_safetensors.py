"""The native runtime's own safetensors reader against the safetensors library."""

import json

import pytest
import torch

from rlhflab.backends.native_config import NativeConfigError
from rlhflab.backends.native_models import read_safetensors


def _mixed_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "w32": torch.randn(5, 7, generator=g),
        "w16": torch.randn(3, 4, generator=g).half(),
        "wbf": torch.randn(6, generator=g).bfloat16(),
        "w64": torch.randn(2, 2, generator=g).double(),
        "ids": torch.arange(9, dtype=torch.int64).reshape(3, 3),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def test_read_safetensors_matches_the_library_and_casts_floats_only(tmp_path):
    """Our streaming reader gives safetensors' own tensors, every dtype and odd shape."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "model.safetensors"
    save_file(_mixed_tensors(), str(path), metadata={"format": "pt"})
    ours, theirs = read_safetensors(path), load_file(str(path))
    assert ours.keys() == theirs.keys()
    for name, want in theirs.items():
        assert ours[name].dtype == want.dtype and torch.equal(ours[name], want), name
    cast = read_safetensors(path, torch.float64)
    assert {k: v.dtype for k, v in cast.items() if not v.is_floating_point()} == {
        "ids": torch.int64,
        "flags": torch.bool,
    }
    assert cast["wbf"].dtype == torch.float64
    torch.testing.assert_close(cast["wbf"], theirs["wbf"].double())


def test_read_safetensors_names_the_file_and_tensor_of_bad_data(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(1000)}, str(path))
    path.write_bytes(path.read_bytes()[:-8])  # cut the last tensor short
    with pytest.raises(NativeConfigError, match=r"model\.safetensors: tensor 'b' is cut short"):
        read_safetensors(path)
    header = json.dumps({"c": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}})
    odd = tmp_path / "odd.safetensors"
    odd.write_bytes(len(header).to_bytes(8, "little") + header.encode() + b"\0\0")
    with pytest.raises(NativeConfigError, match=r"odd\.safetensors: tensor 'c' is stored as F8"):
        read_safetensors(odd)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05\0\0\0\0\0\0\0{nope")
    with pytest.raises(NativeConfigError, match=r"junk\.safetensors: not a safetensors file"):
        read_safetensors(junk)
