"""A model's call as one compiled program, for the tests' comparisons.

Run eagerly, every operation of a model's forward compiles a program of its own (per shape and
dtype; the MoE and GPT-OSS layers most). These module-level functions compile a whole call once
per model config and input shapes, and, shared by every test file, one compile serves a worker's
every model of that config.
"""

import functools

import jax
from flax import nnx


@nnx.jit
def jit_call(model, *args, **kwargs):
    """`model(*args, **kwargs)` (the graph static, the weights an argument)."""
    return model(*args, **kwargs)


@functools.partial(jax.jit, static_argnums=0)
def merged_call(graphdef, state, *args):
    """`nnx.merge(graphdef, state)(*args)`: for a model held split, e.g. a sampler's params."""
    return nnx.merge(graphdef, state)(*args)
