"""Layers shared by the Stable Diffusion models (UNet, VAE, CLIP): NHWC convolutions, group and
layer norms, linear layers and multi-head attention, each holding `nnx.Param`s whose metadata names
the logical axis of every dim (see `jaxrl.parallel`).

Parameter layouts are Flax's (conv kernels HWIO, linear kernels [in, out]); `hf.py` converts them
to and from PyTorch's. Norm statistics are computed in f32 whatever the compute dtype; this file
holds no model structure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.layers import make_param


class Dtypes(NamedTuple):
    """Compute dtype (activations, matmuls) and storage dtype of the params."""

    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32


def _fan_in_init(fan_in: int) -> Any:
    # PyTorch's default Linear/Conv2d init (kaiming-uniform with a=sqrt(5)): U(+-1/sqrt(fan_in)).
    return jax.nn.initializers.uniform(2.0 / fan_in**0.5)


def _shifted(init: Any, fan_in: int) -> Any:
    def f(key, shape, dtype):
        return init(key, shape, dtype) - jnp.asarray(1.0 / fan_in**0.5, dtype)

    return f


class Linear(nnx.Module):
    """y = x @ kernel + bias (+ lora(x) once an adapter is attached); kernel [in, out] with
    logical axes `axes`."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        dt: Dtypes,
        rngs: nnx.Rngs | None,
        *,
        bias: bool = True,
        axes: Sequence[str | None] = ("embed", "mlp"),
    ):
        self.dtype = dt.dtype
        init = _shifted(_fan_in_init(n_in), n_in)
        self.kernel = make_param(rngs, init, (n_in, n_out), axes, dt.param_dtype)
        self.bias = make_param(rngs, init, (n_out,), (axes[1],), dt.param_dtype) if bias else None
        # A low-rank adapter (`jaxrl.models.diffusion.lora`) attached after construction.
        self.lora = nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        y = jnp.dot(x, self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora is not None:
            y = y + self.lora(x)
        return y


class Conv2d(nnx.Module):
    """2-D convolution on NHWC activations; kernel [kh, kw, in, out] (PyTorch: [out, in, kh, kw]).

    `padding` is symmetric; `pad_right_bottom` adds PyTorch's asymmetric (0, 1, 0, 1) padding
    of the VAE encoder's downsamplers instead.
    """

    def __init__(
        self,
        n_in: int,
        n_out: int,
        kernel_size: int,
        dt: Dtypes,
        rngs: nnx.Rngs | None,
        *,
        stride: int = 1,
        padding: int = 0,
        pad_right_bottom: bool = False,
        bias: bool = True,
        axes: Sequence[str | None] = (None, None, "embed", "mlp"),
    ):
        self.dtype = dt.dtype
        self.stride = stride
        self.padding = ((0, 1), (0, 1)) if pad_right_bottom else ((padding, padding),) * 2
        fan_in = n_in * kernel_size * kernel_size
        init = _shifted(_fan_in_init(fan_in), fan_in)
        shape = (kernel_size, kernel_size, n_in, n_out)
        self.kernel = make_param(rngs, init, shape, axes, dt.param_dtype)
        self.bias = make_param(rngs, init, (n_out,), (axes[3],), dt.param_dtype) if bias else None

    def __call__(self, x_BHWC: jax.Array) -> jax.Array:
        y = jax.lax.conv_general_dilated(
            x_BHWC.astype(self.dtype),
            self.kernel[...].astype(self.dtype),
            window_strides=(self.stride, self.stride),
            padding=self.padding,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class GroupNorm(nnx.Module):
    """torch.nn.GroupNorm over the channel (last) dim of [B, ..., C], statistics in f32."""

    def __init__(self, num_groups: int, channels: int, eps: float, dt: Dtypes):
        if channels % num_groups:
            raise ValueError(
                f"GroupNorm: {channels} channels are not divisible into {num_groups} groups; "
                "the config's norm_num_groups must divide every block's channel count."
            )
        self.num_groups = num_groups
        self.eps = eps
        self.dtype = dt.dtype
        ones, zeros = jax.nn.initializers.ones, jax.nn.initializers.zeros
        self.scale = make_param(None, ones, (channels,), ("norm",), dt.param_dtype)
        self.bias = make_param(None, zeros, (channels,), ("norm",), dt.param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        x32 = x.astype(jnp.float32).reshape(
            shape[0], -1, self.num_groups, shape[-1] // self.num_groups
        )
        mean = jnp.mean(x32, axis=(1, 3), keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=(1, 3), keepdims=True)
        y = ((x32 - mean) * jax.lax.rsqrt(var + self.eps)).reshape(shape)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype)


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm over the last dim, statistics in f32."""

    def __init__(self, channels: int, eps: float, dt: Dtypes):
        self.eps = eps
        self.dtype = dt.dtype
        ones, zeros = jax.nn.initializers.ones, jax.nn.initializers.zeros
        self.scale = make_param(None, ones, (channels,), ("norm",), dt.param_dtype)
        self.bias = make_param(None, zeros, (channels,), ("norm",), dt.param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype)


class Embedding(nnx.Module):
    """Lookup table [num, dim] (torch.nn.Embedding)."""

    def __init__(
        self, num: int, dim: int, axes: Sequence[str | None], dt: Dtypes, rngs: nnx.Rngs | None
    ):
        self.dtype = dt.dtype
        init = jax.nn.initializers.normal(0.02)
        self.embedding = make_param(rngs, init, (num, dim), axes, dt.param_dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)


def multi_head_attention(
    q_BTC: jax.Array,
    k_BSC: jax.Array,
    v_BSC: jax.Array,
    num_heads: int,
    *,
    is_causal: bool = False,
    mask_B1TS: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T / sqrt(head_dim)) v over `num_heads` heads, through
    `jax.nn.dot_product_attention`; [B, T, C] in and out."""
    b, t, c = q_BTC.shape
    s = k_BSC.shape[1]
    head_dim = c // num_heads
    out_BTNH = jax.nn.dot_product_attention(
        q_BTC.reshape(b, t, num_heads, head_dim),
        k_BSC.reshape(b, s, num_heads, head_dim),
        v_BSC.reshape(b, s, num_heads, head_dim),
        mask=mask_B1TS,
        is_causal=is_causal,
    )
    return out_BTNH.reshape(b, t, c)
