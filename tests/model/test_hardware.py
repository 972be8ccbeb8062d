"""Device and dtype choice."""

from __future__ import annotations

import pytest
import torch

from tokenmill.errors import InvalidParameterError
from tokenmill.hardware import cpu_has_bf16, device_dtype, pick_device

CPU = torch.device("cpu")


def test_pick_device_follows_cuda_availability():
    assert pick_device().type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "name,dtype",
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)],
)
def test_explicit_dtypes(name, dtype):
    assert device_dtype(name, CPU) is dtype


def test_auto_dtype():
    assert device_dtype("auto", torch.device("cuda")) is torch.bfloat16
    expected = torch.bfloat16 if cpu_has_bf16() else torch.float32
    assert device_dtype("auto", CPU) is expected


def test_cpu_bf16_probe_agrees_with_torch():
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert cpu_has_bf16() == native


@pytest.mark.parametrize("name", ["fp32", "int8", "", "Float32"])
def test_bad_dtype_names(name):
    with pytest.raises(InvalidParameterError, match="unknown dtype") as info:
        device_dtype(name, CPU)
    assert info.value.param == "dtype"
