"""Causal self-attention kernels for training, chosen per backend, none of which keeps `[B, N, T, S]`
scores as autodiff residuals.

This module picks the kernel (`resolve_impl`) and dispatches to it (`attend`); the blockwise
kernel lives in `jaxrl.models.blockwise_attention`, the splash call in
`jaxrl.models.splash_attention`, and the grouped XLA reference (`grouped_attention`) here.

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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.models import dropout as model_dropout
from jaxrl.models.blockwise_attention import blockwise_attention
from jaxrl.models.splash_attention import splash_attention

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
