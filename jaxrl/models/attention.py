"""Causal self-attention kernels for training, chosen per backend, none of which keeps `[B, N, T, S]`
scores as autodiff residuals.

- `blockwise_attention`: online-softmax (flash-style) attention in plain XLA with its own VJP.
  The forward visits only the key blocks a query block can see (causality, sliding window, and
  the first key block its mask shows it: packed and padding-free rows skip the blocks of the
  documents before a query's, over all rows of the batch) and
  saves the output and the per-row log-sum-exp; the backward recomputes each block's
  probabilities from them. Runs on every backend; the default on CPU.
- cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`): the default on
  GPU where its constraints hold (bf16/fp16, head_dim a multiple of 8 and <= 128). A mask
  reaches it as a bias whose gradient it also writes; the trainers pass none for unpacked,
  right-padded rows (`jaxrl.algos.masks.model_masks`), which then run its causal kernel.
- Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`, the Pallas TPU kernel
  MaxText uses): the default on TPU whenever the key visibility is causality + padding / packed
  segments (+ a static sliding window), which it takes as segment ids. Explicit masks (DPO
  prefix trees) fall back to blockwise there. Off TPU it runs in Pallas' interpret mode (slow;
  tests only).
- XLA's reference attention (`implementation="xla"`): materialises the scores; kept as the
  parity reference and for `attention_impl="xla"`.

Gemma 2's tanh soft-capping of the scores (`softcap`: `cap * tanh(scores / cap)` after scaling,
before the mask) runs in the blockwise kernel (its backward chains through the tanh), in splash
(the kernel's `attn_logits_soft_cap`) and in `grouped_attention` (the reference for
`attention_impl="xla"`); cuDNN's kernel has none, so the default picks blockwise on GPU then.

Attention dropout (training forwards, `jaxrl.models.dropout`: torch's dropout on the normalised
probabilities) runs in the blockwise kernel (each block's mask regenerated in the backward from
global indices) and in `grouped_attention`; splash and cuDNN cannot take those masks, so naming
them is an error while dropping, and the default picks blockwise then.

GPT-OSS's attention sinks (a learned per-head logit in every row's softmax denominator, with no
value) run in the blockwise kernel (its online softmax starts from the sink) and in
`grouped_attention`; splash and cuDNN have none, so the default picks blockwise for such models
and naming those two is an error.

GQA is computed with query heads grouped per K/V head, so K and V are never repeated. Masks are
the model's `[B, 1, T, S]` key-visibility masks (padding, packed segments, DPO prefix trees) plus
causality and an optional static sliding window, as in `layers.dot_product_attention`.

Causality can be widened per query with a key limit (`AttentionMask.key_limit_BT`: query t sees
keys up to `key_limit_BT[b, t] >= t`): Gemma 3's image tokens see every token of their own image
(transformers' `token_type_ids` block mask), and SigLIP's encoder (`full_attention`) sees every
key. The blockwise kernel and XLA's reference take it; splash and cuDNN's causal kernels cannot,
so the default picks blockwise then and naming them is an error.

Rows with no visible key give zeros here (XLA's reference averages all values instead); the model
never builds such rows (every query sees itself).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxrl.core import loops
from jaxrl.models import dropout as model_dropout
from jaxrl.parallel import logical_to_spec

IMPLS = ("blockwise", "cudnn", "splash", "xla")


class AttentionMask(NamedTuple):
    """Key visibility as the models build it: the dense `[B, 1, T, S]` mask (None: no mask
    beyond causality), plus the `[B, T]` segment ids it was made from when visibility is exactly
    "same segment" (padding = 0, packed documents 1, 2, ...), which a kernel taking segment ids
    (splash) uses instead; None when an explicit mask (a DPO prefix tree) is part of it.
    `key_limit_BT` (int32 `[B, T]`, None: t) widens causality: query t sees keys up to
    `key_limit_BT[b, t]` (Gemma 3's image tokens: the last token of their image)."""

    dense_B1TS: jax.Array | None
    segments_BT: jax.Array | None = None
    key_limit_BT: jax.Array | None = None


# Largest query/key block of the blockwise kernel. Blocks are balanced (`block_size`), so a
# 129-token sequence runs as two 65-token blocks, not two 128-token ones.
MAX_BLOCK = 128


def block_size(seq_len: int, max_block: int = MAX_BLOCK) -> int:
    """The block length for `seq_len`: ceil(T / ceil(T / max_block)), rounded up to a multiple of 8
    (at most 7 padded rows per block) when that exceeds 8."""
    num_blocks = -(-seq_len // max_block)
    size = -(-seq_len // num_blocks)
    return size if size <= 8 else -(-size // 8) * 8


def resolve_impl(
    requested: str | None,
    q_BTNH: jax.Array,
    segments_known: bool = True,
    softcap: float | None = None,
    dropout: float | None = None,
    sinks: bool = False,
    key_limit: bool = False,
) -> str:
    """The kernel for `ModelConfig.attention_impl`: None picks splash on TPU when the mask is
    segment ids (`segments_known`), cuDNN on GPU where it applies (bf16/fp16, head_dim a multiple
    of 8 up to 128, no soft-capping), blockwise elsewhere, and blockwise whenever the attention
    probabilities drop (`dropout`, a training forward's rate: splash and cuDNN cannot take
    jaxrl's dropout masks) or the model has attention sinks (GPT-OSS: splash and cuDNN have
    none); and blockwise when causality is widened (`key_limit`: splash and cuDNN run causal
    kernels)."""
    if key_limit:
        if requested in ("cudnn", "splash"):
            raise ValueError(
                f"attention_impl={requested!r} runs a causal kernel, but this batch lets tokens "
                "see later ones (Gemma 3's image tokens attend to their whole image); use "
                "'blockwise' or 'xla', or leave attention_impl unset."
            )
        requested = requested or "blockwise"
    if sinks:
        if requested in ("cudnn", "splash"):
            raise ValueError(
                f"attention_impl={requested!r} has no attention sinks (GPT-OSS's per-head "
                "`self_attn.sinks`); use 'blockwise' or 'xla', or leave attention_impl unset."
            )
        return requested or "blockwise"
    if requested is not None:
        if requested == "cudnn" and softcap is not None:
            raise ValueError(
                f"attention_impl='cudnn' has no score soft-capping (attn_logit_softcapping="
                f"{softcap}); use 'blockwise' or leave attention_impl unset."
            )
        if requested in ("cudnn", "splash") and dropout:
            raise ValueError(
                f"attention_impl={requested!r} cannot apply attention dropout (attention_dropout="
                f"{dropout} in a training forward): use 'blockwise' or 'xla', leave "
                "attention_impl unset (blockwise while dropout is on), or turn the model's "
                "attention dropout off (disable_dropout=True, or 0.0 in config.json)."
            )
        return requested
    if dropout:
        return "blockwise"
    if jax.default_backend() == "tpu" and segments_known:
        return "splash"
    head_dim = q_BTNH.shape[-1]
    if (
        jax.default_backend() == "gpu"
        and softcap is None
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
    mask: jax.Array | AttentionMask | None,
    window: int | None,
    impl: str | None,
    mesh: Mesh | None = None,
    rules: Any = None,
    scale: float | None = None,
    softcap: float | None = None,
    dropout: tuple[jax.Array, float] | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal GQA self-attention with the kernel `impl` (see `resolve_impl`); `mask` is a dense
    `[B, 1, T, S]` visibility mask or an `AttentionMask`; `window` is a static sliding window (HF
    semantics: key j is kept for query i when j > i - window) or None. `mesh`/`rules` let the
    splash kernel run per shard (batch and heads as the model shards them). Scores are scaled by
    `scale` (default head_dim ** -0.5) in f32, after the matmul, as torch's SDPA does, then
    soft-capped to `softcap * tanh(scores / softcap)` when `softcap` is set (Gemma 2). `dropout`
    (key, rate): torch's dropout on the normalised probabilities before the value matmul, with
    the mask `jaxrl.models.dropout.attention_dropout_mask` (blockwise and xla only). `sinks`
    ([N], GPT-OSS): per-head logits that join each row's softmax denominator (no value)."""
    if isinstance(mask, AttentionMask):
        mask_B1TS, segments_BT, limit_BT = mask
    else:
        mask_B1TS, segments_BT, limit_BT = mask, None, None
    impl = resolve_impl(
        impl,
        q_BTNH,
        segments_known=mask_B1TS is None or segments_BT is not None,
        softcap=softcap,
        dropout=None if dropout is None else dropout[1],
        sinks=sinks is not None,
        key_limit=limit_BT is not None,
    )
    if impl == "splash":
        if mask_B1TS is not None and segments_BT is None:
            raise ValueError(
                "attention_impl='splash' takes padding and packing masks (segment ids); this "
                "batch has an explicit mask (e.g. DPO prefix sharing): use 'blockwise' or leave "
                "attention_impl unset."
            )
        return splash_attention(
            q_BTNH, k_BSKH, v_BSKH, segments_BT, window=window, mesh=mesh, rules=rules,
            scale=scale, softcap=softcap,
        )  # fmt: skip
    if impl == "blockwise":
        return blockwise_attention(
            q_BTNH, k_BSKH, v_BSKH, mask_B1TS, window=window, scale=scale, softcap=softcap,
            dropout=dropout, sinks=sinks, key_limit_BT=limit_BT,
        )  # fmt: skip
    if softcap is not None or dropout is not None or sinks is not None or limit_BT is not None:
        # XLA's reference has no soft-capping, dropout, sinks or widened causality: the same
        # math, written out
        T = q_BTNH.shape[1]
        idx = jnp.arange(T)
        if limit_BT is None:
            visible = (idx[None, :] <= idx[:, None])[None, None, None]
        else:
            visible = (idx[None, None, :] <= limit_BT[:, :, None])[:, None, None]
        if window is not None:
            visible &= (idx[None, :] > idx[:, None] - window)[None, None, None]
        if mask_B1TS is not None:
            visible = visible & mask_B1TS.astype(bool)[:, :, None]
        return grouped_attention(
            q_BTNH, k_BSKH.swapaxes(1, 2), v_BSKH.swapaxes(1, 2), visible, scale, softcap,
            dropout=dropout, sinks=sinks,
        )  # fmt: skip
    return jax.nn.dot_product_attention(
        q_BTNH,
        k_BSKH,
        v_BSKH,
        mask=mask_B1TS,
        scale=scale,
        is_causal=True,
        # jax's window is (keys left, keys right): HF keeps `window - 1` keys to the left.
        local_window_size=None if window is None else (window - 1, 0),
        implementation=impl,
    )


def full_attention(
    q_BTNH: jax.Array, k_BTNH: jax.Array, v_BTNH: jax.Array, impl: str | None
) -> jax.Array:
    """Non-causal, unmasked multi-head attention (SigLIP's vision encoder; scores scaled by
    head_dim ** -0.5): cuDNN's flash kernel where it applies (GPU, bf16/fp16, head_dim a
    multiple of 8 up to 128), XLA's reference for `impl="xla"`, else the blockwise kernel with
    every key visible to every query (splash has no non-causal mask here)."""
    if impl == "xla" or (impl in (None, "cudnn") and resolve_impl(None, q_BTNH) == "cudnn"):
        return jax.nn.dot_product_attention(
            q_BTNH, k_BTNH, v_BTNH, implementation="xla" if impl == "xla" else "cudnn"
        )
    B, T = q_BTNH.shape[:2]
    every_key_BT = jnp.full((B, T), T - 1, jnp.int32)
    return blockwise_attention(q_BTNH, k_BTNH, v_BTNH, key_limit_BT=every_key_BT)


def grouped_attention(
    q_BTNH: jax.Array,
    k_BKSH: jax.Array,
    v_BKSH: jax.Array,
    visible: jax.Array,
    scale: float | None = None,
    softcap: float | None = None,
    dropout: tuple[jax.Array, float] | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Materialised GQA attention (K/V heads not repeated: query head n = kv head n // G, HF's
    order): f32 scores scaled by `scale` (default: divided by sqrt(head_dim)), soft-capped when
    `softcap` is set, masked to -inf where `visible` (bool, broadcastable to `[B, K, G, T, S]`)
    is False, softmax in f32, probabilities cast to v's dtype. Every row must see a key. The
    KV-cache decode path and the soft-capped, dropping or sink-using `attention_impl="xla"` use
    it. `dropout` (key, rate): self-attention only (query i at position i), the probabilities
    (b, n, i, j) kept by `jaxrl.models.dropout.attention_dropout_mask` and scaled by
    1 / (1 - rate). `sinks` ([N], GPT-OSS): one extra logit per query head in every row's
    softmax, with no value: probabilities `exp(s_j) / (sum_j exp(s_j) + exp(sink))`
    (transformers' `eager_attention_forward` for gpt_oss: the sink column joins the max
    subtraction; dropout, as there, acts on the probabilities after the sink column is removed)."""
    B, T, N, H = q_BTNH.shape
    K = k_BKSH.shape[1]
    q_BKGTH = q_BTNH.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
    scores = jnp.einsum("bkgth,bksh->bkgts", q_BKGTH, k_BKSH, preferred_element_type=jnp.float32)
    if scale is None:
        scores = scores / jnp.sqrt(jnp.float32(H))
    else:
        scores = scores * jnp.float32(scale)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(visible, scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink_BKGT1 = jnp.broadcast_to(
            sinks.astype(jnp.float32).reshape(1, K, N // K, 1, 1), (*scores.shape[:-1], 1)
        )
        combined = jnp.concatenate([scores, sink_BKGT1], axis=-1)
        probs = jax.nn.softmax(combined, axis=-1)[..., :-1]
    if dropout is not None:
        key, rate = dropout
        S = k_BKSH.shape[2]
        # query head n = k * G + g: HF's head order splits into [K, G] directly
        keep = model_dropout.attention_dropout_mask(key, rate, B, N, T, S)
        probs = model_dropout.apply_keep(probs, keep.reshape(B, K, N // K, T, S), rate)
    probs = probs.astype(v_BKSH.dtype)
    out_BKGTH = jnp.einsum("bkgts,bksh->bkgth", probs, v_BKSH)
    return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


# ---------------------------------------------------------------- splash (Pallas, TPU)


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
