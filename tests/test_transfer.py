"""to_device: the same values and dtype as torch.tensor, a copy (never the array's memory)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from treepack.train.transfer import to_device

DTYPES = [None, torch.long, torch.int32, torch.float32, torch.float64]


@given(values=st.lists(st.integers(-(2**40), 2**40), max_size=50), dtype=st.sampled_from(DTYPES))
def test_matches_torch_tensor_on_cpu(values, dtype):
    array = np.asarray(values, dtype=np.int64)
    got = to_device(array, torch.device("cpu"), dtype)
    want = torch.tensor(array, dtype=dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)
    if got.numel():
        array[0] += 1  # a copy: the array's later changes do not show
        assert got[0] == want[0]


def test_float_rounding_matches_torch_tensor():
    array = np.random.default_rng(0).standard_normal(1000)
    assert torch.equal(to_device(array, "cpu", torch.float32), torch.tensor(array, dtype=torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copy_is_exact_and_survives_the_host_array():
    array = np.arange(1 << 20, dtype=np.int64)
    got = to_device(array, torch.device("cuda"), torch.int32)
    array[:] = -1
    assert torch.equal(got.cpu(), torch.arange(1 << 20, dtype=torch.int32))
