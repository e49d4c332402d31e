"""The gated MLP's activation kernel (``native.silu_mul``, ``csrc/activation.c``): torch's rounding, and each
element's bits from its own inputs alone (what ``Engine.whole_hits`` relies on)."""

import pytest
import torch

from mmcache.engine.compute import native


@pytest.fixture
def lib(native_kernel):
    """The compiled library (built and loaded whatever ``MMCACHE_NATIVE`` says; see ``conftest``)."""
    assert hasattr(native_kernel, "mmc_silu_mul")  # built from this revision's sources
    return native_kernel


def torch_silu_mul(g, u):
    return torch.nn.SiLU()(g).mul_(u)


def test_silu_mul_rounds_as_torch_does(lib):
    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(64, 4864, generator=gen) * 4).bfloat16()
    u = torch.randn(64, 4864, generator=gen).bfloat16()
    g[0, :6] = torch.tensor([-200.0, 200.0, 0.0, -0.0, 88.5, -88.5]).bfloat16()
    got, want = native.silu_mul(lib, g, u), torch_silu_mul(g, u)
    diff = (got.float() - want.float()).abs()
    # The two exponentials may differ in the last float32 bit; after two roundings to bfloat16 that is at most
    # one bfloat16 step of an element, and rarely that.
    assert (diff <= want.float().abs() * 2 ** -7 + 1e-30).all()
    assert (got == want).float().mean() > 0.999
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("width", [4864, 37, 16, 1])
def test_each_element_depends_only_on_its_inputs(lib, width):
    gen = torch.Generator().manual_seed(1)
    g = (torch.randn(33, width, generator=gen) * 3).bfloat16()
    u = torch.randn(33, width, generator=gen).bfloat16()
    whole = native.silu_mul(lib, g, u)
    for rows in (slice(0, 1), slice(5, 6), slice(32, 33), slice(3, 20)):
        assert torch.equal(native.silu_mul(lib, g[rows], u[rows]), whole[rows])
    assert torch.equal(native.silu_mul(lib, g, u, threads=1), whole)
    assert torch.equal(native.silu_mul(lib, g.t().contiguous().t(), u), whole)  # any layout: copied first


def test_bad_input_is_a_value_error(lib):
    g = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="silu_mul"):
        native.silu_mul(lib, g, g.float())
    with pytest.raises(ValueError, match="silu_mul"):
        native.silu_mul(lib, g, torch.zeros(2, 9, dtype=torch.bfloat16))
    assert native.silu_mul(lib, g[:0], g[:0]).shape == (0, 8)
