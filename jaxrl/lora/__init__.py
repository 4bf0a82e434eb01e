"""LoRA adapters on jaxrl models with PEFT's semantics, a frozen (optionally int8 / NF4) base, and
PEFT-format import and export.

What it does: `apply_lora` swaps each targeted `Dense` for a `LoraDense` that keeps the same
`kernel`/`bias` variables (so checkpoint paths do not move) and adds `lora_a [in..., r]`,
`lora_b [r, out...]` as `nnx.LoRAParam` (f32, as PEFT's `autocast_adapter_dtype`), giving
`y = x W + b + scaling * dropout(x) A B` with `scaling = lora_alpha / r` (`/ sqrt(r)` with
rsLoRA). `modules_to_save` params become trainable `SavedParam`s. `split_lora` separates the
trainable adapter state from the frozen base so a train state holds (and an optimizer sees) only
the adapter; `nnx.merge(graphdef, adapter, base)` inside jit rebuilds the model. Dropout and
"base without adapter" (the DPO reference, no second copy) are trace-time switches:
`with dropout_rng(key):` and `with disable_adapter():`, entered inside the jitted function.
Scanned layer stacks get stacked adapters (a leading `layers` axis), so one compiled block serves
every layer. This package holds no training loop and no config parsing.

Mixture-of-experts models (PEFT 0.21 under transformers v5, where the experts are fused 3-D
parameters): `target_parameters` put LoRA on a router's `gate.weight` (`LoraRouter`, the update
folded into the `D x E` kernel as PEFT's `ParamWrapper` folds it) and on the experts' fused
`gate_up_proj` / `down_proj` (`LoraExperts`: per-expert `A_e`, `B_e`, applied as grouped matmuls
on the low-rank factors inside the expert dispatch, no full-size delta). On Qwen3-MoE, OLMoE and
Mixtral, `target_modules` naming the router or expert projections (and "all-linear") are
rewritten into `target_parameters` first, exactly as PEFT does (`peft_v5_config`); PEFT refuses
dropout on those adapters, and so does jaxrl. GPT-OSS's experts (`LoraGptOssExperts`) take
`target_parameters` on their native `gate_up_proj [E, D, 2F]` (gate/up interleaved in B's
columns in the file) and `down_proj [E, F, D]`, rank r; its router (with a bias) is refused.

Why not qwix (measured with qwix 0.1.8 on jaxrl's tiny Llama, `qwix.LoraProvider(module_path=
".*(q_proj|v_proj)", rank=4, alpha=8)` + `apply_lora_to_model(model, provider, ids, rngs=...)`):
qwix creates LoRA params lazily, during a first traced call, by setting attributes on whichever
module object is "current" when a `dot_general` is intercepted. Our layer stack runs its blocks
through `nnx.split`/`nnx.merge` (per layer, or inside `lax.scan`), so those attributes land on
throw-away copies: with `scan_layers=False` the result had 0 LoRA params; with `scan_layers=True`
the init call failed inside `lax.scan` (IndexError). Beyond that, qwix's LoRA dropout has no eval
mode (always on), its scaling is fixed at alpha/rank (no rsLoRA switch), its init is he_uniform
(PEFT: kaiming_uniform(a=sqrt(5))), it quantizes bases with its own QArray rather than the
`jaxrl.core.quant` storage the DPO reference already uses, and it has no PEFT import/export.
Our models have one linear layer type (`Dense`), so explicit adapters are a small module.

Modules: `config` (`LoraConfig`), `layers` (the adapted layers and the dropout / disable
switches), `targets` (HF module names, target matching, PEFT's MoE target rewrite), `apply`
(apply, split, count, merge, quantized base), `peft_io` (PEFT adapter files) and `value_head`
(TRL's `AutoModelForCausalLMWithValueHead` loader with PEFT options).
"""

from jaxrl.lora.apply import (
    apply_lora,
    base_quantization,
    merge_lora,
    quantize_base,
    split_lora,
    trainable_parameters,
)
from jaxrl.lora.config import (
    ALL_LINEAR,
    DEFAULT_TARGETS,
    INIT_CHOICES,
    SEQ_CLS_HEADS,
    TASK_TYPES,
    LoraConfig,
)
from jaxrl.lora.layers import (
    ADAPTER,
    EXPERT_ADAPTERS,
    EXPERT_CLASSES,
    EXPERT_PARAMETERS,
    GPT_OSS_EXPERT_PARAMS,
    LORA_EXPERT_CLASSES,
    LoraDense,
    LoraDropoutId,
    LoraExperts,
    LoraGptOssExperts,
    LoraRouter,
    SavedParam,
)
from jaxrl.lora.peft_io import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    from_peft_model,
    is_peft_model,
    load_peft_adapter,
    save_peft_adapter,
)
from jaxrl.lora.targets import hf_module_names, peft_v5_config
from jaxrl.models.adapters import disable_adapter, dropout_rng, without_adapter

__all__ = [
    "ADAPTER",
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "ALL_LINEAR",
    "DEFAULT_TARGETS",
    "EXPERT_ADAPTERS",
    "EXPERT_CLASSES",
    "EXPERT_PARAMETERS",
    "GPT_OSS_EXPERT_PARAMS",
    "INIT_CHOICES",
    "LORA_EXPERT_CLASSES",
    "PEFT_PREFIX",
    "SEQ_CLS_HEADS",
    "TASK_TYPES",
    "LoraConfig",
    "LoraDense",
    "LoraDropoutId",
    "LoraExperts",
    "LoraGptOssExperts",
    "LoraRouter",
    "SavedParam",
    "apply_lora",
    "base_quantization",
    "disable_adapter",
    "dropout_rng",
    "from_peft_model",
    "hf_module_names",
    "is_peft_model",
    "load_peft_adapter",
    "merge_lora",
    "peft_v5_config",
    "quantize_base",
    "save_peft_adapter",
    "split_lora",
    "trainable_parameters",
    "without_adapter",
]
