"""Int8 weight-only storage for a frozen parameter pytree (the DPO reference model).

The JAX counterpart of loading TRL's reference model in 8 bits: weights are *stored* as int8
with one f32 scale per output channel and dequantized to the compute dtype inside the jitted
step. Persistent memory drops to ~0.5x of bf16 (~0.25x of f32); the dequantized copy is a
transient of the reference forward (whole-tree when the caller dequantizes before a scanned
layer stack, per layer if dequantized inside the scan body).

Scheme: symmetric absmax per output channel. For a float leaf with ndim >= 2, scales are kept
along the output-channel axes and the absmax is taken over the fan-in axes; `q = round(w / s)`
with `s = absmax / 127`, so every element satisfies `|w - q * s| <= s / 2 = absmax / 254`.
0-D/1-D leaves (norm scales, biases, also when stacked per layer), leaves with nothing to
reduce and non-float leaves are kept as they are. Which axes are output channels is read from
the NNX param metadata our models attach (see `channel_axes_for`); plain arrays default to the
last axis.

Why hand-written rather than `qwix`: qwix (0.1.8) quantizes by intercepting the model's
`dot_general`/`einsum` calls (`quantize_model` + `PtqProvider` rules keyed by module path) and
needs the model's abstract quantized tree; it targets quantized *compute* in specific module
call patterns. Here we need storage-only compression of an arbitrary params pytree that any
model code can consume after `dequantize_params`, with the original shardings kept, which is a
few lines of `jnp` and needs no extra dependency.

4-bit NF4 (`scheme="nf4"`, QLoRA's frozen base): bitsandbytes' NormalFloat4 with blockwise absmax
over blocks of 64 consecutive fan-in elements of each output channel (bitsandbytes flattens the
torch `[out, in]` weight, so its blocks are exactly these when `in % 64 == 0`, as in every
released model; a shorter fan-in tail is zero-padded to a whole block). Each element stores the
index of the nearest of the 16 `NF4_LEVELS`, two per byte; each block one f32 absmax: 4.5 bits
per weight. No double quantization of the absmax (bitsandbytes' `bnb_4bit_use_double_quant`,
off by default in transformers' `BitsAndBytesConfig`).
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

PyTree = Any
ChannelAxes = tuple[int, ...] | Callable[[tuple, tuple[int, ...]], tuple[int, ...]]

_INT8_MAX = 127.0
NF4_BLOCK = 64
# The 16 NF4 levels (QLoRA, Dettmers et al. 2023, Appendix E; bitsandbytes `get_4bit_type("nf4")`
# and its CUDA `dDequantizeNF4` table): quantiles of N(0, 1) scaled to [-1, 1], with an exact zero.
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
SCHEMES = ("int8", "nf4")


@struct.dataclass
class QuantizedArray:
    """Int8 values (same shape and sharding as the original leaf) and f32 per-channel scales.

    `scale` has the leaf's rank with size 1 on the reduced axes, so `values * scale`
    broadcasts back; `dtype` is the original dtype, restored by default on dequantization.
    """

    values: jax.Array
    scale: jax.Array
    dtype: str = struct.field(pytree_node=False)

    def dequantize(self, dtype: jnp.dtype | None = None) -> jax.Array:
        out = self.values.astype(jnp.float32) * self.scale
        return out.astype(dtype or self.dtype)


@struct.dataclass
class NF4Array(QuantizedArray):
    """4-bit NF4 storage of one leaf (a `QuantizedArray`, so every `param_value` consumer
    dequantizes it at its point of use).

    The reduced (fan-in) axes, contiguous from `axis`, are flattened to `R` elements and split
    into blocks: `values` is uint8 `[pre..., R_pad / 64, 32, post...]` holding two level indices
    per byte (even element in the high nibble, as bitsandbytes packs), `scale` the f32 block
    absmax `[pre..., R_pad / 64, 1, post...]`. `shape` is the original shape.
    """

    shape: tuple[int, ...] = struct.field(pytree_node=False, default=())
    axis: int = struct.field(pytree_node=False, default=0)
    n_red: int = struct.field(pytree_node=False, default=1)

    def dequantize(self, dtype: jnp.dtype | None = None) -> jax.Array:
        # Inside a scanned layer stack `values`/`scale` arrive with their leading `layers`
        # axes sliced off while the static `shape`/`axis` still describe the stacked leaf.
        cut = len(self.shape) - self.n_red + 2 - self.values.ndim
        shape, axis = self.shape[cut:], self.axis - cut
        hi, lo = self.values >> 4, self.values & 0xF
        codes = jnp.stack([hi, lo], axis=axis + 2)  # [pre, nb, 32, 2, post]
        codes = codes.reshape(*self.values.shape[: axis + 1], -1, *codes.shape[axis + 3 :])
        out = jnp.asarray(NF4_LEVELS, jnp.float32)[codes] * self.scale
        red = math.prod(shape[axis : axis + self.n_red])
        flat = out.reshape(*out.shape[:axis], -1, *out.shape[axis + 2 :])
        flat = jax.lax.slice_in_dim(flat, 0, red, axis=axis)
        return flat.reshape(shape).astype(dtype or self.dtype)


def _is_quantizable(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2


def _scale_sharding(x: jax.Array, keep: tuple[int, ...]) -> NamedSharding | None:
    """The leaf's NamedSharding with the reduced (size-1) axes replicated."""
    sharding = getattr(x, "sharding", None)
    if isinstance(x, jax.core.Tracer) or not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    return NamedSharding(
        sharding.mesh, PartitionSpec(*(s if i in keep else None for i, s in enumerate(spec)))
    )


