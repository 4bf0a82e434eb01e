"""GPT-OSS (openai/gpt-oss-20b / 120b, transformers `model_type` "gpt_oss").

A Llama-like decoder (pre-norm RMSNorm, GQA with q/k/v/o biases, YaRN rope, alternating
sliding-window and full layers) with two differences:

- Attention sinks: each query head has a learned logit (`self_attn.sinks`, trainable) that joins
  every row's softmax denominator without contributing a value, so a row may put probability on
  "nothing" (`attention.grouped_attention`'s `sinks`; the training forward and the KV-cache
  decode path both use it).
- Mixture of experts in every layer (`mlp.router`, `mlp.experts`): the router is a linear layer
  with a bias; each token takes its top-k logits and a softmax over just those k as routing
  weights. Each expert is `down(swiglu(x @ gate_up + b) ) + b` with GPT-OSS's clamped SwiGLU:
  gate clamped above at `limit`, up clamped to [-limit, limit], `(up + 1) * gate *
  sigmoid(alpha * gate)`.

Checkpoint layout (transformers'): `mlp.experts.gate_up_proj [E, D, 2F]` with gate and up
INTERLEAVED on the last axis (gate = [..., ::2], up = [..., 1::2]), `gate_up_proj_bias [E, 2F]`,
`down_proj [E, F, D]`, `down_proj_bias [E, D]` (whole tensors, [in, out], not per-expert
`nn.Linear`s). jaxrl keeps gate and up on a separate axis of 2 (`[E, D, 2, F]`, `[E, 2, F]`),
so the two halves are contiguous slices of one grouped matmul's output; `hf.py` de-interleaves
on load and re-interleaves on save (`hf_layout` metadata, exact round trip). The released
checkpoints store the expert weights as MXFP4 (`*_blocks` / `*_scales`), dequantized on load
(`jaxrl.models.mxfp4`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models import moe
from jaxrl.models.causal_lm import CausalLM
from jaxrl.models.config import ModelConfig
from jaxrl.models.kv_cache import CacheView, KVCache
from jaxrl.models.layers import (
    Embed,
    LayerFlags,
    RMSNorm,
    make_layers,
    make_param,
    normal_init,
    param_value,
)
from jaxrl.models.llama import LlamaAttention, LlamaModel
from jaxrl.models.router_stats import record_router_stats

# `hf_layout` metadata of the expert params: how the HF tensor maps to ours (see `hf.py`).
INTERLEAVED = "gate_up_interleaved"  # HF [..., 2F] (gate, up alternating) <-> ours [..., 2, F]
AS_IS = "as_is"  # same shape and order (HF's [E, in, out] expert tensors are not transposed)


# ---------------------------------------------------------------- checkpoint layouts


def hf_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for one (unstacked) param of ours with `hf_layout` `layout`."""
    if layout == INTERLEAVED:
        return (*shape[:-2], 2 * shape[-1])
    return tuple(shape)


def from_hf(layout: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if layout == INTERLEAVED:  # [..., 2F] = [..., F, 2] (gate, up pairs) -> [..., 2, F]
        return np.swapaxes(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), -1, -2).reshape(shape)
    return x.reshape(shape)


