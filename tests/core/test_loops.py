"""`jaxrl.core.loops`: a one-step scan or loop is one call of its body, with lax's results."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxprs import primitive_names

from jaxrl.core import loops


def body(carry, xs):
    x, y = xs
    carry = carry * 2.0 + x.sum()
    return carry, {"x": x * carry, "none": None, "y": y + 1}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("reverse", [False, True])
def test_scan_equals_lax_scan(n, reverse):
    xs = (jnp.arange(n * 2.0).reshape(n, 2) + 1.0, jnp.arange(n, dtype=jnp.int32))
    got = loops.scan(body, jnp.float32(0.5), xs, reverse=reverse)
    want = jax.lax.scan(body, jnp.float32(0.5), xs, reverse=reverse)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
    names = primitive_names(jax.make_jaxpr(lambda xs: loops.scan(body, 0.5, xs))(xs).jaxpr)
    assert ("scan" in names) == (n > 1)


def test_scan_without_xs_takes_length():
    def count(c, _):
        return c + 1, c

    for n in (1, 4):
        got = loops.scan(count, 0, None, length=n)
        want = jax.lax.scan(count, 0, None, length=n)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_fori_loop_one_trip_is_the_body_at_zero():
    def add(i, c):
        return c + (i + 1) * 10

    assert int(loops.fori_loop(0, 1, add, 1, trips=1)) == 11
    assert int(loops.fori_loop(1, 3, add, 1, trips=3)) == 1 + 20 + 30
    names = primitive_names(
        jax.make_jaxpr(lambda lo: loops.fori_loop(lo, 1, add, 1, trips=1))(0).jaxpr
    )
    assert "while" not in names
