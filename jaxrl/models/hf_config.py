"""A transformers config -> our `ModelConfig`: the per-family field logic (read off the family
table, `jaxrl.models.families`) and clear errors for what jaxrl does not run.

Reads configs only; builds no model and imports no model family's module.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from jaxrl.models.config import ModelConfig, VisionConfig
from jaxrl.models.families import (
    LANGUAGE_MODEL_PREFIX,
    LLAMA_FAMILY,
    Family,
    MoeTraits,
    family,
)
from jaxrl.parallel import merge_rules

ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope")


def _yarn_fields(params: dict[str, Any], top: dict[str, Any], hf_config: Any) -> dict[str, Any]:
    """transformers' `_compute_yarn_parameters` inputs, with its defaults: `factor` None means
    max_position_embeddings / original_max_position_embeddings; `attention_factor` None is
    derived from `factor` (and `mscale` / `mscale_all_dim` when both are set); `truncate` is
    read from the top-level rope dict, as transformers reads it."""
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        factor = hf_config.max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    return {
        "rope_factor": float(factor),
        "rope_original_max_position_embeddings": original,
        "rope_beta_fast": float(params.get("beta_fast") or 32),
        "rope_beta_slow": float(params.get("beta_slow") or 1),
        "rope_truncate": bool(top.get("truncate", True)),
        "rope_attention_factor": float(attention_factor),
    }


def _longrope_fields(params: dict[str, Any], hf_config: Any) -> dict[str, Any]:
    """transformers' `_compute_longrope_parameters` inputs, with its defaults: `factor` None
    means max_position_embeddings / original_max_position_embeddings; `attention_factor` None is
    sqrt(1 + log(factor) / log(original)) (1 when factor <= 1)."""
    original = params.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None
    )
    if original is None:
        raise ValueError("rope_type='longrope' needs original_max_position_embeddings.")
    original = int(original)
    factor = params.get("factor") or hf_config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return {
        "rope_short_factor": tuple(float(x) for x in params["short_factor"]),
        "rope_long_factor": tuple(float(x) for x in params["long_factor"]),
        "rope_original_max_position_embeddings": original,
        "rope_attention_factor": float(attention_factor),
    }


def _rope_fields(hf_config: Any, fam: Family) -> dict[str, Any]:
    top = params = getattr(hf_config, "rope_parameters", None) or {}
    if "full_attention" in params:  # per-layer-type rope dicts (Gemma 3, OLMo 3)
        params = params["full_attention"]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} in config.rope_parameters is not supported; jaxrl supports "
            f"{ROPE_TYPES}."
        )
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0 and not fam.partial_rotary:
        raise ValueError(
            f"partial_rotary_factor={partial} in config.rope_parameters is supported for phi3 "
            f"only ({hf_config.model_type}'s transformers implementation rotates all features)."
        )
    fields: dict[str, Any] = {
        "rope_theta": float(params.get("rope_theta", 10000.0)),
        "rope_type": rope_type,
    }
    if partial != 1.0:
        head_dim = (
            getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads
        )
        fields["rotary_dim"] = int(head_dim * partial)
    if rope_type == "longrope":
        fields.update(_longrope_fields(params, hf_config))
    if rope_type == "yarn":
        fields.update(_yarn_fields(params, top, hf_config))
    if rope_type in ("llama3", "linear"):
        fields["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        fields["rope_low_freq_factor"] = float(params["low_freq_factor"])
        fields["rope_high_freq_factor"] = float(params["high_freq_factor"])
        fields["rope_original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings", hf_config.max_position_embeddings)
        )
    return fields


def _gemma_fields(c: Any, gemma: int) -> dict[str, Any]:
    """The Gemma switches of Gemma `gemma` (1, 2, 3 text) beyond the family table's (norms, q/k
    norms, local rope)."""
    if getattr(c, "use_bidirectional_attention", False):
        raise ValueError(
            "use_bidirectional_attention=True (EmbeddingGemma) is not supported: jaxrl's models "
            "are causal LMs."
        )
    fields: dict[str, Any] = {
        "embed_multiplier": float(c.hidden_size) ** 0.5,
        "hidden_act": getattr(c, "hidden_activation", None) or c.hidden_act,
    }
    if gemma == 1:
        if fields["hidden_act"] == "gelu":  # transformers maps Gemma's legacy "gelu" so too
            fields["hidden_act"] = "gelu_pytorch_tanh"
        return fields
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        cap = getattr(c, name, None)
        if cap is not None and not cap > 0:
            raise ValueError(f"{name}={cap} must be a positive number or null.")
    fields.update(
        query_pre_attn_scalar=float(c.query_pre_attn_scalar),
        attn_logit_softcap=_optional_float(getattr(c, "attn_logit_softcapping", None)),
        final_logit_softcap=_optional_float(getattr(c, "final_logit_softcapping", None)),
    )
    return fields


def _optional_float(x: Any) -> float | None:
    return None if x is None else float(x)


def _local_rope_theta(c: Any) -> float:
    """The rope base of the sliding layers when the config has per-layer-type rope dicts
    (Gemma 3, OLMo 3); they must use the default rope."""
    local = (getattr(c, "rope_parameters", None) or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(
            f"rope_type={local['rope_type']!r} for sliding_attention layers in "
            f"config.rope_parameters is not supported for {c.model_type}; jaxrl rotates sliding "
            "layers with the default rope."
        )
    return float(local.get("rope_theta", 10000.0))


def moe_layer_flags(hf_config: Any, num_layers: int, moe: MoeTraits) -> tuple[bool, ...]:
    """Which layers have an MoE block: all for Mixtral, OLMoE and GPT-OSS; Qwen-MoE's rule
    (`mlp_only_layers`, `decoder_sparse_step`)."""
    if moe.every_layer:
        return (True,) * num_layers
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    experts = hf_config.num_experts
    return tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def _moe_fields(c: Any, moe: MoeTraits) -> dict[str, Any]:
    """The mixture-of-experts switches (see `jaxrl.models.moe`)."""
    if getattr(c, "router_jitter_noise", None):
        raise ValueError(
            f"router_jitter_noise={c.router_jitter_noise} is not supported: jaxrl's MoE router "
            "has no multiplicative input noise; set it to 0.0 in config.json."
        )
    if getattr(c, "clip_qkv", None) is not None:
        raise ValueError(
            f"clip_qkv={c.clip_qkv} (OLMoE) is not supported: jaxrl does not clamp q/k/v; set it "
            "to null in config.json."
        )
    experts = getattr(c, moe.num_experts_field)
    fields: dict[str, Any] = {
        "moe_layers": moe_layer_flags(c, c.num_hidden_layers, moe),
        "num_experts": experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        # Mixtral's and OLMoE's experts are `intermediate_size` wide; Qwen's have their own size
        # (`intermediate_size` is then their dense-MLP layers').
        "moe_intermediate_size": getattr(c, moe.expert_width_field),
        # GPT-OSS: a softmax over the top-k logits, i.e. the renormalised top-k probabilities.
        "norm_topk_prob": (
            moe.norm_topk_prob if moe.norm_topk_prob is not None else bool(c.norm_topk_prob)
        ),
    }
    if c.num_experts_per_tok > experts:
        raise ValueError(
            f"num_experts_per_tok={c.num_experts_per_tok} exceeds the number of experts ({experts})."
        )
    if moe.shared_expert:
        fields["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size
    return fields


def _gpt_oss_fields(c: Any) -> dict[str, Any]:
    """`ModelConfig` fields of a `GptOssConfig` beyond the Llama/MoE ones and the family table's
    (attention sinks, norm numerics)."""
    quant = getattr(c, "quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
        if str(method) != "mxfp4":
            raise ValueError(
                f"quantization_config.quant_method={method!r} is not supported for gpt_oss; jaxrl "
                "reads bf16/f32 checkpoints and the released MXFP4 ones (dequantized on load)."
            )
    return {
        "swiglu_alpha": float(c.swiglu_alpha),
        "swiglu_limit": float(c.swiglu_limit),
    }


def _bias(c: Any, switch: bool | str) -> bool:
    """A bias switch of the family table: fixed, or read from the config field it names."""
    return switch if isinstance(switch, bool) else bool(getattr(c, switch, False))


def _padding_idx(c: Any) -> int | None:
    pad = getattr(c, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) and 0 <= pad < c.vocab_size else None


def _llama_family(c: Any) -> dict[str, Any]:
    model_type = c.model_type
    fam = family(model_type)
    num_heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // num_heads
    window = getattr(c, "sliding_window", None)
    layer_types = getattr(c, "layer_types", None)
    if window is None or (fam.sliding == "use_sliding_window" and not c.use_sliding_window):
        # HF ignores layer_types' sliding layers without a window (SmolLM3: or without
        # use_sliding_window)
        sliding_layers = (False,) * c.num_hidden_layers
    elif fam.sliding == "every_layer" or not layer_types:
        sliding_layers = (True,) * c.num_hidden_layers
    else:
        sliding_layers = tuple(t == "sliding_attention" for t in layer_types)
    fields = dict(
        model_type=model_type,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        norm_eps=c.rms_norm_eps,
        hidden_act=getattr(c, "hidden_act", None),
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        initializer_range=c.initializer_range,
        # Qwen2 always has q/k/v biases and no o bias; Llama/Qwen3 `attention_bias` covers all four.
        qkv_bias=_bias(c, fam.qkv_bias),
        o_bias=_bias(c, fam.o_bias),
        mlp_bias=bool(getattr(c, "mlp_bias", False)),
        qk_norm=fam.qk_norm is not None,
        qk_norm_over_heads=fam.qk_norm == "over_heads",
        norm_offset=fam.norm_offset,
        norm_placement=fam.norm_placement,
        fused_projections=fam.fused_projections,
        attention_sinks=fam.attention_sinks,
        pad_token_id=_padding_idx(c),
        attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0),
        sliding_window=window if any(sliding_layers) else None,
        sliding_layers=sliding_layers,
        **_rope_fields(c, fam),
    )
    if fam.gemma:
        fields.update(_gemma_fields(c, fam.gemma))
    if fam.local_rope == "always":
        fields["local_rope_theta"] = _local_rope_theta(c)
    if fam.local_rope == "if_distinct" and any(sliding_layers):
        # Sliding layers rotate with their own default rope; a second table only when it
        # differs from the full layers' rope.
        local = _local_rope_theta(c)
        same = fields["rope_type"] == "default" and local == fields["rope_theta"]
        fields["local_rope_theta"] = None if same else local
    if fam.moe is not None:
        fields.update(_moe_fields(c, fam.moe))
    if fam.decoder == "gpt_oss":
        fields.update(_gpt_oss_fields(c))
    if fam.granite_multipliers:
        fields.update(
            embed_multiplier=float(c.embedding_multiplier),
            attention_multiplier=float(c.attention_multiplier),
            residual_multiplier=float(c.residual_multiplier),
            logits_scaling=float(c.logits_scaling),
        )
    if fam.residual_dropout_field is not None:
        # transformers' Phi-3 drops both branch outputs with resid_pdrop; its embd_pdrop is read
        # by no module there, so it drops nothing here either.
        fields["residual_dropout"] = float(getattr(c, fam.residual_dropout_field, 0.0) or 0.0)
    if fam.nope_layers:
        rope_layers = tuple(bool(x) for x in c.no_rope_layers)
        fields["rope_layers"] = () if all(rope_layers) else rope_layers
    return fields


def _language_model_fields(c: Any) -> dict[str, Any]:
    """The fields of an image-text config's language model (trained on text; the vision tower
    is not run). transformers ties the LM head to the embeddings by the outer config's
    `tie_word_embeddings`."""
    text = c.get_text_config()
    if text.model_type not in LLAMA_FAMILY:
        raise ValueError(
            f"{c.model_type}'s language model has model_type={text.model_type!r}, which jaxrl "
            "does not support."
        )
    fields = _llama_family(text)
    fields["tie_word_embeddings"] = bool(getattr(c, "tie_word_embeddings", True))
    fields["language_model_prefix"] = family(c.model_type).language_model_prefix
    return fields


def _vision_fields(c: Any) -> VisionConfig:
    """Gemma 3's vision side from its config (`vision_config`: SigLIP's), with clear errors for
    what jaxrl does not run."""
    v = c.vision_config
    tower = family(c.model_type).vision_model_type
    if getattr(v, "model_type", None) != tower:
        raise ValueError(
            f"{c.model_type}'s vision_config has model_type={getattr(v, 'model_type', None)!r}; "
            f"jaxrl runs SigLIP vision towers ({tower!r}) only."
        )
    sizes = {
        name: getattr(v, name) if isinstance(getattr(v, name), int) else tuple(getattr(v, name))
        for name in ("image_size", "patch_size")
    }
    for name, size in sizes.items():
        if not isinstance(size, int):
            if len(set(size)) != 1:
                raise ValueError(
                    f"vision_config.{name}={list(size)} is not square; jaxrl supports square "
                    "images and patches only."
                )
            sizes[name] = int(size[0])
    if getattr(v, "attention_dropout", 0.0):
        raise ValueError(
            f"vision_config.attention_dropout={v.attention_dropout} is not supported: jaxrl's "
            "vision tower applies no dropout; set it to 0.0 in config.json."
        )
    config = VisionConfig(
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_layers=v.num_hidden_layers,
        num_heads=v.num_attention_heads,
        num_channels=v.num_channels,
        image_size=sizes["image_size"],
        patch_size=sizes["patch_size"],
        layer_norm_eps=float(v.layer_norm_eps),
        hidden_act=v.hidden_act,
        mm_tokens_per_image=int(c.mm_tokens_per_image),
        image_token_id=int(c.image_token_id),
    )
    side, tokens = config.patches_per_side, config.tokens_per_side
    if tokens * tokens != config.mm_tokens_per_image or side % tokens:
        raise ValueError(
            f"mm_tokens_per_image={config.mm_tokens_per_image} must be a square number whose side "
            f"divides the {side} x {side} patch grid (image_size / patch_size), as Gemma 3's "
            "average pooling needs."
        )
    if v.hidden_size % v.num_attention_heads:
        raise ValueError(
            f"vision_config.hidden_size={v.hidden_size} is not a multiple of "
            f"num_attention_heads={v.num_attention_heads}."
        )
    return config


def _gpt2(c: Any) -> dict[str, Any]:
    if getattr(c, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError(
            "GPT-2 configs with scale_attn_by_inverse_layer_idx=True are not supported."
        )
    if not getattr(c, "scale_attn_weights", True):
        raise ValueError("GPT-2 configs with scale_attn_weights=False are not supported.")
    return dict(
        model_type="gpt2",
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        intermediate_size=c.n_inner or 4 * c.n_embd,
        num_layers=c.n_layer,
        num_heads=c.n_head,
        num_kv_heads=c.n_head,
        head_dim=c.n_embd // c.n_head,
        norm_eps=c.layer_norm_epsilon,
        hidden_act=c.activation_function,
        max_position_embeddings=c.n_positions,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        initializer_range=c.initializer_range,
        sliding_layers=(False,) * c.n_layer,
        attention_dropout=float(c.attn_pdrop or 0.0),
        residual_dropout=float(c.resid_pdrop or 0.0),
        embedding_dropout=float(c.embd_pdrop or 0.0),
    )


def config_from_hf(
    hf_config: Any,
    *,
    dtype: Any = None,
    param_dtype: Any = None,
    residual_dtype: Any = None,
    scan_layers: bool = False,
    remat_policy: str = "none",
    attention_impl: str | None = None,
    mesh: Any = None,
    rules: Any = None,
    vision: bool = False,
    activation_offloading: bool = False,
) -> ModelConfig:
    """Our `ModelConfig` from a transformers config; clear error for unsupported families.

    `vision=True` (image-text checkpoints only): the vision tower and projector are part of the
    model, which then takes images (`ModelConfig.vision`).

    `dtype` (default: `param_dtype`) is the matmul dtype. `residual_dtype` defaults to the wider
    of `param_dtype` and `dtype`, torch autocast's semantics: f32 params with bf16 matmuls keep
    the residual stream, norms and embeddings in f32; bf16 params run everything in bf16. Pass
    `residual_dtype=dtype` for all-bf16 activations over f32 params (less activation memory,
    not what PyTorch/TRL compute)."""
    model_type = getattr(hf_config, "model_type", None)
    fam = family(model_type)  # a clear error for an unsupported family
    if vision and model_type not in LANGUAGE_MODEL_PREFIX:
        raise ValueError(
            f"vision=True needs an image-text checkpoint ({', '.join(LANGUAGE_MODEL_PREFIX)}); "
            f"model_type={model_type!r} takes text only."
        )
    if model_type in LANGUAGE_MODEL_PREFIX:
        fields = _language_model_fields(hf_config)
        if vision:
            fields["vision"] = _vision_fields(hf_config)
    else:
        fields = _gpt2(hf_config) if fam.decoder == "gpt2" else _llama_family(hf_config)
    param_dtype = jnp.dtype(param_dtype or jnp.float32)
    dtype = jnp.dtype(dtype or param_dtype)
    return ModelConfig(
        **fields,
        dtype=dtype,
        param_dtype=param_dtype,
        residual_dtype=jnp.dtype(residual_dtype or jnp.promote_types(param_dtype, dtype)),
        scan_layers=scan_layers,
        remat_policy=remat_policy,
        activation_offloading=activation_offloading,
        attention_impl=attention_impl,
        mesh=mesh,
        rules=tuple(merge_rules(rules)),
        hf_config=hf_config,
    )