@functools.partial(jax.jit, static_argnames="keep")
def _absmax_int8(x: jax.Array, keep: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    reduce_axes = tuple(i for i in range(x.ndim) if i not in keep)
    x32 = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x32), axis=reduce_axes, keepdims=True)
    # An all-zero channel gets scale 1 (its values quantize to 0 either way).
    scale = jnp.where(absmax > 0, absmax / _INT8_MAX, 1.0)
    values = jnp.clip(jnp.round(x32 / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return values, scale


def _quantize_leaf(x: jax.Array, keep: tuple[int, ...]) -> QuantizedArray:
    values, scale = _absmax_int8(x, keep)
    scale_sharding = _scale_sharding(x, keep)
    if scale_sharding is not None:
        # Pin the layout explicitly rather than rely on propagation: values like the leaf,
        # scales like the leaf on the kept axes.
        values = jax.device_put(values, x.sharding)
        scale = jax.device_put(scale, scale_sharding)
    return QuantizedArray(values=values, scale=scale, dtype=jnp.dtype(x.dtype).name)


# Decision thresholds: an element goes to the level above a midpoint only when strictly greater
# (bitsandbytes' `dQuantizeNF4` decision tree), i.e. `searchsorted(..., side="left")`.
_NF4_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(NF4_LEVELS[:-1], NF4_LEVELS[1:], strict=True))


@functools.partial(jax.jit, static_argnames=("axis", "n_red"))
def _nf4_blocks(x: jax.Array, axis: int, n_red: int) -> tuple[jax.Array, jax.Array]:
    pre, post = x.shape[:axis], x.shape[axis + n_red :]
    red = math.prod(x.shape[axis : axis + n_red])
    n_blocks = -(-red // NF4_BLOCK)
    x32 = x.astype(jnp.float32).reshape(*pre, red, *post)
    pad = [(0, 0)] * x32.ndim
    pad[axis] = (0, n_blocks * NF4_BLOCK - red)
    blocks = jnp.pad(x32, pad).reshape(*pre, n_blocks, NF4_BLOCK, *post)
    absmax = jnp.max(jnp.abs(blocks), axis=axis + 1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax, 1.0)  # an all-zero block maps to level 7 (exact 0)
    codes = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS, jnp.float32), blocks / scale)
    pairs = codes.astype(jnp.uint8).reshape(*pre, n_blocks, NF4_BLOCK // 2, 2, *post)
    hi, lo = jnp.take(pairs, 0, axis=axis + 2), jnp.take(pairs, 1, axis=axis + 2)
    return (hi << 4) | lo, scale


def _blocked_sharding(x: jax.Array, axis: int, n_red: int, n_blocks: int) -> NamedSharding | None:
    """The leaf's sharding carried to the blocked layout: the first fan-in axis's mesh axes move
    to the block axis when they divide it; the within-block axis is replicated."""
    sharding = getattr(x, "sharding", None)
    if isinstance(x, jax.core.Tracer) or not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    block_spec = spec[axis]
    if block_spec is not None:
        names = (block_spec,) if isinstance(block_spec, str) else tuple(block_spec)
        if n_blocks % math.prod(sharding.mesh.shape[n] for n in names):
            block_spec = None
    return NamedSharding(
        sharding.mesh, PartitionSpec(*spec[:axis], block_spec, None, *spec[axis + n_red :])
    )


def _quantize_leaf_nf4(x: jax.Array, keep: tuple[int, ...]) -> NF4Array:
    reduce_axes = [i for i in range(x.ndim) if i not in keep]
    axis, n_red = reduce_axes[0], len(reduce_axes)
    if reduce_axes != list(range(axis, axis + n_red)):
        raise ValueError(
            f"NF4 blocks run along contiguous fan-in axes; got axes {reduce_axes} of a leaf "
            f"with shape {x.shape}. Pass channel_axes that leave one contiguous run of axes."
        )
    values, scale = _nf4_blocks(x, axis, n_red)
    sharding = _blocked_sharding(x, axis, n_red, values.shape[axis])
    if sharding is not None:
        values, scale = jax.device_put(values, sharding), jax.device_put(scale, sharding)
    return NF4Array(
        values=values,
        scale=scale,
        dtype=jnp.dtype(x.dtype).name,
        shape=tuple(x.shape),
        axis=axis,
        n_red=n_red,
    )


def channel_axes_for(
    shape: tuple[int, ...], axis_names: tuple | None, n_in: int | None
) -> tuple[int, ...]:
    """Axes that keep their own scale, from a param's logical axis names and fan-in count.

    Leading `layers` axes (scanned stacks) always keep per-layer scales. A `Dense` kernel
    (`n_in` metadata, shape `[layers..., in..., out...]`) reduces over its `n_in` fan-in axes;
    an embedding with a `vocab` axis keeps one scale per token row (its output channel when
    tied as the unembedding); anything else keeps the last axis. A per-layer vector keeps
    every axis, i.e. is not quantized.
    """
    names = tuple(axis_names) if axis_names is not None else (None,) * len(shape)
    lead = 0
    while lead < len(names) and names[lead] == "layers":
        lead += 1
    layer_axes = tuple(range(lead))
    if len(shape) - lead < 2:  # a per-layer vector (stacked norm scale or bias): keep it whole
        return tuple(range(len(shape)))
    if n_in is not None and lead + n_in < len(shape):
        return layer_axes + tuple(range(lead + n_in, len(shape)))
    if "vocab" in names[lead:]:
        return layer_axes + (names.index("vocab", lead),)
    return tuple(sorted(set(layer_axes) | {len(shape) - 1}))


def quantize_params(
    params: PyTree, *, channel_axes: ChannelAxes | None = None, scheme: str = "int8"
) -> PyTree:
    """Same tree with every float leaf of ndim >= 2 replaced by a `QuantizedArray` (`scheme="int8"`)
    or an `NF4Array` (`scheme="nf4"`: blocks of 64 along the reduced axes, which must be contiguous).

    Works on `nnx.State` (quantized values stay inside their `nnx.Param`, metadata kept) and on
    plain pytrees of arrays. `channel_axes=None` picks the axes with `channel_axes_for` from
    each param's `out_sharding` names and `n_in` (last axis for bare arrays); a tuple applies
    to every leaf; a function `(key_path, shape) -> axes` decides per leaf. Concrete sharded
    inputs give values with the leaf's sharding and scales sharded along the kept axes; under
    `jit`, sharding propagation does the same.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"Quantization scheme {scheme!r} is not supported; use one of {SCHEMES}.")
    quantize_leaf = _quantize_leaf if scheme == "int8" else _quantize_leaf_nf4

    def quantize(path, leaf):
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        if not _is_quantizable(value):
            return leaf
        if callable(channel_axes):
            axes = channel_axes(path, value.shape)
        elif channel_axes is not None:
            axes = channel_axes
        elif isinstance(leaf, nnx.Variable):
            meta = leaf.get_metadata()
            axes = channel_axes_for(value.shape, meta.get("out_sharding"), meta.get("n_in"))
        else:
            axes = (-1,)
        keep = tuple(sorted({a % value.ndim for a in axes}))
        if len(keep) == value.ndim:
            # Nothing to reduce (e.g. stacked per-layer norm scales): a scale per element would
            # cost more memory than the weight itself.
            return leaf
        return jax.tree.map(lambda x: quantize_leaf(x, keep), leaf)

    return jax.tree_util.tree_map_with_path(
        quantize, params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def dequantize_params(qparams: PyTree, dtype: jnp.dtype | None = None) -> PyTree:
    """Inverse of `quantize_params`: `values * scale` as `dtype` (default: the original dtype).

    Leaves that were not quantized are returned unchanged. Call inside the jitted step.
    """

    def dequantize(x):
        return x.dequantize(dtype) if isinstance(x, QuantizedArray) else x

    return jax.tree.map(dequantize, qparams, is_leaf=lambda x: isinstance(x, QuantizedArray))


def param_bytes(tree: PyTree) -> int:
    """Total bytes of all array leaves (int8 values and scales of quantized leaves included)."""
    return sum(
        x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")
    )
