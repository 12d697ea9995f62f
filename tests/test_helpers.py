"""The tolerance that the numerical tests share (tests/helpers.py:assert_close) admits reordered
fp32 sums and still rejects a real error."""

import numpy as np
import pytest

from helpers import assert_close


def _gradient_like(seed=0):
    """Heavy-tailed, with elements near zero, as gradients are."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(8192) * np.exp(2 * rng.standard_normal(8192))).astype(np.float32)


def test_reordered_sums_pass_where_a_bare_absolute_tolerance_fails():
    """The issue's failure: gradients up to 0.05, two elements near 3.5e-4 off by 3.2e-7 (9e-4 of
    themselves), which rtol=1e-4, atol=1e-7 rejected on another CPU."""
    want = _gradient_like()
    want *= 0.05 / np.abs(want).max()
    got = want.copy()
    near = np.argsort(np.abs(np.abs(want) - 3.5e-4))[:2]
    got[near] += 3.2e-7
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
    assert_close(got, want)


@pytest.mark.parametrize("error", [1e-2, 1e-3])
def test_a_small_relative_error_still_fails(error):
    want = _gradient_like(1)
    with pytest.raises(AssertionError):
        assert_close(want * (1 + error), want)
    with pytest.raises(AssertionError):  # in one leaf of a tree, too
        assert_close({"a": want, "b": want * (1 + error)}, {"a": want, "b": want})


def test_an_error_in_the_largest_element_fails():
    want = _gradient_like(2)
    got = want.copy()
    got[np.argmax(np.abs(want))] *= 1.0001
    with pytest.raises(AssertionError):
        assert_close(got, want)
