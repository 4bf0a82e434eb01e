"""Splash attention: the Pallas TPU kernel MaxText uses
(`jax.experimental.pallas.ops.tpu.splash_attention`), the default on TPU whenever the key
visibility is causality + padding / packed segments (+ a static sliding window), which it takes as
segment ids. Off TPU it runs in Pallas' interpret mode (slow; tests only).

The kernel call only (padding to 128, pre-scaled queries, the per-shard `shard_map`); choosing it
and refusing the masks it cannot take live in `jaxrl.models.attention`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxrl.parallel import logical_to_spec


def _splash_block(seq_len: int) -> int:
    """The kernel's block length: the largest of 512, 256, 128 dividing the (128-padded) length."""
    return next(b for b in (512, 256, 128) if seq_len % b == 0)


@functools.lru_cache(maxsize=64)
def _splash_kernel(
    seq_len: int, num_heads: int, window: int | None, interpret: bool, softcap: float | None
):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as mask_lib,
    )

    shape = (seq_len, seq_len)
    head_mask = (
        mask_lib.CausalMask(shape)
        if window is None
        else mask_lib.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    )
    b = _splash_block(seq_len)
    sizes = kernel_lib.BlockSizes(
        block_q=b, block_kv=b, block_kv_compute=b,
        block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b,
    )  # fmt: skip
    # Cached across traces, so its mask tables must be concrete arrays, never tracers of the
    # jitted function that happened to build it first (a train step's kernel reused by the eval
    # step's trace leaked them).
    with jax.ensure_compile_time_eval():
        kernel = kernel_lib.make_splash_mha(
            mask_lib.MultiHeadMask([head_mask] * num_heads),
            head_shards=1,
            q_seq_shards=1,
            block_sizes=sizes,
            attn_logits_soft_cap=softcap,
            interpret=interpret,
        )
    return kernel, kernel_lib.SegmentIds


def splash_attention(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    segments_BT: jax.Array | None = None,
    *,
    window: int | None = None,
    mesh: Mesh | None = None,
    rules: Any = None,
    interpret: bool | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Causal GQA attention with the Pallas splash kernel: `softmax(q k^T * scale) v` (`scale`
    default 1 / sqrt(H); scores soft-capped to `softcap * tanh(s / softcap)` when set) where
    query i sees key j when j <= i, j > i - window (if set) and both share a segment id.

    Lengths are padded to a multiple of 128 with a segment id no real token has. Under a mesh the
    kernel runs per shard (`shard_map`: batch and heads split as the model's rules split them,
    so no gather). `interpret` defaults to True off TPU (Pallas' interpreter, for tests).
    """
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    if k_BSKH.shape[1] != T:
        raise ValueError(
            f"splash_attention is self-attention: q has {T} positions, k {k_BSKH.shape[1]}."
        )
    if N % K:
        raise ValueError(f"{N} query heads are not a multiple of {K} key/value heads.")
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    padded = -(-T // 128) * 128
    if padded != T or segments_BT is not None:
        real_BT = jnp.zeros((B, T), jnp.int32) if segments_BT is None else segments_BT
        segments_BT = jnp.pad(
            real_BT.astype(jnp.int32), ((0, 0), (0, padded - T)), constant_values=-1
        )
    pad = ((0, 0), (0, padded - T), (0, 0), (0, 0))
    # Scale in f32, then back to the input dtype (the kernel takes pre-scaled queries).
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    q = (q_BTNH.astype(jnp.float32) * scale).astype(q_BTNH.dtype)
    q_BNTH = jnp.pad(q, pad).transpose(0, 2, 1, 3)
    k_BKTH = jnp.pad(k_BSKH, pad).transpose(0, 2, 1, 3)
    v_BKTH = jnp.pad(v_BSKH, pad).transpose(0, 2, 1, 3)

    def local(q_BNTH, k_BKTH, v_BKTH, segments_BT):
        kernel, segment_ids = _splash_kernel(padded, q_BNTH.shape[1], window, interpret, softcap)
        if segments_BT is None:
            return jax.vmap(kernel)(q_BNTH, k_BKTH, v_BKTH)
        ids = segment_ids(q=segments_BT, kv=segments_BT)
        return jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids))(
            q_BNTH, k_BKTH, v_BKTH, ids
        )

    if mesh is not None and mesh.size > 1:
        heads = logical_to_spec(("batch", "heads"), rules, (B, N), mesh)
        kv_heads = logical_to_spec(("batch", "kv_heads"), rules, (B, K), mesh)
        if heads[1] != kv_heads[1]:  # K/V heads do not split like the query heads: keep whole
            heads = kv_heads = PartitionSpec(heads[0], None)
        qkv_spec = PartitionSpec(heads[0], heads[1], None, None)
        kv_spec = PartitionSpec(kv_heads[0], kv_heads[1], None, None)
        seg_spec = None if segments_BT is None else PartitionSpec(heads[0], None)
        local = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(qkv_spec, kv_spec, kv_spec, seg_spec),
            out_specs=qkv_spec,
            check_vma=False,
        )
    out_BNTH = local(q_BNTH, k_BKTH, v_BKTH, segments_BT)
    return out_BNTH.transpose(0, 2, 1, 3)[:, :T]
