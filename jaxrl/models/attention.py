"""Causal self-attention kernels for training, chosen per backend, none of which keeps `[B, N, T, S]`
scores as autodiff residuals.

- `blockwise_attention`: online-softmax (flash-style) attention in plain XLA with its own VJP.
  The forward visits only the key blocks a query block can see (causality, sliding window) and
  saves the output and the per-row log-sum-exp; the backward recomputes each block's
  probabilities from them. Runs on every backend; the default on CPU.
- cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`): the default on
  GPU where its constraints hold (bf16/fp16, head_dim a multiple of 8 and <= 128).
- XLA's reference attention (`implementation="xla"`): materialises the scores; kept as the
  parity reference and for `attention_impl="xla"`.

GQA is computed with query heads grouped per K/V head, so K and V are never repeated. Masks are
the model's `[B, 1, T, S]` key-visibility masks (padding, packed segments, DPO prefix trees) plus
causality and an optional static sliding window, as in `layers.dot_product_attention`.

Rows with no visible key give zeros here (XLA's reference averages all values instead); the model
never builds such rows (every query sees itself).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

IMPLS = ("blockwise", "cudnn", "xla")

# Largest query/key block of the blockwise kernel. Blocks are balanced (`block_size`), so a
# 129-token sequence runs as two 65-token blocks, not two 128-token ones.
MAX_BLOCK = 128


def block_size(seq_len: int, max_block: int = MAX_BLOCK) -> int:
    """The block length for `seq_len`: ceil(T / ceil(T / max_block)), rounded up to a multiple of 8
    (at most 7 padded rows per block) when that exceeds 8."""
    num_blocks = -(-seq_len // max_block)
    size = -(-seq_len // num_blocks)
    return size if size <= 8 else -(-size // 8) * 8


def resolve_impl(requested: str | None, q_BTNH: jax.Array) -> str:
    """The kernel for `ModelConfig.attention_impl`: None picks cuDNN on GPU where it applies
    (bf16/fp16, head_dim a multiple of 8 up to 128), blockwise elsewhere."""
    if requested is not None:
        return requested
    head_dim = q_BTNH.shape[-1]
    if (
        jax.default_backend() == "gpu"
        and q_BTNH.dtype in (jnp.bfloat16, jnp.float16)
        and head_dim % 8 == 0
        and head_dim <= 128
    ):
        return "cudnn"
    return "blockwise"


def attend(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    mask_B1TS: jax.Array | None,
    window: int | None,
    impl: str | None,
) -> jax.Array:
    """Causal GQA self-attention with the kernel `impl` (see `resolve_impl`); `window` is a static
    sliding window (HF semantics: key j is kept for query i when j > i - window) or None."""
    impl = resolve_impl(impl, q_BTNH)
    if impl == "blockwise":
        return blockwise_attention(q_BTNH, k_BSKH, v_BSKH, mask_B1TS, window=window)
    return jax.nn.dot_product_attention(
        q_BTNH,
        k_BSKH,
        v_BSKH,
        mask=mask_B1TS,
        is_causal=True,
        # jax's window is (keys left, keys right): HF keeps `window - 1` keys to the left.
        local_window_size=None if window is None else (window - 1, 0),
        implementation=impl,
    )


def blockwise_attention(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    mask_B1TS: jax.Array | None = None,
    *,
    window: int | None = None,
    max_block: int = MAX_BLOCK,
) -> jax.Array:
    """Causal attention `softmax(q k^T / sqrt(H) + mask) v` computed block by block.

    q [B, T, N, H]; k, v [B, T, K, H] with N a multiple of K (GQA). `mask_B1TS` (bool, leading dim
    B or 1) says which keys each query may see, on top of causality; `window` keeps key j for query
    i only when j > i - window (HF's sliding window). Scores and softmax statistics are f32; the
    probabilities are cast to v's dtype before the value matmul (as XLA's reference does).
    """
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    if S != T:
        raise ValueError(f"blockwise_attention is self-attention: q has {T} positions, k {S}.")
    if N % K:
        raise ValueError(f"{N} query heads are not a multiple of {K} key/value heads.")
    if mask_B1TS is not None and mask_B1TS.shape[-2:] != (T, S):
        raise ValueError(f"mask of shape {mask_B1TS.shape} does not match T={T}, S={S}.")
    size = block_size(T, max_block)
    return _attention(q_BTNH, k_BSKH, v_BSKH, mask_B1TS, size, window)


# ---------------------------------------------------------------- layout helpers
# Blocked layouts put the block index first so loops pick a block with a leading-axis index:
# queries [nb, B, K, G * b, H] (the G query heads of one K/V head stacked along rows, so one
# matmul serves the whole group), keys/values [nb, B, K, b, H].


def _to_q_blocks(x_BTNH, num_kv, size):
    B, T, N, H = x_BTNH.shape
    nb = -(-T // size)
    x = jnp.pad(x_BTNH, ((0, 0), (0, nb * size - T), (0, 0), (0, 0)))
    x = x.reshape(B, nb, size, num_kv, N // num_kv, H)
    return x.transpose(1, 0, 3, 4, 2, 5).reshape(nb, B, num_kv, N // num_kv * size, H)


def _from_q_blocks(x_nBKRH, seq_len, num_heads):
    nb, B, K, R, H = x_nBKRH.shape
    size = R * K // num_heads
    x = x_nBKRH.reshape(nb, B, K, num_heads // K, size, H).transpose(1, 0, 4, 2, 3, 5)
    return x.reshape(B, nb * size, num_heads, H)[:, :seq_len]


def _to_kv_blocks(x_BSKH, size):
    B, S, K, H = x_BSKH.shape
    nb = -(-S // size)
    x = jnp.pad(x_BSKH, ((0, 0), (0, nb * size - S), (0, 0), (0, 0)))
    return x.reshape(B, nb, size, K, H).transpose(1, 0, 3, 2, 4)


def _from_kv_blocks(x_nBKbH, seq_len):
    nb, B, K, b, H = x_nBKbH.shape
    return x_nBKbH.transpose(1, 0, 3, 2, 4).reshape(B, nb * b, K, H)[:, :seq_len]


def _row_stat_blocks(x_BNT, num_kv, size):
    """[B, N, T] per-row statistic -> [nb, B, K, G * b] (the query-block row order)."""
    B, N, T = x_BNT.shape
    nb = -(-T // size)
    x = jnp.pad(x_BNT, ((0, 0), (0, 0), (0, nb * size - T)))
    x = x.reshape(B, num_kv, N // num_kv, nb, size).transpose(3, 0, 1, 2, 4)
    return x.reshape(nb, B, num_kv, N // num_kv * size)


def _key_range(i, size, window):
    """Key blocks [lo, hi) that query block i can see: causality ends at the diagonal block;
    a sliding window starts at the block holding key (first query - window + 1)."""
    hi = i + 1
    if window is None:
        return 0, hi
    lo = jnp.maximum(i * size - (window - 1), 0) // size
    return jnp.minimum(lo, hi - 1), hi


def _visible(i, j, size, seq_len, window, mask_pad, groups):
    """[B or 1, 1, G * b, b] bool: which keys of block j the rows of query block i see."""
    q_pos = i * size + jnp.arange(size)
    k_pos = j * size + jnp.arange(size)
    ok_bb = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
    if window is not None:
        ok_bb &= k_pos[None, :] > q_pos[:, None] - window
    ok = ok_bb[None, None]
    if mask_pad is not None:
        m = jax.lax.dynamic_slice_in_dim(mask_pad, i * size, size, axis=2)
        ok = ok & jax.lax.dynamic_slice_in_dim(m, j * size, size, axis=3)
    # Every query head of a group shares the row's visibility.
    return jnp.tile(ok, (1, 1, groups, 1))


def _scores(q_BKRH, k_BKbH, scale):
    return jnp.einsum("bkrh,bksh->bkrs", q_BKRH, k_BKbH, preferred_element_type=jnp.float32) * scale


def _pad_mask(mask_B1TS, size):
    if mask_B1TS is None:
        return None
    T = mask_B1TS.shape[-1]
    nb = -(-T // size)
    pad = nb * size - T
    return jnp.pad(mask_B1TS.astype(bool), ((0, 0), (0, 0), (0, pad), (0, pad)))


# ---------------------------------------------------------------- forward and backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, mask, size, window):
    return _forward(q, k, v, mask, size, window)[0]


def _forward(q, k, v, mask, size, window):
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    nb = -(-T // size)
    scale = 1.0 / math.sqrt(H)
    q_blocks = _to_q_blocks(q, K, size)
    k_blocks, v_blocks = _to_kv_blocks(k, size), _to_kv_blocks(v, size)
    mask_pad = _pad_mask(mask, size)

    def query_block(_, xs):
        i, q_BKRH = xs

        def key_block(j, carry):
            m_BKR, l_BKR, acc_BKRH = carry
            s = _scores(q_BKRH, k_blocks[j], scale)
            s = jnp.where(_visible(i, j, size, T, window, mask_pad, G), s, -jnp.inf)
            m_new = jnp.maximum(m_BKR, s.max(-1))
            # A row that has seen no visible key yet keeps max -inf: shift by 0 instead (no NaN).
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift[..., None])
            alpha = jnp.exp(m_BKR - shift)
            pv = jnp.einsum(
                "bkrs,bksh->bkrh",
                p.astype(v.dtype),
                v_blocks[j],
                preferred_element_type=jnp.float32,
            )
            return m_new, alpha * l_BKR + p.sum(-1), alpha[..., None] * acc_BKRH + pv

        rows = q_BKRH.shape[:-1]
        init = (
            jnp.full(rows, -jnp.inf, jnp.float32),
            jnp.zeros(rows, jnp.float32),
            jnp.zeros((*rows, H), jnp.float32),
        )
        lo, hi = _key_range(i, size, window)
        m_BKR, denom_BKR, acc_BKRH = jax.lax.fori_loop(lo, hi, key_block, init)
        seen_BKR = denom_BKR > 0
        safe_BKR = jnp.where(seen_BKR, denom_BKR, 1.0)
        out = acc_BKRH / safe_BKR[..., None]
        lse = jnp.where(seen_BKR, m_BKR + jnp.log(safe_BKR), -jnp.inf)
        return None, (out.astype(q.dtype), lse)

    _, (out_blocks, lse_blocks) = jax.lax.scan(query_block, None, (jnp.arange(nb), q_blocks))
    out = _from_q_blocks(out_blocks, T, N)
    return out, (q, k, v, mask, out, lse_blocks)


def _backward(size, window, res, dout):
    q, k, v, mask, out, lse_blocks = res
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    nb = -(-T // size)
    scale = 1.0 / math.sqrt(H)
    q_blocks = _to_q_blocks(q, K, size)
    k_blocks, v_blocks = _to_kv_blocks(k, size), _to_kv_blocks(v, size)
    do_blocks = _to_q_blocks(dout, K, size)
    # delta_i = sum_h dO_ih O_ih = sum_j P_ij dP_ij (the softmax backward's row term).
    delta_BNT = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta_blocks = _row_stat_blocks(delta_BNT, K, size)
    mask_pad = _pad_mask(mask, size)

    def query_block(carry, xs):
        dk_acc, dv_acc = carry
        i, q_BKRH, do_BKRH, lse_BKR, delta_BKR = xs
        finite_lse = jnp.where(jnp.isfinite(lse_BKR), lse_BKR, 0.0)

        def key_block(j, inner):
            dq_BKRH, dk_acc, dv_acc = inner
            k_j, v_j = k_blocks[j], v_blocks[j]
            s = _scores(q_BKRH, k_j, scale)
            visible = _visible(i, j, size, T, window, mask_pad, G)
            p = jnp.where(visible, jnp.exp(s - finite_lse[..., None]), 0.0)
            dv_j = jnp.einsum(
                "bkrs,bkrh->bksh", p.astype(v.dtype), do_BKRH, preferred_element_type=jnp.float32
            )
            dp = jnp.einsum("bkrh,bksh->bkrs", do_BKRH, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_BKR[..., None]) * scale
            dq_BKRH = dq_BKRH + jnp.einsum(
                "bkrs,bksh->bkrh", ds.astype(k.dtype), k_j, preferred_element_type=jnp.float32
            )
            dk_j = jnp.einsum(
                "bkrs,bkrh->bksh", ds.astype(q.dtype), q_BKRH, preferred_element_type=jnp.float32
            )
            return dq_BKRH, dk_acc.at[j].add(dk_j), dv_acc.at[j].add(dv_j)

        lo, hi = _key_range(i, size, window)
        dq0 = jnp.zeros(q_BKRH.shape, jnp.float32)
        dq_BKRH, dk_acc, dv_acc = jax.lax.fori_loop(lo, hi, key_block, (dq0, dk_acc, dv_acc))
        return (dk_acc, dv_acc), dq_BKRH

    zeros_kv = jnp.zeros(k_blocks.shape, jnp.float32)
    (dk_blocks, dv_blocks), dq_blocks = jax.lax.scan(
        query_block,
        (zeros_kv, zeros_kv),
        (jnp.arange(nb), q_blocks, do_blocks, lse_blocks, delta_blocks),
    )
    dq = _from_q_blocks(dq_blocks, T, N).astype(q.dtype)
    dk = _from_kv_blocks(dk_blocks, T).astype(k.dtype)
    dv = _from_kv_blocks(dv_blocks, T).astype(v.dtype)
    return dq, dk, dv, None


_attention.defvjp(_forward, _backward)
