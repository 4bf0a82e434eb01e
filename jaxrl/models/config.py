"""Our model config: the HF config fields the JAX models need, plus compute options.

`ModelConfig` is frozen and hashable so it can live in an nnx graphdef (static under jit). It keeps
the source transformers config (`hf_config`) so `save_pretrained` can write it back unchanged.

This module holds the dataclasses and their checks only: translating a transformers config is
`jaxrl.models.hf_config`'s job, and what differs per family is `jaxrl.models.families`' table;
nothing here imports a model family.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

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
