"""Key/value cache for incremental decoding: its layout, its sharding, the attention that writes
and reads it, and the cached pass over the layer stack.

Layout: one `KVCache(k, v)` per layer with k, v [B, K, S, H] (batch, kv heads, cache slot,
head dim) for an unscanned stack (a tuple of them), or a single `KVCache` stacked on a leading
layer axis [L, B, K, S, H] for a scanned stack. Heads before slots is the layout the attention
matmuls read, so a decode step never transposes the cache (on CPU that copy of the whole cache
per layer cost more than the step's attention). Prompts are left-padded, so in a static batch
every row writes the same slot at every step and the write index is one scalar
(`CacheView.index`); rows that advance on their own (the continuous engine's decode slots, a
tool turn's continuation) give one index per row instead (`[B]`, a scatter rather than a
slice). Which slots hold real tokens is `CacheView.key_mask_BS` (prompt padding is masked out).

Sliding windows count cache slots, as the training forward and transformers do (key j is
visible from query i when i - window < j <= i); left padding shifts both, so windows cover the
same real tokens.

This file holds no sampling logic (`jaxrl.generation`) and never changes the training forward:
the models call it only from their `cached*` methods.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxrl.core import loops
from jaxrl.models.attention import grouped_attention
from jaxrl.models.config import ModelConfig
from jaxrl.models.layers import (
    constrain_batch,
    dot_product_attention,
    merge_flags,
    per_layer_flags,
    stack_flags,
)
from jaxrl.models.masks import attention_mask_BTS, attention_masks, with_key_limit
from jaxrl.parallel import Rules, logical_to_spec

# Logical axes of one layer's k or v: sharded by batch and kv heads; slots stay whole.
CACHE_AXES = ("batch", "kv_heads", None, "head_dim")


@flax.struct.dataclass
class KVCache:
    """Keys and values after rope, in the compute dtype: [B, K, S, H] (or [L, B, K, S, H])."""

    k: jax.Array
    v: jax.Array


@flax.struct.dataclass
class CacheView:
    """Where this call writes and what it may read (shared by all layers of one forward).

    `index`: slot of the first new token (scalar int32, or [B]: each row's own; writes beyond
    the cache are dropped). `key_mask_BS`: slots holding real
    tokens (False for prompt padding). `prefill`: the new tokens start an empty cache, so they
    attend among themselves with the training attention kernel instead of over all S slots.
    `key_limit_BT` (prefill only): causality widened as in the training forward (Gemma 3's
    attention within each image both ways, `vision.image_key_limit`).
    """

    index: jax.Array
    key_mask_BS: jax.Array
    prefill: bool = flax.struct.field(pytree_node=False, default=False)
    key_limit_BT: jax.Array | None = None


Cache = tuple[KVCache, ...] | KVCache


def cache_shardings(
    config: ModelConfig, batch: int, length: int, mesh: Mesh, rules: Rules | None = None
) -> Cache:
    """NamedShardings of the cache `init_cache` builds (same tree), from `CACHE_AXES`."""
    shape = (batch, config.num_kv_heads, length, config.head_dim)
    if config.scan_layers:
        axes, shape = ("layers", *CACHE_AXES), (config.num_layers, *shape)
    else:
        axes = CACHE_AXES
    sharding = NamedSharding(mesh, logical_to_spec(axes, rules, shape, mesh))
    one = KVCache(sharding, sharding)
    return one if config.scan_layers else (one,) * config.num_layers


def init_cache(
    config: ModelConfig,
    batch: int,
    length: int,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
) -> Cache:
    """An empty cache of `length` slots (call under jit: with a mesh it is created sharded)."""
    shape = (batch, config.num_kv_heads, length, config.head_dim)
    if config.scan_layers:
        shape = (config.num_layers, *shape)
    zeros = KVCache(jnp.zeros(shape, config.dtype), jnp.zeros(shape, config.dtype))
    cache = zeros if config.scan_layers else (zeros,) * config.num_layers
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(
        cache, cache_shardings(config, batch, length, mesh, rules)
    )


def cached_attention(
    q_BTNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    cache: KVCache,
    view: CacheView,
    sliding: bool | jax.Array,
    config: ModelConfig,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Write the new keys/values at `view.index`, then attend (causal, GQA, sliding window,
    GPT-OSS's attention `sinks`). Attention runs in the compute dtype (the cache's), as
    `dot_product_attention`."""
    q_BTNH = q_BTNH.astype(config.dtype)
    seq_len = q_BTNH.shape[1]
    if jnp.ndim(view.index) == 0:
        k_BKSH = jax.lax.dynamic_update_slice_in_dim(
            cache.k, k_BTKH.swapaxes(1, 2).astype(cache.k.dtype), view.index, axis=2
        )
        v_BKSH = jax.lax.dynamic_update_slice_in_dim(
            cache.v, v_BTKH.swapaxes(1, 2).astype(cache.v.dtype), view.index, axis=2
        )
        query_slot_BT = (view.index + jnp.arange(seq_len, dtype=jnp.int32))[None, :]
    else:  # one write index per row: a scatter ([B, T] indices pick [B, T, K, H] entries)
        query_slot_BT = view.index[:, None] + jnp.arange(seq_len, dtype=jnp.int32)[None, :]
        rows_BT = jnp.broadcast_to(jnp.arange(q_BTNH.shape[0])[:, None], query_slot_BT.shape)
        k_BKSH = cache.k.at[rows_BT, :, query_slot_BT].set(
            k_BTKH.astype(cache.k.dtype), mode="drop"
        )
        v_BKSH = cache.v.at[rows_BT, :, query_slot_BT].set(
            v_BTKH.astype(cache.v.dtype), mode="drop"
        )
    new_cache = KVCache(k_BKSH, v_BKSH)
    if view.prefill:  # nothing older in the cache: the training kernel on the prompt alone
        if view.key_limit_BT is None:
            mask_B1TT = attention_mask_BTS(view.key_mask_BS[:, :seq_len], None)
        else:  # the training forward's mask (`LlamaModel.__call__`) with its key limit
            mask_B1TT = with_key_limit(
                attention_masks(view.key_mask_BS[:, :seq_len], None), view.key_limit_BT
            )
        out = dot_product_attention(q_BTNH, k_BTKH, v_BTKH, mask_B1TT, sliding, config, sinks)
        return out, new_cache
    query_slot_BT1 = query_slot_BT[:, :, None]
    key_slot_11S = jnp.arange(k_BKSH.shape[2], dtype=jnp.int32)[None, None, :]
    visible_BTS = key_slot_11S <= query_slot_BT1  # (B is 1 with a scalar index)
    if config.sliding_window is not None:
        in_window_BTS = key_slot_11S > query_slot_BT1 - config.sliding_window
        if isinstance(sliding, bool):
            visible_BTS = visible_BTS & in_window_BTS if sliding else visible_BTS
        else:  # scanned stack mixing full and sliding layers
            visible_BTS = visible_BTS & (in_window_BTS | ~sliding)
    # A query always sees itself, so no row is fully masked.
    mask_B11TS = view.key_mask_BS[:, None, None, None, :] & visible_BTS[:, None, None]
    out_BTNH = grouped_attention(
        q_BTNH, k_BKSH, v_BKSH, mask_B11TS, config.attention_scale, config.attn_logit_softcap,
        sinks=sinks,
    )  # fmt: skip
    return out_BTNH.astype(q_BTNH.dtype), new_cache


