"""Dense's CPU path (2-D matmuls with a hand-written backward) gives autodiff's gradients of the
plain `dot_general`, and its backward really is standard-layout matmuls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models.hf_config import config_from_hf
from jaxrl.models.layers import Dense, activation, gated, matmul_2d
from jaxrl.models.presets import get_preset


def reference(x, kernel, n_in):
    n_batch = x.ndim - n_in
    dims = ((tuple(range(n_batch, x.ndim)), tuple(range(n_in))), ((), ()))
    return jax.lax.dot_general(x, kernel, dims)


@pytest.mark.parametrize(
    "x_shape, in_shape, out_shape",
    [
        ((2, 5, 16), (16,), (4, 8)),  # q_proj-like: one input dim, [heads, head_dim] out
        ((2, 5, 4, 8), (4, 8), (16,)),  # o_proj-like: two input dims
        ((3, 16), (16,), (24,)),  # plain
        ((4, 8, 64), (64,), (8,)),  # wide input, narrow output: the backward transposes dy
    ],
)
def test_dense_values_and_grads_equal_dot_general(x_shape, in_shape, out_shape):
    config = config_from_hf(get_preset("llama-tiny"))
    axes_in, axes_out = (None,) * len(in_shape), (None,) * len(out_shape)
    layer = Dense(in_shape, out_shape, axes_in, axes_out, config, nnx.Rngs(0), use_bias=True)
    kx, kb, kw = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, x_shape)
    layer.bias.set_value(jax.random.normal(kb, out_shape))
    weights = jax.random.normal(kw, (*x_shape[: len(x_shape) - len(in_shape)], *out_shape))
    graphdef, params = nnx.split(layer)

    def ours(x, params):
        return jnp.sum(jnp.tanh(nnx.merge(graphdef, params)(x)) * weights)

    def ref(x, params):
        y = reference(x, params["kernel"].get_value(), len(in_shape)) + params["bias"].get_value()
        return jnp.sum(jnp.tanh(y) * weights)

    got, (gx, gp) = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(x, params)
    want, (wx, wp) = jax.jit(jax.value_and_grad(ref, argnums=(0, 1)))(x, params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    pairs = [(gx, wx)] + [(gp[k].get_value(), wp[k].get_value()) for k in ("kernel", "bias")]
    for a, b in pairs:
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(jnp.abs(b).max()))


@pytest.mark.parametrize("in_dim, out_dim", [(64, 96), (96, 16)])
def test_matmul_2d_backward_is_standard_layout_matmuls(in_dim, out_dim):
    """No dot of the compiled backward contracts an operand's rows (the slow kind on XLA:CPU),
    while autodiff's weight gradient does; for a wide input (96 -> 16) the weight gradient runs
    as `dy^T @ x` (output [out, in]) so only the narrow cotangent is transposed."""
    x = jnp.ones((256, in_dim))
    w = jnp.ones((in_dim, out_dim))

    def dots(matmul):
        grad = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(matmul(x, w))), argnums=(0, 1)))
        hlo = grad.lower(x, w).compile().as_text()
        return [line for line in hlo.splitlines() if " dot(" in line]

    ours = dots(lambda x, w: matmul_2d(x, w, jnp.float32))
    assert len(ours) == 3, ours  # forward, dx, dw
    assert all("lhs_contracting_dims={1}" in line for line in ours), ours
    weight_grad = f"f32[{out_dim},{in_dim}]" if in_dim > out_dim else f"f32[{in_dim},{out_dim}]"
    assert any(f"= {weight_grad}" in line for line in ours), ours
    assert any("lhs_contracting_dims={0}" in line for line in dots(jnp.matmul))


def test_bf16_compute_keeps_dtypes():
    config = config_from_hf(get_preset("llama-tiny"), dtype="bfloat16")
    layer = Dense((16,), (8,), (None,), (None,), config, nnx.Rngs(0))
    x = jnp.ones((2, 3, 16), jnp.float32)
    y = layer(x)
    assert y.dtype == jnp.bfloat16 and y.shape == (2, 3, 8)
    graphdef, params = nnx.split(layer)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params)(x).astype(jnp.float32))

    g = jax.grad(loss)(params)["kernel"].get_value()
    assert g.dtype == jnp.float32  # the f32 param's gradient, through the bf16 cast
    np.testing.assert_allclose(g, jnp.full((16, 8), 6.0), rtol=1e-2)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gated_product_equals_autodiff_and_saves_only_its_inputs(act, dtype):
    """`gated(act, g, u)` = `act(g) * u` in value and gradients, and its backward keeps only g
    and u: autodiff would also save `act(g)` (and silu's sigmoid)."""
    fn = activation(act)
    kg, ku, kw = jax.random.split(jax.random.key(0), 3)
    g, u = (jax.random.normal(k, (4, 32), jnp.float32).astype(dtype) for k in (kg, ku))
    w = jax.random.normal(kw, (4, 32))

    def loss(product, g, u):
        return jnp.sum(product(g, u).astype(jnp.float32) * w)

    ours = jax.value_and_grad(lambda g, u: loss(lambda a, b: gated(fn, a, b), g, u), (0, 1))
    ref = jax.value_and_grad(lambda g, u: loss(lambda a, b: fn(a) * b, g, u), (0, 1))
    (v1, (dg1, du1)), (v2, (dg2, du2)) = jax.jit(ours)(g, u), jax.jit(ref)(g, u)
    np.testing.assert_array_equal(v1, v2)
    for a, b in ((dg1, dg2), (du1, du2)):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    def saved(product):  # the [4, 32] arrays a vjp closure keeps for its backward
        leaves = jax.tree_util.tree_leaves(jax.vjp(product, g, u)[1])
        return [x for x in leaves if getattr(x, "shape", None) == g.shape]

    assert len(saved(lambda g, u: gated(fn, g, u))) == 2
    assert len(saved(lambda g, u: fn(g) * u)) > 2


def test_gated_backward_is_one_kernel_on_gpu(monkeypatch):
    """On GPU the backward reads its three inputs through an optimization barrier (XLA:GPU then
    computes both gradients in one multi-output fusion: it never sibling-fuses consumers of a
    GEMM fusion's output); values equal the other backends' exactly, which have no barrier."""
    fn = activation("silu")
    kg, ku, kw = jax.random.split(jax.random.key(1), 3)
    g, u = (jax.random.normal(k, (4, 32), jnp.float32).astype(jnp.bfloat16) for k in (kg, ku))
    w = jax.random.normal(kw, (4, 32))

    def grads():
        loss = lambda g, u: jnp.sum(gated(fn, g, u).astype(jnp.float32) * w)  # noqa: E731
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(g, u))
        return jax.jit(jax.grad(loss, (0, 1)))(g, u), jaxpr

    (dg_cpu, du_cpu), jaxpr_cpu = grads()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    (dg_gpu, du_gpu), jaxpr_gpu = grads()
    assert "optimization_barrier" not in jaxpr_cpu
    assert jaxpr_gpu.count("optimization_barrier") == 1
    for a, b in ((dg_gpu, dg_cpu), (du_gpu, du_cpu)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
