"""Key-visibility masks and default positions from a batch's padding mask and segment ids: what
the training forward (`layers.dot_product_attention`'s callers) and the KV-cache prefill
(`kv_cache.cached_attention`) both build their attention from.

Pure functions of arrays; no parameters, no model config, no kernels (`jaxrl.models.attention`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models.attention import AttentionMask


def default_positions(
    attention_mask_BT: jax.Array | None, segment_ids_BT: jax.Array | None, seq_len: int
) -> jax.Array:
    """Position ids when the caller gives none.

    With `segment_ids`: restart at 0 at each new segment. With `attention_mask`:
    cumsum(mask) - 1 clipped at 0, so left- and right-padded real tokens get the same positions.
    Otherwise 0..T-1. An explicit [B, T, S] attention mask (custom layouts) has no implied
    positions: the caller must pass them.
    """
    if attention_mask_BT is not None and attention_mask_BT.ndim != 2:
        raise ValueError(
            "An explicit [B, T, S] attention mask needs explicit `positions` (they cannot be "
            "inferred from it); pass positions=..."
        )
    idx_T = jnp.arange(seq_len, dtype=jnp.int32)
    if segment_ids_BT is not None:
        prev_BT = jnp.pad(segment_ids_BT[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
        start_BT = jnp.where(segment_ids_BT != prev_BT, idx_T[None, :], 0)
        return idx_T[None, :] - jax.lax.cummax(start_BT, axis=1)
    if attention_mask_BT is not None:
        return jnp.maximum(jnp.cumsum(attention_mask_BT.astype(jnp.int32), axis=1) - 1, 0)
    return jnp.broadcast_to(idx_T, (1, seq_len))


def attention_mask_BTS(
    attention_mask: jax.Array | None, segment_ids_BT: jax.Array | None
) -> jax.Array | None:
    """[B, 1, T, S] bool: which keys each query may see (causality is added by the kernel).

    `attention_mask` is either the usual [B, T] padding mask, or (as HF's custom 4D masks) an
    explicit key-visibility mask [B, T, S] / [B, 1, T, S] for layouts such as DPO prefix
    sharing; an explicit mask is used as given (with `segment_ids` it is intersected with
    same-segment visibility). Tokens see only keys of their own segment (padding = segment 0).
    Every query also sees itself, so padding rows are never fully masked (no NaN on any backend).
    """
    if segment_ids_BT is None and attention_mask is None:
        return None
    explicit_B1TS = None
    if attention_mask is not None and attention_mask.ndim in (3, 4):
        explicit_B1TS = attention_mask.astype(bool)
        if explicit_B1TS.ndim == 3:
            explicit_B1TS = explicit_B1TS[:, None]
        seq_len = explicit_B1TS.shape[-1]
        eye_11TS = jnp.eye(seq_len, dtype=bool)[None, None]
        if segment_ids_BT is None:
            return explicit_B1TS | eye_11TS
        attention_mask = None
    elif attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(
            f"attention_mask must be [B, T] (padding) or [B, T, S] / [B, 1, T, S] (explicit); got "
            f"shape {attention_mask.shape}."
        )
    seg_BT = segment_ids_BT if segment_ids_BT is not None else attention_mask
    if segment_ids_BT is not None and attention_mask is not None:
        seg_BT = jnp.where(attention_mask.astype(bool), segment_ids_BT, 0)
    same_BTS = seg_BT[:, :, None] == seg_BT[:, None, :]
    seq_len = seg_BT.shape[1]
    mask_B1TS = (same_BTS | jnp.eye(seq_len, dtype=bool)[None])[:, None]
    return mask_B1TS if explicit_B1TS is None else mask_B1TS & explicit_B1TS


def attention_masks(
    attention_mask: jax.Array | None, segment_ids_BT: jax.Array | None
) -> AttentionMask | None:
    """`attention_mask_BTS`'s dense mask, plus the segment ids it came from when visibility is
    exactly "same segment" (no explicit mask), for kernels that take segment ids (splash)."""
    dense_B1TS = attention_mask_BTS(attention_mask, segment_ids_BT)
    if dense_B1TS is None:
        return None
    if attention_mask is not None and attention_mask.ndim != 2:
        return AttentionMask(dense_B1TS)  # an explicit mask: dense only
    segments_BT = segment_ids_BT if segment_ids_BT is not None else attention_mask
    if segment_ids_BT is not None and attention_mask is not None:
        segments_BT = jnp.where(attention_mask.astype(bool), segment_ids_BT, 0)
    return AttentionMask(dense_B1TS, segments_BT.astype(jnp.int32))


def with_key_limit(
    mask: AttentionMask | None, key_limit_BT: jax.Array | None
) -> AttentionMask | None:
    """`mask` (from `attention_masks`) with causality widened to `key_limit_BT` (see
    `AttentionMask`); unchanged when there is no limit."""
    if key_limit_BT is None:
        return mask
    if mask is None:
        return AttentionMask(None, None, key_limit_BT)
    return mask._replace(key_limit_BT=key_limit_BT)
