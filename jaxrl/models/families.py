"""The one table of what differs per model family: HF `model_type` -> a frozen `Family` record.

Every place that used to test `model_type` reads a trait here instead: `hf_config` (a
transformers config -> `ModelConfig`), `heads` (which backbone to build), `moe` (expert names,
routing-weight dtype), `presets` (FLOPs of the MLP) and `jaxrl.generation` (the learned-position
limit), `hf` and `hf_keys` (checkpoint key prefix, GPT-2's Conv1D layout, the HF class names
a saved model declares) and `jaxrl.lora` (the layer stack's name, PEFT's default targets and
its MoE rewrite under transformers v5). A new family is one entry below plus, if it needs one, a
switch of `ModelConfig`.

Plain data only: this module imports nothing from jaxrl and computes nothing from a config.
"""

from __future__ import annotations

import dataclasses

# Expert parameter names (gate, up, down) as most MoE checkpoints spell them.
DEFAULT_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class MoeTraits:
    """How a mixture-of-experts family reads its HF config and names its checkpoint keys
    (see `jaxrl.models.moe`)."""

    # The HF config field with the number of experts (Mixtral, GPT-OSS: `num_local_experts`).
    num_experts_field: str = "num_experts"
    # The HF config field with each expert's width: Qwen-MoE's own `moe_intermediate_size` (its
    # `intermediate_size` is then the dense-MLP layers'); Mixtral's, OLMoE's `intermediate_size`.
    expert_width_field: str = "moe_intermediate_size"
    # Routing weights renormalised over the top k: True always (Mixtral; GPT-OSS's softmax over
    # the top-k logits); None: the config's `norm_topk_prob`.
    norm_topk_prob: bool | None = None
    # An MoE block in every layer; False: Qwen-MoE's rule (`mlp_only_layers`,
    # `decoder_sparse_step`).
    every_layer: bool = False
    # Qwen2-MoE's sigmoid-gated shared expert (`shared_expert_intermediate_size`).
    shared_expert: bool = False
    # Expert parameter names (gate, up, down) and the decoder layer's attribute holding the block.
    expert_names: tuple[str, str, str] = DEFAULT_EXPERT_NAMES
    attribute: str = "mlp"
    # Mixtral keeps the routing weights in f32; Qwen-MoE and OLMoE cast them to the logits'.
    f32_routing_weights: bool = False
    # GPT-OSS's router is a linear layer with a bias (`jaxrl.lora` refuses LoRA on it).
    router_bias: bool = False
    # PEFT 0.21's rewrite of router / expert `target_modules` into `target_parameters` under
    # transformers v5: the conversion pattern the family is a key of in PEFT's copy of
    # `_MODEL_TO_CONVERSION_PATTERN` ("qwen2_moe", "mixtral"); None: targets stay as given (see
    # `jaxrl.lora.targets.peft_v5_config`).
    peft_v5_conversion: str | None = None