def apply_layers_cached(
    layers: nnx.Module,
    h_BTD: jax.Array,
    context: tuple,
    cache: Cache,
    view: CacheView,
    config: ModelConfig,
) -> tuple[jax.Array, Cache]:
    """The block stack with a cache: `block.cached(h, *context, layer_flags, cache, view)` per
    layer.

    Mirrors `layers.apply_layers` (a scanned stack scans over its cache's layer axis too) but
    never rematerialises: decoding takes no gradients.
    """
    h_BTD = constrain_batch(h_BTD, config)
    if not config.scan_layers:
        new_cache = []
        for block, flags, layer_cache in zip(layers, per_layer_flags(config), cache, strict=True):
            h_BTD, layer_cache = block.cached(h_BTD, *context, flags, layer_cache, view)
            h_BTD = constrain_batch(h_BTD, config)
            new_cache.append(layer_cache)
        return h_BTD, tuple(new_cache)

    graphdef, stacked_state = nnx.split(layers)
    static, scanned = stack_flags(config)

    def body(h: jax.Array, xs: tuple) -> tuple[jax.Array, KVCache]:
        block_state, flags, layer_cache = xs
        block = nnx.merge(graphdef, block_state)
        h, layer_cache = block.cached(h, *context, merge_flags(static, flags), layer_cache, view)
        return constrain_batch(h, config), layer_cache

    xs = (stacked_state, scanned, cache)
    return loops.scan(body, h_BTD, xs)
