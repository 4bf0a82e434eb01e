"""Llama-family decoder (Llama 1-3, Mistral, Qwen2/2.5, Qwen3, Phi-3, Granite, Gemma, Gemma 2,
Gemma 3 text, SmolLM3, OLMo 2/3, MoE families): one implementation, config switches.

Switches (from `ModelConfig`): `qkv_bias`/`o_bias` (Qwen2 has q/k/v biases), `qk_norm` (Qwen3's
and Gemma 3's per-head RMSNorm on q and k before rope), `sliding_window` + `sliding_layers`
(Mistral, Gemma 3), `tie_word_embeddings` (Qwen2.5 small models, Gemma), rope type default /
linear / llama3 / yarn / longrope (on the first `rotary_dim` features: Phi-4-mini);
`fused_projections` (Phi-3's `qkv_proj` and `gate_up_proj`); Granite's multipliers
(`attention_multiplier`, `residual_multiplier`, `logits_scaling`); `norm_offset` (Gemma's and OLMo
2's RMSNorm numerics) and `norm_placement` (Gemma 3's sandwich norms, OLMo 2's post-norms, with
its q/k norms over all heads); Gemma's `embed_multiplier`, `query_pre_attn_scalar`, Gemma 2's
soft-caps (`attn_logit_softcap` in the attention kernels, `final_logit_softcap` wherever logits
are formed) and Gemma 3's `local_rope_theta` (sliding layers rotate with their own base);
SmolLM3's NoPE layers (`rope_layers`); mixture-of-experts blocks in place of the MLP
(`moe_layers`: Qwen2/3-MoE, Mixtral, OLMoE; see `moe.py`).
Attribute names follow the HF module tree so checkpoint keys map one to one (see `hf.py`).
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxrl.models import dropout as model_dropout
from jaxrl.models import moe
from jaxrl.models.causal_lm import CausalLM
from jaxrl.models.config import ModelConfig
from jaxrl.models.kv_cache import Cache, CacheView, KVCache, apply_layers_cached, cached_attention
from jaxrl.models.layers import (
    Dense,
    Embed,
    LayerFlags,
    RMSNorm,
    activation,
    apply_layers,
    dot_product_attention,
    gated,
    make_layers,
    param_value,
)
from jaxrl.models.masks import attention_masks, default_positions, with_key_limit
from jaxrl.models.rope import rope_tables, rotate


class LlamaAttention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.config = config
        if config.fused_projections:
            # Phi-3: one [D, N + 2K, H] projection (q heads, then k, then v, as HF's rows). The
            # fused head axis is not split over `tensor` (a split would cut across q, k and v).
            self.qkv_proj = Dense(
                (d,), (n + 2 * k, h), ("embed",), ("qkv", "head_dim"), config, rngs,
                use_bias=config.qkv_bias,
            )  # fmt: skip
        else:
            self.q_proj = Dense(
                (d,), (n, h), ("embed",), ("heads", "head_dim"), config, rngs,
                use_bias=config.qkv_bias,
            )  # fmt: skip
            kv_axes = (("embed",), ("kv_heads", "head_dim"))
            self.k_proj = Dense((d,), (k, h), *kv_axes, config, rngs, use_bias=config.qkv_bias)
            self.v_proj = Dense((d,), (k, h), *kv_axes, config, rngs, use_bias=config.qkv_bias)
        self.o_proj = Dense(
            (n, h), (d,), ("heads", "head_dim"), ("embed",), config, rngs, use_bias=config.o_bias
        )
        if config.qk_norm_over_heads:  # OLMo 2: one norm over all heads' features
            self.q_norm = RMSNorm(n * h, config.norm_eps, config)
            self.k_norm = RMSNorm(k * h, config.norm_eps, config)
        elif config.qk_norm:
            self.q_norm = RMSNorm(h, config.norm_eps, config, axis_name="head_dim")
            self.k_norm = RMSNorm(h, config.norm_eps, config, axis_name="head_dim")
        else:
            self.q_norm = self.k_norm = None

    def _project(self, x_BTD) -> tuple[jax.Array, jax.Array, jax.Array]:
        if not self.config.fused_projections:
            return self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
        n, k = self.config.num_heads, self.config.num_kv_heads
        qkv_BTFH = self.qkv_proj(x_BTD)
        return qkv_BTFH[:, :, :n], qkv_BTFH[:, :, n : n + k], qkv_BTFH[:, :, n + k :]

    def _qkv(self, x_BTD, cos, sin, layer) -> tuple[jax.Array, jax.Array, jax.Array]:
        q_BTNH, k_BTKH, v_BTKH = self._project(x_BTD)
        if self.config.qk_norm_over_heads:
            q_BTNH = self.q_norm(q_BTNH.reshape(*q_BTNH.shape[:2], -1)).reshape(q_BTNH.shape)
            k_BTKH = self.k_norm(k_BTKH.reshape(*k_BTKH.shape[:2], -1)).reshape(k_BTKH.shape)
        elif self.q_norm is not None:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        q_BTNH, k_BTKH = rotate(q_BTNH, k_BTKH, cos, sin, layer)
        return q_BTNH, k_BTKH, v_BTKH

    def _sinks(self) -> jax.Array | None:
        """Per-head attention-sink logits (GPT-OSS overrides this); None: no sinks."""
        return None

    def __call__(self, x_BTD, cos, sin, mask_B1TS, layer: LayerFlags) -> jax.Array:
        q_BTNH, k_BTKH, v_BTKH = self._qkv(x_BTD, cos, sin, layer)
        out_BTNH = dot_product_attention(
            q_BTNH, k_BTKH, v_BTKH, mask_B1TS, layer.sliding, self.config, self._sinks()
        )
        return self.o_proj(out_BTNH)

    def cached(
        self, x_BTD, cos, sin, layer: LayerFlags, cache: KVCache, view: CacheView
    ) -> tuple[jax.Array, KVCache]:
        """Attention over the KV cache (incremental decoding; see `kv_cache.py`)."""
        q_BTNH, k_BTKH, v_BTKH = self._qkv(x_BTD, cos, sin, layer)
        out_BTNH, cache = cached_attention(
            q_BTNH, k_BTKH, v_BTKH, cache, view, layer.sliding, self.config, self._sinks()
        )
        return self.o_proj(out_BTNH), cache


class LlamaMLP(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, intermediate_size: int | None = None):
        d, bias = config.hidden_size, config.mlp_bias
        f = intermediate_size or config.intermediate_size
        self.fused = config.fused_projections
        if self.fused:  # Phi-3: one [D, 2, F] projection, gate rows then up rows as HF's
            self.gate_up_proj = Dense(
                (d,), (2, f), ("embed",), (None, "mlp"), config, rngs, use_bias=bias
            )
        else:
            self.gate_proj = Dense((d,), (f,), ("embed",), ("mlp",), config, rngs, use_bias=bias)
            self.up_proj = Dense((d,), (f,), ("embed",), ("mlp",), config, rngs, use_bias=bias)
        self.down_proj = Dense((f,), (d,), ("mlp",), ("embed",), config, rngs, use_bias=bias)
        self.act = activation(config.hidden_act)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        if self.fused:
            gate_up_BT2F = self.gate_up_proj(x_BTD)
            gate_BTF, up_BTF = gate_up_BT2F[..., 0, :], gate_up_BT2F[..., 1, :]
        else:
            gate_BTF, up_BTF = self.gate_proj(x_BTD), self.up_proj(x_BTD)
        return self.down_proj(gated(self.act, gate_BTF, up_BTF))


class LlamaDecoderLayer(nnx.Module):
    """A block with HF's norm names for `config.norm_placement`:
    - "pre" (Llama): `input_layernorm` before attention, `post_attention_layernorm` before the
      MLP;
    - "sandwich" (Gemma 3): also `post_attention_layernorm` on the attention output before the
      residual add, `pre_feedforward_layernorm` before the MLP, `post_feedforward_layernorm` on
      its output;
    - "post" (OLMo 2): only `post_attention_layernorm` and `post_feedforward_layernorm` on the
      branch outputs."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, index: int = 0):
        d, eps, placement = config.hidden_size, config.norm_eps, config.norm_placement
        if placement not in ("pre", "sandwich", "post"):
            raise ValueError(f"norm_placement={placement!r} is not one of pre, sandwich, post.")

        def norm(present: bool) -> RMSNorm | None:
            return RMSNorm(d, eps, config) if present else None

        self.placement = placement
        self.residual_multiplier = config.residual_multiplier
        self.residual_dropout = config.residual_dropout  # Phi-3's resid_pdrop
        self.input_layernorm = norm(placement != "post")
        self.self_attn = LlamaAttention(config, rngs)
        self.post_attention_layernorm = norm(True)
        self.pre_feedforward_layernorm = norm(placement == "sandwich")
        self.post_feedforward_layernorm = norm(placement != "pre")
        # The feed-forward block under HF's name: an MoE block on the MoE layers (Mixtral calls
        # it `block_sparse_moe`), else the gated MLP.
        self.ffn_name = "mlp"
        if config.moe_layers and config.moe_layers[index]:
            self.ffn_name = moe.moe_attribute(config)
            shared = config.shared_expert_intermediate_size
            setattr(
                self,
                self.ffn_name,
                moe.SparseMoeBlock(
                    config, rngs, LlamaMLP(config, rngs, shared) if shared else None
                ),
            )
        else:
            self.mlp = LlamaMLP(config, rngs)

    def _ffn(self, x_BTD) -> jax.Array:
        return getattr(self, self.ffn_name)(x_BTD)

    def _attention_input(self, h_BTD) -> jax.Array:
        return h_BTD if self.input_layernorm is None else self.input_layernorm(h_BTD)

    def _add_attention_and_mlp(self, h_BTD, attn_BTD) -> jax.Array:
        if self.placement == "pre":
            scale = self.residual_multiplier  # Granite's; 1 elsewhere
            if self.residual_dropout:  # Phi-3: resid_attn_dropout, resid_mlp_dropout
                rate, drop = self.residual_dropout, model_dropout.drop
                h_BTD = h_BTD + drop(attn_BTD, model_dropout.RESID_ATTN, rate) * scale
                ffn_BTD = self._ffn(self.post_attention_layernorm(h_BTD))
                return h_BTD + drop(ffn_BTD, model_dropout.RESID_MLP, rate) * scale
            if scale != 1.0:
                h_BTD = h_BTD + attn_BTD * scale
                return h_BTD + self._ffn(self.post_attention_layernorm(h_BTD)) * scale
            h_BTD = h_BTD + attn_BTD
            return h_BTD + self._ffn(self.post_attention_layernorm(h_BTD))
        h_BTD = h_BTD + self.post_attention_layernorm(attn_BTD)
        mlp_in = (
            h_BTD
            if self.pre_feedforward_layernorm is None
            else self.pre_feedforward_layernorm(h_BTD)
        )
        return h_BTD + self.post_feedforward_layernorm(self._ffn(mlp_in))

    def __call__(self, h_BTD, cos, sin, mask_B1TS, layer: LayerFlags) -> jax.Array:
        attn_BTD = self.self_attn(self._attention_input(h_BTD), cos, sin, mask_B1TS, layer)
        return self._add_attention_and_mlp(h_BTD, attn_BTD)

    def cached(
        self, h_BTD, cos, sin, layer: LayerFlags, cache: KVCache, view: CacheView
    ) -> tuple[jax.Array, KVCache]:
        attn_BTD, cache = self.self_attn.cached(
            self._attention_input(h_BTD), cos, sin, layer, cache, view
        )
        return self._add_attention_and_mlp(h_BTD, attn_BTD), cache