@dataclasses.dataclass(frozen=True)
class Family:
    """What one `model_type` does differently from a plain Llama. Defaults are Llama's."""

    # The implementation: "llama" (`llama.py`, every decoder with config switches), "gpt2",
    # "gpt_oss" (Llama plus attention sinks and its own experts).
    decoder: str = "llama"
    # transformers' classes a saved checkpoint declares in `architectures` (causal LM, sequence
    # classification; None: transformers has none, so jaxrl refuses that task).
    hf_causal_arch: str | None = None
    hf_seq_cls_arch: str | None = None
    # HF `base_model_prefix` (checkpoint keys of the backbone) and the name of the decoder-layer
    # stack under it (GPT-2: `transformer.h`).
    base_prefix: str = "model"
    layer_stack_name: str = "layers"
    # Linear layers stored as GPT-2's `Conv1D` ([in, out], not `nn.Linear`'s [out, in]; PEFT's
    # `fan_in_fan_out`).
    conv1d_modules: tuple[str, ...] = ()
    # PEFT's default LoRA `target_modules` when none are given
    # (peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING); None: none.
    default_lora_targets: tuple[str, ...] | None = None
    # A gated MLP (gate, up, down: three matmuls); GPT-2's has two.
    gated_mlp: bool = True
    # Learned position embeddings (GPT-2): sequences end at `max_position_embeddings`.
    learned_positions: bool = False
    # Attention biases: a bool (always / never), or the HF config field that says (Llama's
    # `attention_bias` covers all four; Qwen2 always has q/k/v biases and no o bias).
    qkv_bias: bool | str = "attention_bias"
    o_bias: bool | str = "attention_bias"
    # RMSNorm on q and k before rope: "per_head" (Qwen3, Gemma 3) or "over_heads" (OLMo 2/3,
    # OLMoE: one norm over all heads' projections); None: none.
    qk_norm: str | None = None
    # RMSNorm numerics (`ModelConfig.norm_offset`: Gemma 1.0, OLMo 2 / GPT-OSS 0.0) and where a
    # block's norms sit (`ModelConfig.norm_placement`).
    norm_offset: float | None = None
    norm_placement: str = "pre"
    # Which layers use `sliding_window` (when the config sets one): "layer_types" (its
    # `layer_types`, every layer without them), "every_layer" (Mistral), "use_sliding_window"
    # (SmolLM3: as "layer_types", but only when `use_sliding_window` is set).
    sliding: str = "layer_types"
    # Sliding layers' own default rope (`local_rope_theta`): "always" (Gemma 3), "if_distinct"
    # (OLMo 3: only when some layer slides and it differs from the full layers' rope).
    local_rope: str | None = None
    # `partial_rotary_factor` < 1 allowed (Phi-3: rope on the first features of each head).
    partial_rotary: bool = False
    # Per-layer NoPE flags (SmolLM3's `no_rope_layers`).
    nope_layers: bool = False
    # Phi-3: fused `qkv_proj` / `gate_up_proj`, and `resid_pdrop` on both branch outputs.
    fused_projections: bool = False
    residual_dropout_field: str | None = None
    # Gemma generation (0: not Gemma): 1 scales embeddings by sqrt(hidden_size) and reads
    # `hidden_activation` (a legacy "gelu" is the tanh one); 2 and 3 add `query_pre_attn_scalar`
    # and the attention / final-logit soft-caps.
    gemma: int = 0
    # Granite's embedding, attention, residual and logits multipliers.
    granite_multipliers: bool = False
    # GPT-OSS's learned per-head attention-sink logits and clamped-SwiGLU experts.
    attention_sinks: bool = False
    moe: MoeTraits | None = None
    # Image-text checkpoints: where the language model's weights live (loaded alone, or with
    # `vision=True` with their vision tower), and the vision tower's model_type jaxrl runs.
    language_model_prefix: str | None = None
    vision_model_type: str | None = None


_QWEN_MOE = MoeTraits()
# PEFT's default LoRA targets of the Llama family. Its table also lists mixtral, but under
# transformers v5 its MoE conversion replaces the missing target_modules with none
# (`jaxrl.lora.targets.peft_v5_config`).
_QV = ("q_proj", "v_proj")


def _arch(name: str, seq_cls: str | None = "{}ForSequenceClassification") -> dict[str, str | None]:
    """`hf_causal_arch` / `hf_seq_cls_arch` of a family whose classes are `{name}ForCausalLM`
    and `seq_cls` (`{}` for `name`; None: no sequence-classification class)."""
    return {
        "hf_causal_arch": f"{name}ForCausalLM",
        "hf_seq_cls_arch": None if seq_cls is None else seq_cls.format(name),
    }


_OLMO2 = Family(norm_offset=0.0, norm_placement="post", qk_norm="over_heads")

