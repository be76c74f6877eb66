"""The compiled CPU mHC mix (numba) equals the torch reference formula."""
from __future__ import annotations

import pytest
import torch

from kvmesh.kernels import hc_mix as hm
from tests.unit.test_step_cost import OpCounter


def case(t: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(t, (2 + n) * n, generator=g) * 4
    base = torch.randn((2 + n) * n, generator=g)
    scale = torch.rand(3, generator=g) * 2
    return mix, base, scale


def test_numba_is_installed():
    """numba is an install dependency: without it every CPU step pays ~130 ops per mix."""
    assert hm.compiled_available()


@pytest.mark.parametrize("t, n, iters", [(1, 4, 20), (37, 4, 20), (5, 2, 1), (9, 3, 7), (300, 4, 20)])
def test_compiled_equals_reference(t, n, iters):
    mix, base, scale = case(t, n, seed=t * 31 + n)
    got = hm.hc_mix(mix, base, scale, n, 1e-6, iters)
    want = hm.hc_mix_torch(mix, base, scale, n, 1e-6, iters)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)
    # the last normalisation is over columns: they sum to 1 (less the eps share)
    torch.testing.assert_close(got[2].sum(-2), torch.ones(t, n), rtol=0, atol=1e-5)


def test_compiled_is_one_call_and_others_fall_back():
    mix, base, scale = case(8, 4, seed=1)
    with OpCounter() as counter:
        hm.hc_mix(mix, base, scale, 4, 1e-6, 20)
    assert len(counter.ops) <= 1, counter.ops                 # only the output allocation
    for args in [(mix.double(), base.double(), scale.double()),   # other dtypes: the reference
                 (mix.t().contiguous().t(), base, scale)]:         # a non-contiguous input
        with OpCounter() as counter:
            got = hm.hc_mix(*args, 4, 1e-6, 20)
        assert len(counter.ops) > 100                              # the torch formula ran
        for a, b in zip(got, hm.hc_mix_torch(*args, 4, 1e-6, 20)):
            assert torch.equal(a, b)
