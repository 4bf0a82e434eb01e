"""The weight gradient `x^T @ dy` of `x @ W`, in the layouts XLA:CPU runs fast."""

from typing import Any

import jax
import jax.numpy as jnp


def weight_grad(x_MI: jax.Array, dy_MO: jax.Array, preferred_element_type: Any = None) -> jax.Array:
    """`x^T @ dy` ([I, O]) for rows x [M, I] and cotangents dy [M, O].

    Written as autodiff would, it contracts the rows of both operands, which XLA:CPU runs as a
    generic dot at about a third of its matmul rate (after transposing copies of the operands).
    On CPU this transposes one operand explicitly, behind an optimization barrier so that XLA
    cannot fold the transpose back into the dot: x when it is the narrower one, else dy and the
    `[O, I]` product (e.g. the MLP's down projection, a wide input and a narrow output: this cut
    the step's transposes from 110 to 34 ms at the issue-14 SFT point on one core). Other
    backends fold the transpose into the GEMM themselves, so there it is the plain product.
    """
    if jax.default_backend() != "cpu":
        return jnp.dot(x_MI.T, dy_MO, preferred_element_type=preferred_element_type)
    (m, i), o = x_MI.shape, dy_MO.shape[1]
    if m * o + o * i < m * i:
        dy_OM = jax.lax.optimization_barrier(dy_MO.T)
        w_OI = jnp.dot(dy_OM, x_MI, preferred_element_type=preferred_element_type)
        return jax.lax.optimization_barrier(w_OI).T
    x_IM = jax.lax.optimization_barrier(x_MI.T)
    return jnp.dot(x_IM, dy_MO, preferred_element_type=preferred_element_type)
