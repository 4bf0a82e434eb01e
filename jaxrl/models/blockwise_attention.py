"""The blockwise (flash-style) causal attention kernel: online softmax in plain XLA with its own VJP,
so no `[B, N, T, S]` scores are kept as autodiff residuals. Runs on every backend; the default on
CPU, and wherever splash and cuDNN cannot run (soft-capping on GPU, attention dropout, attention
sinks, widened causality, DPO's explicit masks on TPU).

The forward visits only the key blocks a query block can see (causality, sliding window, and the
first key block its mask shows it: packed and padding-free rows skip the blocks of the documents
before a query's, over all rows of the batch) and saves the output and the per-row log-sum-exp;
the backward recomputes each block's probabilities from them. Dropout masks are regenerated per
block from global indices (`jaxrl.models.dropout`), GPT-OSS's sinks start the online softmax, and
Gemma 2's soft-capping is chained through in the backward.

The kernel only: choosing it per backend and the other kernels live in `jaxrl.models.attention`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxrl.core import loops
from jaxrl.models import dropout as model_dropout

# Largest query/key block of the blockwise kernel. Blocks are balanced (`block_size`), so a
# 129-token sequence runs as two 65-token blocks, not two 128-token ones.
MAX_BLOCK = 128


def block_size(seq_len: int, max_block: int = MAX_BLOCK) -> int:
    """The block length for `seq_len`: ceil(T / ceil(T / max_block)), rounded up to a multiple of 8
    (at most 7 padded rows per block) when that exceeds 8."""
    num_blocks = -(-seq_len // max_block)
    size = -(-seq_len // num_blocks)
    return size if size <= 8 else -(-size // 8) * 8


def blockwise_attention(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    mask_B1TS: jax.Array | None = None,
    *,
    window: int | None = None,
    max_block: int = MAX_BLOCK,
    scale: float | None = None,
    softcap: float | None = None,
    dropout: tuple[jax.Array, float] | None = None,
    sinks: jax.Array | None = None,
    key_limit_BT: jax.Array | None = None,
) -> jax.Array:
    """Causal attention `softmax(cap(q k^T * scale) + mask) v` (`scale` default 1 / sqrt(H);
    `cap(s) = softcap * tanh(s / softcap)` when `softcap` is set, else the identity) computed
    block by block.

    q [B, T, N, H]; k, v [B, T, K, H] with N a multiple of K (GQA). `mask_B1TS` (bool, leading dim
    B or 1) says which keys each query may see, on top of causality; `window` keeps key j for query
    i only when j > i - window (HF's sliding window). Scores and softmax statistics are f32; the
    probabilities are cast to v's dtype before the value matmul (as XLA's reference does).

    `dropout` (key, rate): torch's dropout on the normalised probabilities, `(P * M / (1 - p)) v`
    with the softmax normaliser unchanged; each block's part of the keep mask M is computed from
    the global (row, head, query, key) indices (`jaxrl.models.dropout.attention_keep`), in the
    forward and again in the backward, so no `[B, N, T, S]` array exists and the mask is the
    same for every block size.

    `sinks` ([N], GPT-OSS): a per-head logit in every row's softmax denominator with no value:
    the online softmax starts from it (running max = sink, running sum = 1), so the log-sum-exp
    includes it; its gradient is `-sum_rows exp(sink - lse) * delta` (delta the softmax
    backward's row term). A row that sees no key puts all its weight on the sink (output 0).

    `key_limit_BT` (int `[B, T]`, each >= its position): query t sees keys up to
    `key_limit_BT[b, t]` instead of t (Gemma 3's image tokens see their whole image; a limit of
    T - 1 everywhere is non-causal attention). A query block then visits key blocks up to the
    largest limit of its rows.
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
    scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
    softcap = None if softcap is None else float(softcap)
    row_keys, rate = None, 0.0
    if dropout is not None and dropout[1]:
        key, rate = dropout[0], float(dropout[1])
        # Per-row key words in the query-block row order [B, K, G * b]: row g * b + t is query
        # head k * G + g (the same for every block).
        G = N // K
        b = jnp.arange(B, dtype=jnp.uint32)[:, None, None]
        head = jnp.arange(N, dtype=jnp.uint32).reshape(1, K, G)
        k0, k1 = model_dropout.attention_row_keys(key, b, head)
        row_keys = tuple(jnp.repeat(w, size, axis=-1) for w in (k0, k1))
    if sinks is not None:
        sinks = sinks.astype(jnp.float32)
    limit = None
    if key_limit_BT is not None:
        nb = -(-T // size)
        limit = jnp.pad(key_limit_BT.astype(jnp.int32), ((0, 0), (0, nb * size - T)))
    return _attention(
        q_BTNH, k_BSKH, v_BSKH, mask_B1TS, row_keys, sinks, limit, size, window, scale, softcap,
        rate,
    )  # fmt: skip


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


def _key_range(i, size, window, limit=None, first=None):
    """Key blocks [lo, hi) that query block i can see: causality ends at the diagonal block (with
    a key limit: at the block of the largest limit of its rows); a sliding window starts at the
    block holding key (first query - window + 1); the mask's first visible key block of the
    query block (`first`, from `_first_key_blocks`) bounds it too."""
    hi = i + 1
    if limit is not None:
        rows = jax.lax.dynamic_slice_in_dim(limit, i * size, size, axis=1)
        hi = jnp.maximum(hi, jnp.max(rows) // size + 1)
    lo = 0
    if window is not None:
        lo = jnp.maximum(i * size - (window - 1), 0) // size
    if first is not None:
        lo = jnp.maximum(lo, first[i])
    if window is None and first is None:
        return 0, hi
    return jnp.minimum(lo, hi - 1), hi


def _first_key_blocks(mask_pad, size):
    """[nb] int32: per query block, the first key block that any of its rows (in any batch row)
    sees through the mask. Packed documents and padding-free rows (segment ids) then skip the
    blocks of the documents before theirs, so a row of many documents costs about the sum of
    their squares, not the square of the row. None without a mask."""
    if mask_pad is None:
        return None
    nb = mask_pad.shape[-2] // size
    blocks = mask_pad.reshape(mask_pad.shape[0], nb, size, nb, size).any(axis=(0, 2, 4))
    return jnp.where(blocks.any(-1), jnp.argmax(blocks, axis=-1), nb).astype(jnp.int32)


def _visible(i, j, size, seq_len, window, mask_pad, groups, limit=None):
    """[B or 1, 1, G * b, b] bool: which keys of block j the rows of query block i see."""
    q_pos = i * size + jnp.arange(size)
    k_pos = j * size + jnp.arange(size)
    ok_bb = k_pos[None, :] < seq_len
    if window is not None:
        ok_bb &= k_pos[None, :] > q_pos[:, None] - window
    if limit is None:
        ok = (ok_bb & (k_pos[None, :] <= q_pos[:, None]))[None, None]
    else:  # [B, b] limits of the block's rows
        rows_Bb = jax.lax.dynamic_slice_in_dim(limit, i * size, size, axis=1)
        ok = (ok_bb[None] & (k_pos[None, None, :] <= rows_Bb[:, :, None]))[:, None]
    if mask_pad is not None:
        m = jax.lax.dynamic_slice_in_dim(mask_pad, i * size, size, axis=2)
        ok = ok & jax.lax.dynamic_slice_in_dim(m, j * size, size, axis=3)
    # Every query head of a group shares the row's visibility.
    return jnp.tile(ok, (1, 1, groups, 1))


def _scores(q_BKRH, k_BKbH, scale, softcap):
    s = jnp.einsum("bkrh,bksh->bkrs", q_BKRH, k_BKbH, preferred_element_type=jnp.float32) * scale
    return s if softcap is None else jnp.tanh(s / softcap) * softcap


def _block_keep(row_keys, rate, i, j, size, groups, transposed=False):
    """The dropout keep mask of query block i x key block j: [B, K, G * b, b] (`transposed`:
    [B, K, b, G * b], the backward's layout)."""
    k0, k1 = row_keys
    q_pos = (i * size + jnp.tile(jnp.arange(size), groups)).astype(jnp.uint32)
    k_pos = (j * size + jnp.arange(size)).astype(jnp.uint32)
    if transposed:
        return model_dropout.attention_keep(
            k0[..., None, :], k1[..., None, :], q_pos[None, :], k_pos[:, None], rate
        )
    return model_dropout.attention_keep(
        k0[..., None], k1[..., None], q_pos[:, None], k_pos[None, :], rate
    )


def _pad_mask(mask_B1TS, size):
    if mask_B1TS is None:
        return None
    T = mask_B1TS.shape[-1]
    nb = -(-T // size)
    pad = nb * size - T
    return jnp.pad(mask_B1TS.astype(bool), ((0, 0), (0, 0), (0, pad), (0, pad)))


# ---------------------------------------------------------------- forward and backward


def _sink_rows(sinks_N, num_kv, size):
    """[N] per-head sink logits -> [K, G * b] in the query-block row order (row g * b + t is
    query head k * G + g)."""
    return jnp.repeat(sinks_N.reshape(num_kv, -1), size, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _attention(q, k, v, mask, row_keys, sinks, limit, size, window, scale, softcap, rate):
    return _forward(q, k, v, mask, row_keys, sinks, limit, size, window, scale, softcap, rate)[0]


def _forward(q, k, v, mask, row_keys, sinks, limit, size, window, scale, softcap, rate):
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    nb = -(-T // size)
    q_blocks = _to_q_blocks(q, K, size)
    k_blocks, v_blocks = _to_kv_blocks(k, size), _to_kv_blocks(v, size)
    mask_pad = _pad_mask(mask, size)
    first = _first_key_blocks(mask_pad, size)

    def query_block(_, xs):
        i, q_BKRH = xs

        def key_block(j, carry):
            m_BKR, l_BKR, acc_BKRH = carry
            s = _scores(q_BKRH, k_blocks[j], scale, softcap)
            s = jnp.where(_visible(i, j, size, T, window, mask_pad, G, limit), s, -jnp.inf)
            m_new = jnp.maximum(m_BKR, s.max(-1))
            # A row that has seen no visible key yet keeps max -inf: shift by 0 instead (no NaN).
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift[..., None])
            alpha = jnp.exp(m_BKR - shift)
            # Dropout scales what meets V; the normaliser sums the undropped probabilities.
            p_v = p
            if row_keys is not None:
                p_v = model_dropout.apply_keep(p, _block_keep(row_keys, rate, i, j, size, G), rate)
            pv = jnp.einsum(
                "bkrs,bksh->bkrh",
                p_v.astype(v.dtype),
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
        if sinks is not None:  # the sink is the first "key": max = sink, sum = exp(0), no value
            sink_BKR = jnp.broadcast_to(_sink_rows(sinks, K, size), rows)
            init = (sink_BKR, jnp.ones(rows, jnp.float32), init[2])
        lo, hi = _key_range(i, size, window, limit, first)
        m_BKR, denom_BKR, acc_BKRH = loops.fori_loop(lo, hi, key_block, init, trips=nb)
        seen_BKR = denom_BKR > 0
        safe_BKR = jnp.where(seen_BKR, denom_BKR, 1.0)
        out = acc_BKRH / safe_BKR[..., None]
        lse = jnp.where(seen_BKR, m_BKR + jnp.log(safe_BKR), -jnp.inf)
        return None, (out.astype(q.dtype), lse)

    _, (out_blocks, lse_blocks) = loops.scan(query_block, None, (jnp.arange(nb), q_blocks))
    out = _from_q_blocks(out_blocks, T, N)
    return out, (q, k, v, mask, row_keys, sinks, limit, out, lse_blocks)


def _backward(size, window, scale, softcap, rate, res, dout):
    q, k, v, mask, row_keys, sinks, limit, out, lse_blocks = res
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    nb = -(-T // size)
    q_blocks = _to_q_blocks(q, K, size)
    k_blocks, v_blocks = _to_kv_blocks(k, size), _to_kv_blocks(v, size)
    do_blocks = _to_q_blocks(dout, K, size)
    # delta_i = sum_h dO_ih O_ih = sum_j P_ij dP_ij (the softmax backward's row term; with
    # dropout O = (P * D) V, D = M / (1 - p), and dP = D * (dO V^T), so it still holds).
    delta_BNT = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta_blocks = _row_stat_blocks(delta_BNT, K, size)
    mask_pad = _pad_mask(mask, size)
    first = _first_key_blocks(mask_pad, size)

    # Every matmul below is [M, K] @ [K, N] or [M, K] @ [N, K]^T: none contracts the rows of an
    # operand, which XLA:CPU runs as a slow generic dot (and cannot run at all for bf16 inputs
    # with an f32 result). So the key-side products (dK, dV) work on the transposed scores
    # [keys, rows], and dQ is accumulated transposed ([H, rows], from K^T @ dS^T); the barriers
    # keep XLA from folding those transposes back into the dots (measured 5% faster at T=1024
    # than transposing dS^T per block).
    kT_blocks = jax.lax.optimization_barrier(jnp.swapaxes(k_blocks, -1, -2))  # [nb, B, K, H, b]

    def query_block(carry, xs):
        dk_acc, dv_acc = carry
        i, q_BKRH, do_BKRH, lse_BKR, delta_BKR = xs
        finite_lse = jnp.where(jnp.isfinite(lse_BKR), lse_BKR, 0.0)

        def key_block(j, inner):
            dq_BKRH, dk_acc, dv_acc = inner
            k_j, v_j = k_blocks[j], v_blocks[j]
            sT = jnp.einsum("bksh,bkrh->bksr", k_j, q_BKRH, preferred_element_type=jnp.float32)
            visible = jnp.swapaxes(_visible(i, j, size, T, window, mask_pad, G, limit), -1, -2)
            sT = sT * scale
            if softcap is not None:
                capped_T = jnp.tanh(sT / softcap)
                sT = capped_T * softcap
            pT = jnp.where(visible, jnp.exp(sT - finite_lse[..., None, :]), 0.0)
            pT_v = pT
            if row_keys is not None:  # the forward's mask, regenerated from the same indices
                keepT = _block_keep(row_keys, rate, i, j, size, G, transposed=True)
                pT_v = model_dropout.apply_keep(pT, keepT, rate)
            dv_j = jnp.einsum(
                "bksr,bkrh->bksh", pT_v.astype(v.dtype), do_BKRH, preferred_element_type=jnp.float32
            )
            dpT = jnp.einsum("bksh,bkrh->bksr", v_j, do_BKRH, preferred_element_type=jnp.float32)
            if row_keys is not None:
                dpT = model_dropout.apply_keep(dpT, keepT, rate)
            dsT = pT * (dpT - delta_BKR[..., None, :]) * scale
            if softcap is not None:  # d(cap * tanh(s / cap)) / ds = 1 - tanh(s / cap) ** 2
                dsT = dsT * (1.0 - jnp.square(capped_T))
            dq_BKRH = dq_BKRH + jnp.einsum(
                "bkhs,bksr->bkhr", kT_blocks[j], dsT.astype(k.dtype),
                preferred_element_type=jnp.float32,
            )  # fmt: skip
            dk_j = jnp.einsum(
                "bksr,bkrh->bksh", dsT.astype(q.dtype), q_BKRH, preferred_element_type=jnp.float32
            )
            return dq_BKRH, dk_acc.at[j].add(dk_j), dv_acc.at[j].add(dv_j)

        lo, hi = _key_range(i, size, window, limit, first)
        dq0 = jnp.zeros(jnp.swapaxes(q_BKRH, -1, -2).shape, jnp.float32)
        dqT, dk_acc, dv_acc = loops.fori_loop(lo, hi, key_block, (dq0, dk_acc, dv_acc), trips=nb)
        return (dk_acc, dv_acc), jnp.swapaxes(jax.lax.optimization_barrier(dqT), -1, -2)

    zeros_kv = jnp.zeros(k_blocks.shape, jnp.float32)
    (dk_blocks, dv_blocks), dq_blocks = loops.scan(
        query_block,
        (zeros_kv, zeros_kv),
        (jnp.arange(nb), q_blocks, do_blocks, lse_blocks, delta_blocks),
    )
    dq = _from_q_blocks(dq_blocks, T, N).astype(q.dtype)
    dk = _from_kv_blocks(dk_blocks, T).astype(k.dtype)
    dv = _from_kv_blocks(dv_blocks, T).astype(v.dtype)
    dsinks = None
    if sinks is not None:  # d lse / d sink = P_sink; rows past T have delta 0
        p_sink = jnp.exp(_sink_rows(sinks, K, size) - lse_blocks)  # [nb, B, K, G * b]
        dsinks = -(p_sink * delta_blocks).sum((0, 1)).reshape(K, G, size).sum(-1).reshape(N)
    return dq, dk, dv, None, None, dsinks, None


_attention.defvjp(_forward, _backward)
