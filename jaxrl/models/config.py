"""Our model config: the HF config fields the JAX models need, plus compute options.

`ModelConfig` is frozen and hashable so it can live in an nnx graphdef (static under jit). It keeps
the source transformers config (`hf_config`) so `save_pretrained` can write it back unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from jaxrl.parallel import merge_rules

LLAMA_FAMILY = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "gemma", "gemma2", "gemma3_text",
    "smollm3", "olmo2", "olmo3", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss",
)  # fmt: skip
MOE_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss")
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
# Image-text checkpoints: model_type -> where the language model's weights live. Loaded alone
# (text-only training, the vision weights carried through unchanged on save) or with
# `vision=True` with their vision tower and projector (`jaxrl.models.vision`).
LANGUAGE_MODEL_PREFIX = {"gemma3": "model.language_model"}
SUPPORTED_MODEL_TYPES = (*LLAMA_FAMILY, "gpt2", *LANGUAGE_MODEL_PREFIX)
ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope")
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
ATTENTION_IMPLS = (None, "blockwise", "xla", "cudnn", "splash")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """An image-text checkpoint's vision side as jaxrl runs it (Gemma 3: a SigLIP encoder and
    the multimodal projector): `image_size` square images cut into `patch_size` patches, a
    `num_layers`-layer pre-LN encoder of width `hidden_size`, its final patch states pooled to
    `mm_tokens_per_image` tokens and projected to the language model's width; the tokens
    `image_token_id` of the text are replaced by them."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    mm_tokens_per_image: int
    image_token_id: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture (from the HF config) and compute options of a decoder-only LM."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    initializer_range: float
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    # YaRN (rope_type "yarn"): the ramp's rotation bounds, whether its range is rounded to whole
    # dimensions, and the factor cos/sin are multiplied by (transformers' `attention_factor`).
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float = 1.0
    # LongRoPE (Phi-3): per-frequency divisors, the short ones while every position of a call is
    # below `rope_original_max_position_embeddings`, the long ones otherwise (transformers picks
    # by the call's largest position id).
    rope_short_factor: tuple[float, ...] = ()
    rope_long_factor: tuple[float, ...] = ()
    # Rotary embedding on the first `rotary_dim` features of each head only (Phi-3's
    # partial_rotary_factor < 1); None: all of head_dim.
    rotary_dim: int | None = None
    # Phi-3: fused q/k/v (`qkv_proj`, rows q then k then v) and gate/up (`gate_up_proj`, gate
    # rows then up rows) projections, as in the checkpoint and PEFT's module tree.
    fused_projections: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # OLMo 2: q/k norms over all heads' projections at once (Qwen3, Gemma 3: per head).
    qk_norm_over_heads: bool = False
    # RMSNorm numerics: None is Llama's (x_hat rounded to x's dtype, times the weight in the
    # residual dtype); a float: x_hat * (norm_offset + weight) in f32, rounded once to x's dtype
    # (Gemma: 1.0, its weight starting at 0; OLMo 2: 0.0).
    norm_offset: float | None = None
    # Where a block's norms sit: "pre" (Llama: before attention and MLP), "sandwich" (Gemma 3:
    # before and after each), "post" (OLMo 2: after each, on the branch before the residual add).
    norm_placement: str = "pre"
    # Gemma switches: token embeddings are multiplied by `embed_multiplier` (sqrt(hidden_size))
    # in the parameter dtype; queries scaled by `query_pre_attn_scalar ** -0.5` instead of
    # `head_dim ** -0.5` (`query_pre_attn_scalar`); sliding layers rotate with their own base
    # `local_rope_theta` (default rope), full layers with `rope_theta` and its scaling.
    embed_multiplier: float | None = None
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    # Gemma 2 (and Gemma 3 configs that set them): tanh soft-capping `cap * tanh(x / cap)` of the
    # scaled attention scores before masking and softmax (`attn_logit_softcapping`), and of the
    # LM head's logits before temperature and softmax (`final_logit_softcapping`); None: off.
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Granite: attention scores scaled by `attention_multiplier` (instead of head_dim ** -0.5),
    # each block's attention and MLP outputs by `residual_multiplier` before the residual add,
    # logits divided by `logits_scaling` (folded into the unembedding, see `CausalLM`); its
    # `embedding_multiplier` is `embed_multiplier`.
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    sliding_window: int | None = None
    # One flag per layer: does that layer use `sliding_window`?
    sliding_layers: tuple[bool, ...] = ()
    # One flag per layer: does it apply rope (SmolLM3's `no_rope_layers`)? () = every layer.
    rope_layers: tuple[bool, ...] = ()
    # Mixture of experts (Qwen2/3-MoE, Mixtral, OLMoE): one flag per layer (() = none) for an
    # MoE block in place of the MLP; each token goes to its `num_experts_per_tok` best of
    # `num_experts` experts (routing weights renormalised with `norm_topk_prob`); Qwen2-MoE adds
    # a sigmoid-gated shared expert of `shared_expert_intermediate_size` (0 = none).
    # The embedding row HF's `nn.Embedding(padding_idx=config.pad_token_id)` never updates (the
    # checkpoint config's pad id, fixed when the model is built, as in transformers); None: GPT-2.
    pad_token_id: int | None = None
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    # Dropout rates (torch's inverted dropout), applied only in a policy's training forward
    # (`jaxrl.models.dropout`): on the attention probabilities (Llama family
    # `attention_dropout`, GPT-2 `attn_pdrop`), on each block's attention and MLP outputs before
    # the residual adds (GPT-2 and Phi-3 `resid_pdrop`), on the input embeddings (GPT-2
    # `embd_pdrop`).
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0
    embedding_dropout: float = 0.0
    # GPT-OSS (see `gpt_oss.py`): a learned per-head attention-sink logit joining each row's
    # softmax denominator (`attention_sinks`), and the experts' clamped SwiGLU
    # `(clip(up, +-limit) + 1) * g * sigmoid(alpha * g)`, g = min(gate, limit).
    attention_sinks: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Mixed precision follows torch autocast: `dtype` is the matmul dtype (Dense inputs and
    # outputs, attention, logits), `residual_dtype` that of the embeddings, the residual stream
    # and the norms. Under autocast (f32 params, bf16 matmuls) HF models keep the residual
    # stream in f32; residual_dtype == dtype gives all-bf16 activations instead.
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    residual_dtype: Any = jnp.float32
    scan_layers: bool = False
    remat_policy: str = "none"
    # TRL's `activation_offloading`: what `remat_policy` saves for the backward pass (each
    # layer's input included) lives in host memory (`pinned_host`) between the forward and the
    # backward (`layers.remat_wrap`); the numbers do not change.
    activation_offloading: bool = False
    # None: the best kernel for the backend (splash on TPU for padding/packing masks, cuDNN on
    # GPU where it applies, else "blockwise"); "blockwise", "xla" (reference, materialises
    # scores), "cudnn" (GPU, bf16/fp16) or "splash" (TPU; interpreted elsewhere) force one.
    attention_impl: str | None = None
    # Mesh and rules the params were placed with: activations are constrained to be
    # batch-sharded on it (so FSDP gathers weights rather than resharding activations).
    mesh: Any = None
    rules: tuple = ()
    hf_config: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
    # An image-text checkpoint's language model (Gemma 3's `Gemma3ForConditionalGeneration`):
    # its weights' key prefix ("model.language_model"; None for a plain causal LM), and the
    # checkpoint directory whose other weights (vision tower, projector) `save_pretrained` copies
    # through unchanged. `model_type` is the language model's (e.g. "gemma3_text"); `hf_config`
    # is the whole image-text config, written back as is.
    language_model_prefix: str | None = None
    # The vision tower and projector of an image-text checkpoint loaded to run on images
    # (`from_pretrained(..., vision=True)`); None: the language model alone.
    vision: VisionConfig | None = None
    passthrough_dir: str | None = dataclasses.field(
        default=None, compare=False, hash=False, repr=False
    )

    def __post_init__(self) -> None:
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"remat_policy={self.remat_policy!r} is not supported; use one of {REMAT_POLICIES}."
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"attention_impl={self.attention_impl!r} is not supported; use one of "
                f"{ATTENTION_IMPLS}."
            )
        if self.scan_layers and len(set(self.moe_layers)) > 1:
            raise ValueError(
                "scan_layers=True needs every layer to have the same block, but this config mixes "
                "MoE and dense-MLP layers (mlp_only_layers / decoder_sparse_step); load it with "
                "scan_layers=False."
            )
        for name in ("attention_dropout", "residual_dropout", "embedding_dropout"):
            rate = getattr(self, name)
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"{name}={rate} must be in [0, 1).")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} must be a multiple of "
                f"num_key_value_heads={self.num_kv_heads}."
            )

    @property
    def attention_scale(self) -> float | None:
        """What attention scores are multiplied by when not head_dim ** -0.5 (Gemma's
        query_pre_attn_scalar ** -0.5); None for the default."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        scalar = self.query_pre_attn_scalar
        return None if scalar in (None, self.head_dim) else scalar**-0.5

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


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


def _rope_fields(hf_config: Any) -> dict[str, Any]:
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
    if partial != 1.0 and hf_config.model_type != "phi3":
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


def _gemma_fields(c: Any) -> dict[str, Any]:
    """The Gemma switches (Gemma 1, Gemma 2, Gemma 3 text)."""
    if getattr(c, "use_bidirectional_attention", False):
        raise ValueError(
            "use_bidirectional_attention=True (EmbeddingGemma) is not supported: jaxrl's models "
            "are causal LMs."
        )
    fields: dict[str, Any] = {
        "norm_offset": 1.0,
        "embed_multiplier": float(c.hidden_size) ** 0.5,
        "hidden_act": getattr(c, "hidden_activation", None) or c.hidden_act,
    }
    if c.model_type == "gemma":
        if fields["hidden_act"] == "gelu":  # transformers maps Gemma's legacy "gelu" so too
            fields["hidden_act"] = "gelu_pytorch_tanh"
        return fields
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        cap = getattr(c, name, None)
        if cap is not None and not cap > 0:
            raise ValueError(f"{name}={cap} must be a positive number or null.")
    fields.update(
        norm_placement="sandwich",
        query_pre_attn_scalar=float(c.query_pre_attn_scalar),
        attn_logit_softcap=_optional_float(getattr(c, "attn_logit_softcapping", None)),
        final_logit_softcap=_optional_float(getattr(c, "final_logit_softcapping", None)),
    )
    if c.model_type == "gemma2":  # one rope for every layer, no q/k norms
        return fields
    return {**fields, "qk_norm": True, "local_rope_theta": _local_rope_theta(c)}


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


def _moe_fields(c: Any) -> dict[str, Any]:
    """The mixture-of-experts switches (see `jaxrl.models.moe`)."""
    from jaxrl.models.moe import moe_layer_flags

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
    mixtral, gpt_oss = c.model_type == "mixtral", c.model_type == "gpt_oss"
    experts = c.num_local_experts if mixtral or gpt_oss else c.num_experts
    fields: dict[str, Any] = {
        "moe_layers": moe_layer_flags(c, c.num_hidden_layers),
        "num_experts": experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        # Mixtral's and OLMoE's experts are `intermediate_size` wide; Qwen's have their own size
        # (`intermediate_size` is then their dense-MLP layers').
        "moe_intermediate_size": (
            c.moe_intermediate_size
            if c.model_type in ("qwen2_moe", "qwen3_moe")
            else c.intermediate_size
        ),
        # GPT-OSS: a softmax over the top-k logits, i.e. the renormalised top-k probabilities.
        "norm_topk_prob": True if mixtral or gpt_oss else bool(c.norm_topk_prob),
    }
    if c.num_experts_per_tok > experts:
        raise ValueError(
            f"num_experts_per_tok={c.num_experts_per_tok} exceeds the number of experts ({experts})."
        )
    if c.model_type == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size
        fields["qkv_bias"] = bool(c.qkv_bias)
    if c.model_type == "olmoe":
        fields.update(qk_norm=True, qk_norm_over_heads=True)
    if c.model_type == "qwen3_moe":
        fields["qk_norm"] = True
    if gpt_oss:
        from jaxrl.models.gpt_oss import gpt_oss_fields

        fields.update(gpt_oss_fields(c))
    return fields


def _padding_idx(c: Any) -> int | None:
    pad = getattr(c, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) and 0 <= pad < c.vocab_size else None


def _llama_family(c: Any) -> dict[str, Any]:
    model_type = c.model_type
    num_heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // num_heads
    window = getattr(c, "sliding_window", None)
    layer_types = getattr(c, "layer_types", None)
    if window is None or (model_type == "smollm3" and not c.use_sliding_window):
        # HF ignores layer_types' sliding layers without a window (SmolLM3: or without
        # use_sliding_window)
        sliding_layers = (False,) * c.num_hidden_layers
    elif model_type == "mistral" or not layer_types:
        sliding_layers = (True,) * c.num_hidden_layers
    else:
        sliding_layers = tuple(t == "sliding_attention" for t in layer_types)
    attention_bias = bool(getattr(c, "attention_bias", False))
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
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool(getattr(c, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        pad_token_id=_padding_idx(c),
        attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0),
        sliding_window=window if any(sliding_layers) else None,
        sliding_layers=sliding_layers,
        **_rope_fields(c),
    )
    if model_type in GEMMA_TYPES:
        fields.update(_gemma_fields(c))
    if model_type in ("olmo2", "olmo3"):
        fields.update(norm_offset=0.0, norm_placement="post", qk_norm=True, qk_norm_over_heads=True)
    if model_type == "olmo3" and any(sliding_layers):
        # Sliding layers rotate with their own default rope; a second table only when it
        # differs from the full layers' rope.
        local = _local_rope_theta(c)
        same = fields["rope_type"] == "default" and local == fields["rope_theta"]
        fields["local_rope_theta"] = None if same else local
    if model_type in MOE_TYPES:
        fields.update(_moe_fields(c))
    if model_type == "granite":
        fields.update(
            embed_multiplier=float(c.embedding_multiplier),
            attention_multiplier=float(c.attention_multiplier),
            residual_multiplier=float(c.residual_multiplier),
            logits_scaling=float(c.logits_scaling),
        )
    if model_type == "phi3":
        fields["fused_projections"] = True
        # transformers' Phi-3 drops both branch outputs with resid_pdrop; its embd_pdrop is read
        # by no module there, so it drops nothing here either.
        fields["residual_dropout"] = float(getattr(c, "resid_pdrop", 0.0) or 0.0)
    if model_type == "smollm3":
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
    fields["language_model_prefix"] = LANGUAGE_MODEL_PREFIX[c.model_type]
    return fields


def _vision_fields(c: Any) -> VisionConfig:
    """Gemma 3's vision side from its config (`vision_config`: SigLIP's), with clear errors for
    what jaxrl does not run."""
    v = c.vision_config
    if getattr(v, "model_type", None) != "siglip_vision_model":
        raise ValueError(
            f"{c.model_type}'s vision_config has model_type={getattr(v, 'model_type', None)!r}; "
            "jaxrl runs SigLIP vision towers ('siglip_vision_model') only."
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
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is not supported by jaxrl.models; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
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
        fields = _gpt2(hf_config) if model_type == "gpt2" else _llama_family(hf_config)
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