class LlamaModel(nnx.Module):
    """The decoder backbone: embeddings, layers, final norm. Returns hidden states [B, T, D]."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embed(
            config.vocab_size, config.hidden_size, "vocab", config, rngs, config.pad_token_id
        )
        self.layers = make_layers(lambda r, i: LlamaDecoderLayer(config, r, i), config, rngs)
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, config)

    def __call__(
        self,
        input_ids_BT: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        inputs_embeds: jax.Array | None = None,
        key_limit_BT: jax.Array | None = None,
    ) -> jax.Array:
        """`inputs_embeds` [B, T, D] replace the token embeddings of `input_ids_BT` (Gemma 3's
        image features merged in); `key_limit_BT` widens causality (see `AttentionMask`)."""
        seq_len = input_ids_BT.shape[1]
        if positions is None:
            positions = default_positions(attention_mask, segment_ids, seq_len)
        cos, sin = rope_tables(positions, self.config)
        mask_B1TS = with_key_limit(attention_masks(attention_mask, segment_ids), key_limit_BT)
        h_BTD = self.embed_tokens(input_ids_BT) if inputs_embeds is None else inputs_embeds
        h_BTD = apply_layers(self.layers, h_BTD, (cos, sin, mask_B1TS), self.config)
        return self.norm(h_BTD)

    def cached(
        self,
        input_ids_BT: jax.Array,
        positions_BT: jax.Array,
        cache: Cache,
        view: CacheView,
        inputs_embeds: jax.Array | None = None,
    ) -> tuple[jax.Array, Cache]:
        """Hidden states [B, T, D] of new tokens at `positions_BT`, reading and extending `cache`
        (`inputs_embeds` as in `__call__`: a Gemma 3 prefill with image features merged in)."""
        cos, sin = rope_tables(positions_BT, self.config)
        h_BTD = self.embed_tokens(input_ids_BT) if inputs_embeds is None else inputs_embeds
        h_BTD, cache = apply_layers_cached(self.layers, h_BTD, (cos, sin), cache, view, self.config)
        return self.norm(h_BTD), cache

    def input_embedding(self) -> jax.Array:
        return param_value(self.embed_tokens.embedding)


class LlamaForCausalLM(CausalLM):
    """Llama/Mistral/Qwen2/Qwen3/Gemma causal LM: `model(input_ids, attention_mask) -> logits_BTV`."""

    base_model_prefix = "model"
    backbone_cls = LlamaModel