# In `SUPPORTED_MODEL_TYPES` order: the Llama family, GPT-2, then image-text checkpoints.
FAMILIES: dict[str, Family] = {
    "llama": Family(**_arch("Llama"), default_lora_targets=_QV),
    "mistral": Family(**_arch("Mistral"), sliding="every_layer", default_lora_targets=_QV),
    "qwen2": Family(**_arch("Qwen2"), qkv_bias=True, o_bias=False, default_lora_targets=_QV),
    "qwen3": Family(**_arch("Qwen3"), qk_norm="per_head", default_lora_targets=_QV),
    "phi3": Family(
        **_arch("Phi3"),
        partial_rotary=True,
        fused_projections=True,
        residual_dropout_field="resid_pdrop",
    ),
    "granite": Family(**_arch("Granite", None), granite_multipliers=True),
    "gemma": Family(**_arch("Gemma"), gemma=1, norm_offset=1.0, default_lora_targets=_QV),
    "gemma2": Family(
        **_arch("Gemma2"),
        gemma=2,
        norm_offset=1.0,
        norm_placement="sandwich",
        default_lora_targets=_QV,
    ),
    "gemma3_text": Family(
        **_arch("Gemma3", "Gemma3TextForSequenceClassification"),
        gemma=3,
        norm_offset=1.0,
        norm_placement="sandwich",
        qk_norm="per_head",
        local_rope="always",
        default_lora_targets=_QV,
    ),
    "smollm3": Family(**_arch("SmolLM3"), sliding="use_sliding_window", nope_layers=True),
    "olmo2": dataclasses.replace(_OLMO2, **_arch("Olmo2")),
    "olmo3": dataclasses.replace(_OLMO2, **_arch("Olmo3"), local_rope="if_distinct"),
    "qwen2_moe": Family(
        **_arch("Qwen2Moe"),
        qkv_bias="qkv_bias",
        moe=dataclasses.replace(_QWEN_MOE, shared_expert=True),
    ),
    "qwen3_moe": Family(
        **_arch("Qwen3Moe"),
        qk_norm="per_head",
        moe=dataclasses.replace(_QWEN_MOE, peft_v5_conversion="qwen2_moe"),
    ),
    "mixtral": Family(
        **_arch("Mixtral"),
        moe=MoeTraits(
            num_experts_field="num_local_experts",
            expert_width_field="intermediate_size",
            norm_topk_prob=True,
            every_layer=True,
            expert_names=("w1", "w3", "w2"),
            attribute="block_sparse_moe",
            f32_routing_weights=True,
            peft_v5_conversion="mixtral",
        ),
    ),
    "olmoe": Family(
        **_arch("Olmoe", None),
        qk_norm="over_heads",
        moe=MoeTraits(
            expert_width_field="intermediate_size",
            every_layer=True,
            peft_v5_conversion="qwen2_moe",
        ),
    ),
    "gpt_oss": Family(
        **_arch("GptOss"),
        decoder="gpt_oss",
        norm_offset=0.0,  # GptOssRMSNorm: weight * x_hat in f32, rounded once
        attention_sinks=True,
        moe=MoeTraits(
            num_experts_field="num_local_experts",
            expert_width_field="intermediate_size",
            norm_topk_prob=True,
            every_layer=True,
            router_bias=True,
        ),
    ),
    "gpt2": Family(
        hf_causal_arch="GPT2LMHeadModel",
        hf_seq_cls_arch="GPT2ForSequenceClassification",
        decoder="gpt2",
        gated_mlp=False,
        learned_positions=True,
        base_prefix="transformer",
        layer_stack_name="h",
        conv1d_modules=("c_attn", "c_proj", "c_fc"),
        default_lora_targets=("c_attn",),
    ),
    "gemma3": Family(
        hf_causal_arch="Gemma3ForConditionalGeneration",
        hf_seq_cls_arch="Gemma3ForSequenceClassification",
        language_model_prefix="model.language_model",
        vision_model_type="siglip_vision_model",
    ),
}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# Image-text checkpoints: model_type -> where the language model's weights live.
LANGUAGE_MODEL_PREFIX = {
    t: f.language_model_prefix for t, f in FAMILIES.items() if f.language_model_prefix
}
# Decoders built by `llama.py` (GPT-OSS on top of it): what an image-text model's language
# model may be.
LLAMA_FAMILY = tuple(
    t for t, f in FAMILIES.items() if f.decoder != "gpt2" and t not in LANGUAGE_MODEL_PREFIX
)


def family(model_type: str) -> Family:
    """The traits of `model_type`; a clear error for a family jaxrl does not support."""
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type={model_type!r} is not supported by jaxrl.models; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    return FAMILIES[model_type]


__all__ = [
    "FAMILIES",
    "LANGUAGE_MODEL_PREFIX",
    "LLAMA_FAMILY",
    "SUPPORTED_MODEL_TYPES",
    "Family",
    "MoeTraits",
    "family",
]