def to_hf(layout: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if layout == INTERLEAVED:  # [..., 2, F] -> [..., F, 2] -> [..., 2F]
        return np.swapaxes(x, -1, -2).reshape(shape)
    return x.reshape(shape)


# ---------------------------------------------------------------- modules


class GptOssAttention(LlamaAttention):
    """Llama attention (q/k/v/o biases from `attention_bias`) plus per-head sink logits."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        super().__init__(config, rngs)
        self.sinks = make_param(
            rngs,
            normal_init(config.initializer_range),
            (config.num_heads,),
            ("heads",),
            config.param_dtype,
        )

    def _sinks(self) -> jax.Array:
        return param_value(self.sinks)


class GptOssRouter(nnx.Module):
    """HF's `GptOssTopKRouter`: `logits = x W^T + b` (`router.weight [E, D]`, `router.bias [E]`)
    in the compute dtype, as `F.linear` under autocast."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.dtype = config.dtype
        init = normal_init(config.initializer_range)
        d, e = config.hidden_size, config.num_experts
        self.kernel = make_param(rngs, init, (d, e), ("embed", None), config.param_dtype, n_in=1)
        self.bias = make_param(rngs, init, (e,), (None,), config.param_dtype)

    def __call__(self, x_MD: jax.Array) -> jax.Array:
        logits = jnp.matmul(
            x_MD.astype(self.dtype),
            param_value(self.kernel, self.dtype),
            preferred_element_type=jnp.float32,
        )
        # As `Dense`: the bias in the compute dtype, added to the f32 product, rounded once.
        return (logits + param_value(self.bias, self.dtype)).astype(self.dtype)


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """GPT-OSS's expert activation (transformers' `GptOssExperts._apply_gate`)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class GptOssExperts(nnx.Module):
    """`num_experts` biased clamped-SwiGLU MLPs, weights stacked on the `experts` axis under HF's
    parameter names (`gate_up_proj`, `gate_up_proj_bias`, `down_proj`, `down_proj_bias`); gate
    and up on their own axis of 2 (see the module docstring)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.dtype = config.dtype
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.mesh, self.rules = config.mesh, config.rules
        init = normal_init(config.initializer_range)
        zeros = jax.nn.initializers.zeros

        def param(init, shape, axes, layout):
            return make_param(rngs, init, shape, axes, config.param_dtype, hf_layout=layout)

        self.gate_up_proj = param(
            init, (e, d, 2, f), ("experts", "embed", None, "mlp"), INTERLEAVED
        )
        self.gate_up_proj_bias = param(zeros, (e, 2, f), ("experts", None, "mlp"), INTERLEAVED)
        self.down_proj = param(init, (e, f, d), ("experts", "mlp", "embed"), AS_IS)
        self.down_proj_bias = param(zeros, (e, d), ("experts", "embed"), AS_IS)

    def weights(self) -> tuple[jax.Array, ...]:
        names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        return tuple(param_value(getattr(self, n)) for n in names)

    def low_rank(self) -> dict[str, tuple[jax.Array, jax.Array, float]]:
        """Per-expert low-rank updates `(A, B, scaling)` added inside the dispatch, as
        `moe.Experts.low_rank`: "gate_up" (`A [E, D, r]`, `B [E, r, 2, F]`) and/or "down"
        (`A [E, F, r]`, `B [E, r, D]`); `jaxrl.lora.LoraGptOssExperts` supplies them."""
        return {}

    def __call__(self, x_MD: jax.Array, experts_MK: jax.Array) -> jax.Array:
        """Each token's output from each of its K experts, `[M, K, D]`; under a mesh splitting
        the tokens, each device runs its own (as `moe.Experts`)."""
        low_rank = self.low_rank()
        factors = {k: (a, b) for k, (a, b, _) in low_rank.items()}
        scalings = {k: s for k, (_, _, s) in low_rank.items()}
        dispatch = functools.partial(_dispatch, self.dtype, self.alpha, self.limit, scalings)
        weights = self.weights()
        return moe.per_device_tokens(
            dispatch, self.mesh, self.rules, x_MD, experts_MK, weights, factors
        )


def _dispatch(dtype, alpha, limit, scalings, x_MD, experts_MK, weights, factors) -> jax.Array:
    """Rows sorted by expert, two grouped matmuls (`ragged_dot`, plus an expert's low-rank
    update where `factors` has one) with each row's expert bias, rows put back in token order.
    Matmul outputs are rounded to the compute dtype and the biases added with torch's type
    promotion (f32 under autocast), as HF's eager experts do."""
    w_gate_up, b_gate_up, w_down, b_down = weights
    num_tokens, top_k = experts_MK.shape
    num_experts, d, _, f = w_gate_up.shape
    flat_N = experts_MK.reshape(-1)
    order_N = jnp.argsort(flat_N, stable=True)
    expert_N = flat_N[order_N]
    group_sizes_E = jnp.bincount(flat_N, length=num_experts).astype(jnp.int32)
    x_ND = x_MD.astype(dtype)[order_N // top_k]

    def grouped(lhs, rhs):  # f32: a low-rank update is added before the rounding
        return jax.lax.ragged_dot(
            lhs.astype(dtype), rhs.astype(dtype), group_sizes_E, preferred_element_type=jnp.float32
        )

    def plus_low_rank(kind, y, lhs):
        if kind not in factors:
            return y.astype(dtype)
        a, b = factors[kind]
        u = grouped(lhs, a).astype(dtype)
        return (y + scalings[kind] * grouped(u, b.reshape(*b.shape[:2], -1))).astype(dtype)

    gate_up_N2F = grouped(x_ND, w_gate_up.reshape(num_experts, d, 2 * f))
    gate_up_N2F = plus_low_rank("gate_up", gate_up_N2F, x_ND)
    gate_up_N2F = gate_up_N2F + b_gate_up.reshape(num_experts, 2 * f)[expert_N]
    h_NF = clamped_swiglu(gate_up_N2F[:, :f], gate_up_N2F[:, f:], alpha, limit)
    y_ND = plus_low_rank("down", grouped(h_NF, w_down), h_NF) + b_down[expert_N]
    inverse_N = jnp.zeros_like(order_N).at[order_N].set(jnp.arange(order_N.shape[0]))
    return y_ND[inverse_N].reshape(num_tokens, top_k, -1)


class GptOssMLP(nnx.Module):
    """Router + experts: top-k of the router logits, softmax over those k as routing weights
    (in the logits' dtype), the experts' weighted outputs summed in x's dtype."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.top_k = config.num_experts_per_tok
        self.router = GptOssRouter(config, rngs)
        self.experts = GptOssExperts(config, rngs)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        b, t, d = x_BTD.shape
        x_MD = x_BTD.reshape(b * t, d)
        logits_ME = self.router(x_MD)
        record_router_stats(logits_ME, self.top_k)  # the load-balancing loss's statistics
        top_MK, experts_MK = jax.lax.top_k(logits_ME, self.top_k)
        weights_MK = jax.nn.softmax(top_MK.astype(jnp.float32), axis=-1).astype(logits_ME.dtype)
        y_MKD = self.experts(x_MD, experts_MK)
        out_MD = jnp.sum((y_MKD * weights_MK[..., None]).astype(x_BTD.dtype), axis=1)
        return out_MD.reshape(b, t, d)


class GptOssDecoderLayer(nnx.Module):
    """Pre-norm block: `h + attn(norm(h))`, then `h + mlp(norm(h))`."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, index: int = 0):
        d, eps = config.hidden_size, config.norm_eps
        self.input_layernorm = RMSNorm(d, eps, config)
        self.self_attn = GptOssAttention(config, rngs)
        self.post_attention_layernorm = RMSNorm(d, eps, config)
        self.mlp = GptOssMLP(config, rngs)

    def __call__(self, h_BTD, cos, sin, mask_B1TS, layer: LayerFlags) -> jax.Array:
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), cos, sin, mask_B1TS, layer)
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))

    def cached(
        self, h_BTD, cos, sin, layer: LayerFlags, cache: KVCache, view: CacheView
    ) -> tuple[jax.Array, KVCache]:
        attn_BTD, cache = self.self_attn.cached(
            self.input_layernorm(h_BTD), cos, sin, layer, cache, view
        )
        h_BTD = h_BTD + attn_BTD
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD)), cache


class GptOssModel(LlamaModel):
    """The GPT-OSS backbone (the Llama forward and cached forward over GPT-OSS blocks)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embed(
            config.vocab_size, config.hidden_size, "vocab", config, rngs, config.pad_token_id
        )
        self.layers = make_layers(lambda r, i: GptOssDecoderLayer(config, r, i), config, rngs)
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, config)


class GptOssForCausalLM(CausalLM):
    base_model_prefix = "model"
    backbone_cls = GptOssModel


__all__ = ["GptOssForCausalLM", "GptOssModel"]
