"""Rotary position embeddings: the inverse frequencies of each rope type (default, linear,
llama3, yarn, longrope; Gemma 3's and OLMo 3's sliding layers on their own base), the cos/sin
tables for a batch of positions, and their application to q and k with HF's rotate_half
convention.

Tables are computed on the fly from positions; nothing here holds parameters or state.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxrl.models.config import ModelConfig
from jaxrl.models.layers import LayerFlags


def rope_inv_freq(config: ModelConfig, local: bool = False, long: bool = False) -> jax.Array:
    """Inverse frequencies [rotary_dim/2] for rope types default, linear, llama3 (Llama 3.1),
    yarn and longrope (its short factors, or with `long` its long ones); `local`: the sliding
    layers of Gemma 3 / OLMo 3 (default rope, base `local_rope_theta`)."""
    dim = config.rotary_dim or config.head_dim
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    if local:
        return 1.0 / (config.local_rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_type == "longrope":
        factors = config.rope_long_factor if long else config.rope_short_factor
        return 1.0 / (jnp.asarray(factors, jnp.float32) * config.rope_theta**exponents)
    if config.rope_type == "linear":
        return inv_freq / config.rope_factor
    if config.rope_type == "llama3":
        # Llama 3.1 frequency smoothing (transformers `_compute_llama3_parameters`).
        factor = config.rope_factor
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        old_len = config.rope_original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return jnp.where(is_medium, smoothed, scaled)
    if config.rope_type == "yarn":
        # transformers `_compute_yarn_parameters`: interpolated frequencies (divided by the
        # factor) below a linear ramp over the dimensions between the beta_fast and beta_slow
        # rotation counts, extrapolated (unchanged) ones above it.
        def correction_dim(rotations: float) -> float:
            length = config.rope_original_max_position_embeddings
            return (
                dim
                * math.log(length / (rotations * 2 * math.pi))
                / (2 * math.log(config.rope_theta))
            )

        low, high = correction_dim(config.rope_beta_fast), correction_dim(config.rope_beta_slow)
        if config.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # the extrapolation share
        return inv_freq / config.rope_factor * (1 - keep) + inv_freq * keep
    return inv_freq


def rope_tables(positions_BT: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, rotary_dim] in f32 (HF layout: the half-frequency table repeated twice).
    With `config.local_rope_theta` (Gemma 3) both are [2, B, T, head_dim]: the full layers'
    table, then the sliding layers'; `rotate` picks a layer's."""

    def table(inv_freq, factor=1.0):
        freqs_BTF = positions_BT.astype(jnp.float32)[..., None] * inv_freq
        emb_BTH = jnp.concatenate([freqs_BTF, freqs_BTF], axis=-1)
        if factor == 1.0:
            return jnp.cos(emb_BTH), jnp.sin(emb_BTH)
        return jnp.cos(emb_BTH) * factor, jnp.sin(emb_BTH) * factor  # YaRN's attention factor

    if config.rope_type == "longrope":
        # transformers' longrope update: the long factors once the call's largest position id
        # reaches the original context (one choice for the whole batch, as there).
        is_long = jnp.max(positions_BT) + 1 > config.rope_original_max_position_embeddings
        inv_freq = jnp.where(
            is_long, rope_inv_freq(config, long=True), rope_inv_freq(config, long=False)
        )
        return table(inv_freq, config.rope_attention_factor)
    if config.local_rope_theta is None:
        return table(rope_inv_freq(config), config.rope_attention_factor)
    (cos_g, sin_g), (cos_l, sin_l) = (
        table(rope_inv_freq(config), config.rope_attention_factor),
        table(rope_inv_freq(config, True)),
    )
    return jnp.stack([cos_g, cos_l]), jnp.stack([sin_g, sin_l])


def rotate(
    q_BTNH: jax.Array, k_BTKH: jax.Array, cos: jax.Array, sin: jax.Array, layer: LayerFlags
) -> tuple[jax.Array, jax.Array]:
    """q and k with a layer's rotary embedding: from `rope_tables`' output, the sliding layers'
    table when there are two and the layer slides (Gemma 3); none on a NoPE layer (SmolLM3)."""
    if cos.ndim == 4:
        if isinstance(layer.sliding, bool):
            cos, sin = cos[int(layer.sliding)], sin[int(layer.sliding)]
        else:
            index = layer.sliding.astype(jnp.int32)
            cos = jax.lax.dynamic_index_in_dim(cos, index, keepdims=False)
            sin = jax.lax.dynamic_index_in_dim(sin, index, keepdims=False)
    if layer.rope is False:
        return q_BTNH, k_BTKH
    q_rot, k_rot = apply_rope(q_BTNH, cos, sin), apply_rope(k_BTKH, cos, sin)
    if layer.rope is True:
        return q_rot, k_rot
    return jnp.where(layer.rope, q_rot, q_BTNH), jnp.where(layer.rope, k_rot, k_BTKH)


def apply_rope(x_BTNH: jax.Array, cos_BTH: jax.Array, sin_BTH: jax.Array) -> jax.Array:
    """Rotary embedding with HF's rotate_half convention, computed in f32, on the first
    `cos_BTH.shape[-1]` features of each head (all of them but with a partial rotary factor);
    the others pass unchanged."""
    rotary = cos_BTH.shape[-1]
    x = x_BTNH[..., :rotary].astype(jnp.float32)
    half = rotary // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = (x * cos_BTH[:, :, None, :] + rotated * sin_BTH[:, :, None, :]).astype(x_BTNH.dtype)
    if rotary == x_BTNH.shape[-1]:
        return out
    return jnp.concatenate([out, x_BTNH[..., rotary:]], axis=-1)
