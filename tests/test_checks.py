"""The shared input checks: finite ints and floats pass ``finite_number``, bools, NaN, infinities and
non-numbers do not; ``positive_int`` takes Python ints of at least 1 only."""

import numpy as np
import pytest

from mmcache.checks import finite_number, positive_int, unicode_text


@pytest.mark.parametrize("x", [0, -3, 2.5, np.int64(4), np.float32(0.5), 10**30])
def test_finite_numbers_pass(x):
    assert finite_number(x)


@pytest.mark.parametrize("x", [True, np.bool_(False), float("nan"), float("inf"), -np.inf, "1", None, [1], 1j])
def test_everything_else_fails(x):
    assert not finite_number(x)


def test_an_int_too_large_for_a_float_is_not_a_finite_number():
    assert not finite_number(10**400) and finite_number(10**300)  # the first used to raise OverflowError


@pytest.mark.parametrize("x", [1, 7, 10**30])
def test_positive_ints_pass(x):
    assert positive_int(x)


@pytest.mark.parametrize("x", [0, -1, True, 1.0, "1", None, np.float64(2.0), [1]])
def test_everything_else_is_not_a_positive_int(x):
    assert not positive_int(x)


def test_unicode_text_is_a_str_that_utf8_can_encode():
    assert unicode_text("") and unicode_text("色调艳丽 \U0001f98a") and unicode_text("\x00")
    for x in ("a \ud800", "\udfff", b"bytes", None, 5):
        assert not unicode_text(x)
