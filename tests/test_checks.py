"""The shared input check: finite ints and floats pass, bools, NaN, infinities and non-numbers do not."""

import numpy as np
import pytest

from mmcache.checks import finite_number


@pytest.mark.parametrize("x", [0, -3, 2.5, np.int64(4), np.float32(0.5), 10**30])
def test_finite_numbers_pass(x):
    assert finite_number(x)


@pytest.mark.parametrize("x", [True, np.bool_(False), float("nan"), float("inf"), -np.inf, "1", None, [1], 1j])
def test_everything_else_fails(x):
    assert not finite_number(x)
