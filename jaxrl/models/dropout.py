"""Model dropout with torch's semantics (inverted dropout: kept values scaled by 1 / (1 - p)),
applied only to forwards traced inside `model_dropout(key)`.

Where each family drops (transformers 5.23; rates in `ModelConfig`):
- GPT-2: `embd_pdrop` on token + position embeddings (`embedding_dropout`), `attn_pdrop` on the
  attention probabilities (`attention_dropout`), `resid_pdrop` on the attention output after
  `c_proj` and on the MLP output after `c_proj` (`residual_dropout`).
- Phi-3: `attention_dropout` on the probabilities, `resid_pdrop` on the attention and the MLP
  outputs before their residual adds (`resid_attn_dropout`, `resid_mlp_dropout`). Its config's
  `embd_pdrop` is read by no module of transformers' Phi-3, so it drops nothing here either.
- Every other Llama-family model: `attention_dropout` on the attention probabilities only.

Keys. The trainer enters `model_dropout(key)` around a policy's training forward (see
`jaxrl.algos.model_dropout`); a forward traced outside it (a reference model, eval, predict,
generation, scoring passes) never drops. The embeddings draw from `site_key(key, EMBEDDING)`;
layer i runs with `layer_key(key, i)` as the active key (folded with the layer index, also
inside a scanned stack), and each of its sites from `site_key(layer key, site)`.

Masks. Every mask is a counter-based hash of the global indices of its entries, so it is the same
on every mesh and for any padded row length (a row keeps its mask whichever `length_buckets`
length its batch is padded to). Embedding and residual sites `[B, T, D]` keep entry (b, t, d) by
`position_bits` (threefry2x32 of (t, d // 2) under a per-row key). Attention probabilities keep
entry (b, h, q, k) by `attention_keep` (threefry2x32 of (q, k) under a per-(batch row, query
head) key), so the blockwise kernel can regenerate any block's mask in its backward, and the
mask is the same for every block size and kernel. `attention_dropout_mask` materialises it
(tests, the XLA reference path).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

# Streams folded into the forward's key: the embeddings, and the base of the per-layer keys.
EMBEDDING, LAYERS = 0, 1
# Sites folded into a layer's key.
ATTENTION, RESID_ATTN, RESID_MLP = 0, 1, 2

_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "model_dropout_key", default=None
)


@contextlib.contextmanager
def model_dropout(key: jax.Array | None) -> Iterator[None]:
    """Model forwards traced inside the block drop with their config's rates, drawing from `key`
    (a typed PRNG key); `key=None` turns dropout off. Read when the model is traced: enter it
    inside the jitted function."""
    token = _KEY.set(key)
    try:
        yield
    finally:
        _KEY.reset(token)


def active_key() -> jax.Array | None:
    """The key of the enclosing `model_dropout` (inside a layer: that layer's key), or None."""
    return _KEY.get()


def site_key(key: jax.Array, site: int) -> jax.Array:
    return jax.random.fold_in(key, site)


def layer_key(key: jax.Array, index: int | jax.Array) -> jax.Array:
    """Layer `index`'s key under the forward's `key` (the active key while that layer runs)."""
    return jax.random.fold_in(jax.random.fold_in(key, LAYERS), index)


def check_rate(name: str, rate: float) -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{name}={rate} must be in [0, 1).")


def position_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 random bits of `shape` `[..., T, D]` whose entry (row, t, d) depends only on `key`
    and those indices (`row` the flat index over the leading axes): word `d % 2` of threefry2x32
    of (t, d // 2) under the row's key, itself threefry2x32 of (row, 0) under two words drawn
    from `key`. So a row gets the same bits at any padded length T, and on any mesh; as many
    threefry calls as `jax.random.bits` makes."""
    *lead, t, d = shape
    rows, half = math.prod(lead), -(-d // 2)
    words = jax.random.bits(key, (2,), jnp.uint32)
    r = jnp.arange(rows, dtype=jnp.uint32)
    k0, k1 = threefry2x32_p.bind(
        jnp.broadcast_to(words[0], r.shape), jnp.broadcast_to(words[1], r.shape), r, 0 * r
    )
    args = jnp.broadcast_arrays(
        k0[:, None, None],
        k1[:, None, None],
        jnp.arange(t, dtype=jnp.uint32)[None, :, None],
        jnp.arange(half, dtype=jnp.uint32)[None, None, :],
    )
    bits = jnp.stack(threefry2x32_p.bind(*args), axis=-1).reshape(rows, t, 2 * half)
    return bits[..., :d].reshape(shape)


def position_uniform(key: jax.Array, shape: tuple[int, ...], low: float, high: float):
    """f32 uniform in [low, high) from `position_bits` (the mantissa trick of
    `jax.random.uniform`): the same value for an entry whatever T."""
    bits = position_bits(key, shape)
    one_two = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32)
    return low + (high - low) * (one_two - 1.0)


def keep_mask(key: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    """The keep mask (bool, `shape` `[..., T, D]`) of an embedding or residual site: entries
    whose `position_bits` are below `rate` of 2**32 drop."""
    return position_bits(key, shape) >= _threshold(rate)


def apply_keep(x: jax.Array, keep: jax.Array, rate: float) -> jax.Array:
    """torch's dropout given the keep mask: kept values times 1 / (1 - rate), others 0."""
    scaled = x.astype(jnp.float32) * jnp.float32(1.0 / (1.0 - rate))
    return jnp.where(keep, scaled, 0.0).astype(x.dtype)


def drop(x: jax.Array, site: int, rate: float) -> jax.Array:
    """`x` with dropout at `site` of the active key (unchanged without one or at rate 0)."""
    key = active_key()
    if key is None or not rate:
        return x
    return apply_keep(x, keep_mask(site_key(key, site), rate, x.shape), rate)


# ---------------------------------------------------------------- attention probabilities


def _threshold(rate: float) -> jax.Array:
    """Entries whose 32 random bits are below this are dropped: P(drop) = rate."""
    return jnp.uint32(min(round(rate * 2.0**32), 2**32 - 1))


def attention_row_keys(
    key: jax.Array, b_idx: jax.Array, h_idx: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The two key words of each (batch row, query head): threefry2x32 of (b, h) under two words
    drawn from `key` (any key implementation); b and h broadcast."""
    words = jax.random.bits(key, (2,), jnp.uint32)
    b, h = jnp.broadcast_arrays(jnp.asarray(b_idx, jnp.uint32), jnp.asarray(h_idx, jnp.uint32))
    k0 = jnp.broadcast_to(words[0], b.shape)
    k1 = jnp.broadcast_to(words[1], b.shape)
    return tuple(threefry2x32_p.bind(k0, k1, b, h))


def attention_keep(
    row_k0: jax.Array, row_k1: jax.Array, q_idx: jax.Array, k_idx: jax.Array, rate: float
) -> jax.Array:
    """Keep (bool) for query position `q_idx` and key position `k_idx` under a row's key words
    (from `attention_row_keys`); all four broadcast."""
    args = jnp.broadcast_arrays(
        row_k0, row_k1, jnp.asarray(q_idx, jnp.uint32), jnp.asarray(k_idx, jnp.uint32)
    )
    bits, _ = threefry2x32_p.bind(*args)
    return bits >= _threshold(rate)


def attention_dropout_mask(
    key: jax.Array, rate: float, batch: int, heads: int, queries: int, keys: int
) -> jax.Array:
    """The full keep mask `[B, N, T, S]` of the attention probabilities (query head n of HF's
    order), as every attention kernel applies it under `key`."""
    b = jnp.arange(batch, dtype=jnp.uint32)[:, None, None, None]
    n = jnp.arange(heads, dtype=jnp.uint32)[None, :, None, None]
    k0, k1 = attention_row_keys(key, b, n)
    q = jnp.arange(queries, dtype=jnp.uint32)[None, None, :, None]
    s = jnp.arange(keys, dtype=jnp.uint32)[None, None, None, :]
    return attention_keep(k0, k1, q, s, rate)
