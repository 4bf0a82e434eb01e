"""A frozen model's weights kept in the dtype its forward reads them in.

Under mixed precision (f32 params, bf16 compute) a frozen reference copy of the policy is stored
in f32 and every forward casts its matmul weights to bf16 again. Casting those weights once, when
the copy is made, gives the same forward bit for bit (the model's own cast becomes a no-op) in
half their memory, without the per-step cast. Which weights qualify is read from the forward's
jaxpr, not assumed: a leaf qualifies when its only uses, through scans, calls and custom
derivatives, are conversions to the compute dtype. Weights also read in their own dtype (an
embedding table both looked up into an f32 residual stream and cast for a tied LM head, norm
scales) keep it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

PyTree = Any


def _sub_jaxprs(eqn) -> list:
    """The sub-jaxprs of `eqn` whose inputs are `eqn`'s inputs one to one (calls, scans, custom
    derivatives, remat); cond branches take all inputs but the branch index."""
    if eqn.primitive.name == "cond":
        return [("cond", b.jaxpr) for b in eqn.params["branches"]]
    subs = []
    for value in eqn.params.values():
        jaxpr = getattr(value, "jaxpr", value)  # ClosedJaxpr -> Jaxpr
        if isinstance(jaxpr, jex.Jaxpr) and len(jaxpr.invars) == len(eqn.invars):
            subs.append(("call", jaxpr))
    return subs


def _only_cast(jaxpr, var, dtype: np.dtype) -> bool:
    """Whether every use of `var` in `jaxpr` converts it to `dtype`."""
    if any(out is var for out in jaxpr.outvars):
        return False
    for eqn in jaxpr.eqns:
        for i, v in enumerate(eqn.invars):
            if v is not var:
                continue
            if eqn.primitive.name == "convert_element_type":
                if np.dtype(eqn.params["new_dtype"]) == dtype:
                    continue
                return False
            subs = _sub_jaxprs(eqn)
            if not subs:
                return False
            for kind, sub in subs:
                j = i - 1 if kind == "cond" else i
                if j < 0 or not _only_cast(sub, sub.invars[j], dtype):
                    return False
    return True


def cast_only_leaves(fn: Callable[[PyTree], Any], params: PyTree, dtype: Any) -> PyTree:
    """A pytree of bools like `params`: True where `fn(params)` only ever converts that leaf to
    `dtype` and `dtype` is narrower (False for non-float leaves, and for leaves in `dtype` or a
    narrower dtype: storing those in `dtype` would save nothing)."""
    dtype = np.dtype(dtype)
    closed = jax.make_jaxpr(fn)(params)
    leaves, treedef = jax.tree.flatten(params)
    flags = [
        bool(
            np.issubdtype(np.dtype(leaf.dtype), np.floating)
            and np.dtype(leaf.dtype).itemsize > dtype.itemsize
            and _only_cast(closed.jaxpr, var, dtype)
        )
        for leaf, var in zip(leaves, closed.jaxpr.invars, strict=True)
    ]
    return jax.tree.unflatten(treedef, flags)


def lm_probe(graphdef: Any) -> Callable[[PyTree], Any]:
    """A causal LM's forward on a few tokens as a function of its state (`nnx.split`): what
    `cast_only_leaves` reads to find which weights the model only uses in its compute dtype."""
    from flax import nnx

    return lambda params: nnx.merge(graphdef, params)(jnp.zeros((1, 8), jnp.int32))


def in_compute_dtype(fn: Callable[[PyTree], Any], params: PyTree, dtype: Any) -> PyTree:
    """A copy of `params` with each leaf that `fn` only converts to `dtype` stored in `dtype`
    (same sharding); the other leaves are copied as they are. `fn` on the copy equals `fn` on
    `params` exactly."""
    flags = cast_only_leaves(fn, params, dtype)
    return jax.tree.map(lambda x, cast: x.astype(dtype) if cast else jnp.copy(x), params, flags)
