"""GPT-2: learned positions, pre-LayerNorm blocks, fused qkv projection, gelu_new, tied head.

HF GPT-2 uses Conv1D layers whose weights are stored [in, out]; our `Dense` kernels keep that
order, so conversion in `hf.py` is a reshape (no transpose). Shares norms, attention and the
scanned/remat layer stack with the Llama family (`layers.py`).
"""

from __future__ import annotations

import math

import jax
from flax import nnx

from jaxrl.models import dropout as model_dropout
from jaxrl.models.causal_lm import CausalLM
from jaxrl.models.config import ModelConfig
from jaxrl.models.kv_cache import Cache, CacheView, KVCache, apply_layers_cached, cached_attention
from jaxrl.models.layers import (
    Dense,
    Embed,
    LayerFlags,
    LayerNorm,
    activation,
    apply_layers,
    dot_product_attention,
    make_layers,
    param_value,
)
from jaxrl.models.masks import attention_masks, default_positions


def residual_init_std(config: ModelConfig) -> float:
    """GPT-2 scales the init of residual output projections by 1/sqrt(2 * n_layer) (GPT-2 paper)."""
    return config.initializer_range / math.sqrt(2 * config.num_layers)


class GPT2Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, n, h = config.hidden_size, config.num_heads, config.head_dim
        self.config = config
        # One fused [D, 3, N, H] projection, as HF's c_attn (q, k, v concatenated on the output).
        self.c_attn = Dense(
            (d,), (3, n, h), ("embed",), ("qkv", "heads", "head_dim"), config, rngs, use_bias=True
        )
        self.c_proj = Dense(
            (n, h),
            (d,),
            ("heads", "head_dim"),
            ("embed",),
            config,
            rngs,
            use_bias=True,
            init_std=residual_init_std(config),
        )

    def __call__(self, x_BTD, mask_B1TS, layer: LayerFlags) -> jax.Array:
        qkv_BT3NH = self.c_attn(x_BTD)
        q_BTNH, k_BTNH, v_BTNH = (qkv_BT3NH[:, :, i] for i in range(3))
        out_BTNH = dot_product_attention(
            q_BTNH, k_BTNH, v_BTNH, mask_B1TS, layer.sliding, self.config
        )
        out_BTD = self.c_proj(out_BTNH)  # resid_dropout (training forwards only)
        return model_dropout.drop(out_BTD, model_dropout.RESID_ATTN, self.config.residual_dropout)

    def cached(
        self, x_BTD, layer: LayerFlags, cache: KVCache, view: CacheView
    ) -> tuple[jax.Array, KVCache]:
        """Attention over the KV cache (incremental decoding; see `kv_cache.py`)."""
        qkv_BT3NH = self.c_attn(x_BTD)
        q_BTNH, k_BTNH, v_BTNH = (qkv_BT3NH[:, :, i] for i in range(3))
        out_BTNH, cache = cached_attention(
            q_BTNH, k_BTNH, v_BTNH, cache, view, layer.sliding, self.config
        )
        return self.c_proj(out_BTNH), cache


class GPT2MLP(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.c_fc = Dense((d,), (f,), ("embed",), ("mlp",), config, rngs, use_bias=True)
        self.c_proj = Dense(
            (f,),
            (d,),
            ("mlp",),
            ("embed",),
            config,
            rngs,
            use_bias=True,
            init_std=residual_init_std(config),
        )
        self.act = activation(config.hidden_act)
        self.residual_dropout = config.residual_dropout

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        out_BTD = self.c_proj(self.act(self.c_fc(x_BTD)))  # then dropout (training forwards)
        return model_dropout.drop(out_BTD, model_dropout.RESID_MLP, self.residual_dropout)


class GPT2Block(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.ln_1 = LayerNorm(config.hidden_size, config.norm_eps, config)
        self.attn = GPT2Attention(config, rngs)
        self.ln_2 = LayerNorm(config.hidden_size, config.norm_eps, config)
        self.mlp = GPT2MLP(config, rngs)

    def __call__(self, h_BTD, mask_B1TS, layer: LayerFlags) -> jax.Array:
        h_BTD = h_BTD + self.attn(self.ln_1(h_BTD), mask_B1TS, layer)
        return h_BTD + self.mlp(self.ln_2(h_BTD))

    def cached(
        self, h_BTD, layer: LayerFlags, cache: KVCache, view: CacheView
    ) -> tuple[jax.Array, KVCache]:
        attn_BTD, cache = self.attn.cached(self.ln_1(h_BTD), layer, cache, view)
        h_BTD = h_BTD + attn_BTD
        return h_BTD + self.mlp(self.ln_2(h_BTD)), cache


class GPT2Model(nnx.Module):
    """GPT-2 backbone: token + position embeddings, blocks, final LayerNorm -> [B, T, D]."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        self.wte = Embed(config.vocab_size, config.hidden_size, "vocab", config, rngs)
        self.wpe = Embed(
            config.max_position_embeddings, config.hidden_size, "position", config, rngs
        )
        self.h = make_layers(lambda r, _: GPT2Block(config, r), config, rngs)
        self.ln_f = LayerNorm(config.hidden_size, config.norm_eps, config)

    def __call__(
        self,
        input_ids_BT: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        if positions is None:
            positions = default_positions(attention_mask, segment_ids, input_ids_BT.shape[1])
        h_BTD = self.wte(input_ids_BT) + self.wpe(positions)
        # embd_pdrop (training forwards only; the forward's key, before any layer's)
        h_BTD = model_dropout.drop(h_BTD, model_dropout.EMBEDDING, self.config.embedding_dropout)
        mask_B1TS = attention_masks(attention_mask, segment_ids)
        h_BTD = apply_layers(self.h, h_BTD, (mask_B1TS,), self.config)
        return self.ln_f(h_BTD)

    def cached(
        self, input_ids_BT: jax.Array, positions_BT: jax.Array, cache: Cache, view: CacheView
    ) -> tuple[jax.Array, Cache]:
        """Hidden states [B, T, D] of new tokens at `positions_BT`, reading and extending `cache`."""
        h_BTD = self.wte(input_ids_BT) + self.wpe(positions_BT)
        h_BTD, cache = apply_layers_cached(self.h, h_BTD, (), cache, view, self.config)
        return self.ln_f(h_BTD), cache

    def input_embedding(self) -> jax.Array:
        return param_value(self.wte.embedding)


class GPT2ForCausalLM(CausalLM):
    """GPT-2 causal LM (HF `GPT2LMHeadModel`): `model(input_ids, attention_mask) -> logits_BTV`."""

    base_model_prefix = "transformer"
    backbone_cls = GPT2Model
