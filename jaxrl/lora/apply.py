"""Adding, splitting, counting and merging adapters, and quantizing the frozen base.

`apply_lora` (PEFT's `get_peft_model`), `split_lora` (the trainable adapter state apart from the
frozen base), `trainable_parameters` (`print_trainable_parameters`), `merge_lora`
(`merge_and_unload`), `quantize_base` / `base_quantization` (`load_in_8bit` / `load_in_4bit`).
Nothing here reads or writes files (`peft_io.py`) or runs a training step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.core import quant
from jaxrl.lora.config import ALL_LINEAR, DEFAULT_TARGETS, SEQ_CLS_HEADS, LoraConfig
from jaxrl.lora.layers import (
    ADAPTER,
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
    folded_weight,
)
from jaxrl.lora.targets import (
    MOE_PARAMETER_EXAMPLE,
    all_or_none,
    hf_module_names,
    is_all_linear,
    matches,
    named_modules,
    num_layer_axes,
    parameter_names,
    peft_v5_config,
    set_node,
    value_shape,
)
from jaxrl.models import gpt_oss, hf, hf_keys, moe
from jaxrl.models.config import ModelConfig
from jaxrl.models.layers import Dense, param_value

# ---------------------------------------------------------------- apply


def _resolve_targets(config: LoraConfig, model_type: str) -> str | tuple[str, ...]:
    if config.target_modules is None:
        defaults = DEFAULT_TARGETS.get(model_type)
        if defaults is not None:
            return defaults
        if config.target_parameters:
            return ()
        raise ValueError(f"No default LoRA targets for {model_type!r}; set target_modules.")
    return config.target_modules


def _modules_to_save(config: LoraConfig) -> tuple[str, ...]:
    saved = tuple(config.modules_to_save or ())
    return saved + SEQ_CLS_HEADS if config.task_type == "SEQ_CLS" else saved


def _lora_init(
    config: LoraConfig,
    key: jax.Array,
    r: int,
    a_shape: tuple,
    b_shape: tuple,
    fan_in: int,
    b_fan_in: int,
) -> tuple[jax.Array, jax.Array]:
    """PEFT's `reset_lora_parameters` on `lora_A.weight [r', in]`, `lora_B.weight [out, r']`
    (`r' = r`, or `r * E` for experts)."""
    key_a, key_b = jax.random.split(key)
    if config.init_lora_weights == "gaussian":
        a = jax.random.normal(key_a, a_shape, jnp.float32) / r
    else:
        # torch kaiming_uniform_(a=sqrt(5)) on A [r', in]: bound = sqrt(6 / ((1 + 5) fan_in)).
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(key_a, a_shape, jnp.float32, -bound, bound)
    if config.init_lora_weights is False:
        # nn.Linear's own init of B [out, r']: the same kaiming bound with fan_in = r'.
        bound = 1.0 / math.sqrt(b_fan_in)
        return a, jax.random.uniform(key_b, b_shape, jnp.float32, -bound, bound)
    return a, jnp.zeros(b_shape, jnp.float32)


def _lora_param(value: jax.Array, axes: tuple, model_config: ModelConfig) -> nnx.LoRAParam:
    value = hf.place(value, axes, model_config)
    return nnx.LoRAParam(value, out_sharding=axes, eager_sharding=False)


def _layout(variable: nnx.Variable) -> tuple[int, tuple, tuple]:
    """(number of stacked-layer axes, shape, logical axes) of a base param."""
    shape = value_shape(variable.get_value())
    axes = tuple(variable.get_metadata().get("out_sharding") or (None,) * len(shape))
    return num_layer_axes(variable), shape, axes


def _rank_alpha(config: LoraConfig, path: tuple, names: list[str]) -> tuple[int, float]:
    """The one (r, alpha) of every layer of a (possibly stacked) target."""
    found = {config.rank_and_alpha(n) for n in names}
    if len(found) > 1:
        raise ValueError(
            f"rank_pattern / alpha_pattern give the layers of the scanned stack at {path} "
            "different ranks or alphas; per-layer values need scan_layers=False."
        )
    return found.pop()


def _make_lora_layer(
    layer: Dense,
    config: LoraConfig,
    r: int,
    alpha: float,
    key: jax.Array,
    first_id: int,
    model_config: ModelConfig,
) -> LoraDense:
    lead, shape, axes = _layout(layer.kernel)
    in_shape, out_shape = shape[lead : lead + layer.n_in], shape[lead + layer.n_in :]
    lead_shape, lead_axes = shape[:lead], axes[:lead]
    a_axes = (*lead_axes, *axes[lead : lead + layer.n_in], None)
    b_axes = (*lead_axes, None, *axes[lead + layer.n_in :])
    a, b = _lora_init(
        config,
        key,
        r,
        (*lead_shape, *in_shape, r),
        (*lead_shape, r, *out_shape),
        math.prod(in_shape),
        r,
    )
    dropout_id = None
    if config.lora_dropout > 0:
        ids = first_id + jnp.arange(math.prod(lead_shape), dtype=jnp.int32).reshape(lead_shape)
        dropout_id = LoraDropoutId(ids, out_sharding=lead_axes, eager_sharding=False)
    return LoraDense(
        layer,
        _lora_param(a, a_axes, model_config),
        _lora_param(b, b_axes, model_config),
        config.scaling_for(r, alpha),
        config.lora_dropout,
        dropout_id,
    )


def _make_lora_router(
    router: moe.Router,
    config: LoraConfig,
    r: int,
    alpha: float,
    key: jax.Array,
    model_config: ModelConfig,
) -> LoraRouter:
    # ParamWrapper on the 2-D `gate.weight [E, D]`: lora_A [r, D], lora_B [E, r].
    lead, shape, axes = _layout(router.kernel)
    (*lead_shape, d, e), (*lead_axes, d_axis, e_axis) = shape, axes
    a, b = _lora_init(config, key, r, (*lead_shape, d, r), (*lead_shape, r, e), d, r)
    return LoraRouter(
        router,
        _lora_param(a, (*lead_axes, d_axis, None), model_config),
        _lora_param(b, (*lead_axes, None, e_axis), model_config),
        config.scaling_for(r, alpha),
    )


def _make_lora_experts(
    experts: moe.Experts | gpt_oss.GptOssExperts,
    config: LoraConfig,
    ranks: Mapping[str, tuple[int, float]],
    key: jax.Array,
    model_config: ModelConfig,
) -> LoraExperts | LoraGptOssExperts:
    # ParamWrapper on a 3-D expert parameter: lora_A [E * r, in], lora_B [out, r * E], i.e. per
    # expert A_e [r, in] and B_e [out, r]; the fused gate_up's out is 2F (gate rows first;
    # GPT-OSS: gate and up interleaved, kept as (2, F) here and re-interleaved in the file).
    is_gpt_oss = isinstance(experts, gpt_oss.GptOssExperts)
    gate, _, down = ("gate_up_proj", None, "down_proj") if is_gpt_oss else experts.names
    adapters = {}
    for kind, (r, alpha) in ranks.items():
        lead, shape, axes = _layout(getattr(experts, gate if kind == "gate_up" else down))
        e, n_in, e_axis, in_axis = shape[lead], shape[lead + 1], axes[lead], axes[lead + 1]
        lead_shape, lead_axes = shape[:lead], axes[:lead]
        out_shape, out_axes = shape[lead + 2 :], axes[lead + 2 :]
        if kind == "gate_up" and not is_gpt_oss:
            out_shape, out_axes = (2, *out_shape), (None, *out_axes)
        key, sub = jax.random.split(key)
        a, b = _lora_init(
            config,
            sub,
            r,
            (*lead_shape, e, n_in, r),
            (*lead_shape, e, r, *out_shape),
            n_in,
            r * e,
        )
        adapters[kind] = (
            _lora_param(a, (*lead_axes, e_axis, in_axis, None), model_config),
            _lora_param(b, (*lead_axes, e_axis, None, *out_axes), model_config),
            config.scaling_for(r, alpha),
        )
    return (LoraGptOssExperts if is_gpt_oss else LoraExperts)(experts, adapters)


def apply_lora(model: nnx.Module, config: LoraConfig, rngs: nnx.Rngs) -> nnx.Module:
    """Add LoRA adapters to `model` in place (as PEFT's `get_peft_model`) and return it.

    `target_modules` selects linear layers (`LoraDense`); `target_parameters` selects MoE router
    and expert parameters (`LoraRouter`, `LoraExperts`), and on Qwen3-MoE, OLMoE and Mixtral the
    router and expert names of `target_modules` are moved there first, as PEFT does under
    transformers v5 (`peft_v5_config`; `model.lora_config` keeps the rewritten config, as PEFT's
    `peft_config` does). Adapters are created in the sharding their logical axes give on
    `model.config.mesh`. The base may already be quantized (`quantize_base`); the adapters are
    f32 either way.
    """
    model_config: ModelConfig = model.config
    if getattr(model, "lora_config", None) is not None:
        raise ValueError("The model already has LoRA adapters; merge_lora() it first.")
    config = peft_v5_config(config, model)
    targets = _resolve_targets(config, hf_keys.checkpoint_model_type(model_config))
    parameters = config.target_parameters or ()
    router_targets = [t for t in parameters if "router." in t or t.startswith("router")]
    if router_targets and moe.moe_traits(model_config).router_bias:
        raise ValueError(
            f"target_parameters {router_targets}: LoRA on GPT-OSS's router (a linear layer with a "
            "bias) is not supported by jaxrl yet. Adapt the experts "
            "(['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']) and/or the attention "
            "projections (target_modules), or train the router in full."
        )
    saved = _modules_to_save(config)
    chosen: list[tuple[tuple, Dense]] = []
    chosen_moe: list[tuple[tuple, nnx.Module, tuple[str, ...]]] = []
    saved_modules: list[tuple[tuple, nnx.Module]] = []
    found_saved: set[str] = set()
    found_parameters: set[str] = set()
    for path, module in named_modules(model):
        if not path:
            continue
        names = hf_module_names(path, model_config)
        if saved and all_or_none(path, names, saved, "modules_to_save"):
            saved_modules.append((path, module))
            found_saved.update(t for t in saved if any(matches(n, (t,)) for n in names))
            continue
        if isinstance(module, (moe.Router, *EXPERT_CLASSES)):
            if targets != ALL_LINEAR and all_or_none(path, names, targets, "target_modules"):
                what = "router" if isinstance(module, moe.Router) else "experts"
                raise ValueError(
                    f"target_modules {targets!r} selects the MoE {what} module {names[0]!r}, "
                    "which is not a linear layer (PEFT refuses it too). LoRA reaches MoE routers "
                    f"and experts through target_parameters, e.g. {MOE_PARAMETER_EXAMPLE}."
                )
            kinds = []
            for kind, keys in parameter_names(module, names).items():
                if parameters and all_or_none(path, keys, parameters, "target_parameters"):
                    kinds.append(kind)
                    found_parameters.update(
                        t for t in parameters if any(matches(k, (t,)) for k in keys)
                    )
            if kinds:
                chosen_moe.append((path, module, tuple(kinds)))
            continue
        is_linear = isinstance(module, Dense)
        if parameters and is_linear:
            hits = [t for t in parameters if any(matches(f"{n}.weight", (t,)) for n in names)]
            if hits:
                raise ValueError(
                    f"target_parameters {hits} select the weight of the linear layer "
                    f"{names[0]!r}; jaxrl's target_parameters adapt MoE routers and experts "
                    "only. Adapt a linear layer through target_modules (PEFT's file is the same)."
                )
        if targets == ALL_LINEAR:
            if is_all_linear(path, module):
                chosen.append((path, module))
            continue
        if not all_or_none(path, names, targets, "target_modules"):
            continue
        if type(module) is not Dense or path == ("lm_head",):
            kind = "an output head" if is_linear else f"a {type(module).__name__}"
            raise ValueError(
                f"target_modules {targets!r} selects {names[0]!r}, which is {kind}; LoRA applies "
                "to the decoder's linear layers. Put heads and embeddings in modules_to_save."
            )
        chosen.append((path, module))
    unmatched = sorted(set(parameters) - found_parameters)
    if unmatched:
        raise ValueError(
            f"target_parameters {unmatched} matched no parameter of this "
            f"{model_config.model_type} model; they name MoE router and expert parameters as "
            f"transformers v5 does, e.g. {MOE_PARAMETER_EXAMPLE}."
        )
    if not chosen and not chosen_moe:
        raise ValueError(
            f"target_modules {targets!r} matched no linear layer of this {model_config.model_type}"
            " model (names as in the HF checkpoint, e.g. 'q_proj' or 'model.layers.0.mlp.up_proj')."
        )
    if chosen_moe and config.lora_dropout > 0:
        raise ValueError(
            f"lora_dropout={config.lora_dropout} with LoRA on MoE router / expert parameters "
            f"(target_parameters {list(parameters)}): PEFT's ParamWrapper refuses dropout there "
            "(dropout(x) cannot be factored out of x (W + BA)), and so does jaxrl. Set "
            "lora_dropout=0 (TRL's ModelConfig defaults to 0.05: pass --lora_dropout 0)."
        )
    # PEFT writes its automatic SEQ_CLS head names into saved configs; only one of them exists.
    missing = [
        t for t in (config.modules_to_save or ()) if t not in found_saved and t not in SEQ_CLS_HEADS
    ]
    if missing:
        raise ValueError(f"modules_to_save {missing} matched no module of this model.")
    next_id = 0
    for path, layer in chosen:
        r, alpha = _rank_alpha(config, path, hf_module_names(path, model_config))
        lora_layer = _make_lora_layer(layer, config, r, alpha, rngs.params(), next_id, model_config)
        next_id += math.prod(value_shape(layer.kernel.get_value())[: num_layer_axes(layer.kernel)])
        set_node(model, path, lora_layer)
    for path, module, kinds in chosen_moe:
        keys = parameter_names(module, hf_module_names(path, model_config))
        ranks = {kind: _rank_alpha(config, path, keys[kind]) for kind in kinds}
        if isinstance(module, moe.Router):
            adapted = _make_lora_router(module, config, *ranks["gate"], rngs.params(), model_config)
        else:
            adapted = _make_lora_experts(module, config, ranks, rngs.params(), model_config)
        set_node(model, path, adapted)
    for _, module in saved_modules:
        _retype_params(module, SavedParam)
    model.lora_config = config
    return model


def _retype_params(module: nnx.Module, cls: type[nnx.Param]) -> None:
    """Re-declare the plain (or saved) params under `module` as `cls`, keeping value and metadata."""
    for path, var in list(nnx.iter_graph(module)):
        if isinstance(var, nnx.Param) and not isinstance(var, nnx.LoRAParam):
            if type(var) is not cls:
                set_node(module, tuple(path), cls(var.get_value(), **var.get_metadata()))


def _lora_layers(model: nnx.Module) -> list[tuple[tuple, LoraDense]]:
    return [(p, m) for p, m in named_modules(model) if isinstance(m, LoraDense)]


def _moe_layers(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    return [
        (p, m) for p, m in named_modules(model) if isinstance(m, (LoraRouter, *LORA_EXPERT_CLASSES))
    ]


# ---------------------------------------------------------------- split, count, merge


def split_lora(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """`(graphdef, adapter, base)`: the trainable adapter (LoRA A/B and modules_to_save params)
    and everything frozen. `nnx.merge(graphdef, adapter, base)` rebuilds the model (in jit)."""
    return nnx.split(model, ADAPTER, ...)


def trainable_parameters(model: nnx.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts, as PEFT's `print_trainable_parameters`: quantized
    base weights count their logical (dequantized) size."""
    _, adapter, base = split_lora(model)

    def count(state: nnx.State) -> int:
        variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return sum(
            math.prod(value_shape(v.get_value())) for v in variables if isinstance(v, nnx.Param)
        )

    trainable = count(adapter)
    return trainable, trainable + count(base)


def _merged_kernel(layer: LoraDense) -> jax.Array:
    kernel = layer.kernel.get_value()
    dtype = (
        kernel.dtype if not isinstance(kernel, quant.QuantizedArray) else jnp.dtype(kernel.dtype)
    )
    w = param_value(layer.kernel, jnp.float32)
    lead = num_layer_axes(layer.kernel)
    a, b = layer.lora_a.get_value(), layer.lora_b.get_value()
    lead_shape = w.shape[:lead]
    r = a.shape[-1]
    a_flat = a.reshape(*lead_shape, -1, r)
    b_flat = b.reshape(*lead_shape, r, -1)
    delta = jnp.matmul(a_flat, b_flat, precision=jax.lax.Precision.HIGHEST).reshape(w.shape)
    return (w + layer.scaling * delta).astype(dtype)


def _merged_param(variable: nnx.Variable, a: jax.Array, b: jax.Array, scaling: float) -> nnx.Param:
    value = folded_weight(variable, a, b, scaling).astype(variable.get_value().dtype)
    return nnx.Param(value, **variable.get_metadata())


def _merged_moe(layer: LoraRouter | LoraExperts, model_config: ModelConfig) -> nnx.Module:
    """A plain router / experts module with the adapters folded in (PEFT's `ParamWrapper.merge`:
    `W_e += scaling * B_e A_e` for every expert). The module comes from `nnx.eval_shape` (no
    full-size init) and gets the merged params."""
    if isinstance(layer, LoraRouter):
        router = nnx.eval_shape(lambda: moe.Router(model_config, nnx.Rngs(0)))
        router.dtype = layer.dtype
        router.kernel = _merged_param(
            layer.kernel, layer.lora_a[...], layer.lora_b[...], layer.scaling
        )
        return router
    if isinstance(layer, LoraGptOssExperts):
        return _merged_gpt_oss_experts(layer, model_config)
    experts = nnx.eval_shape(lambda: moe.Experts(model_config, 1, nnx.Rngs(0)))
    experts.dtype, experts.mesh, experts.rules = layer.dtype, layer.mesh, layer.rules
    experts.act, experts.names = layer.act, layer.names
    gate, up, down = layer.names
    merged = {name: getattr(layer, name) for name in layer.names}
    adapters = layer.adapters()
    if "gate_up" in adapters:
        a, b, scaling = adapters["gate_up"]
        merged[gate] = _merged_param(merged[gate], a[...], b[...][..., 0, :], scaling)
        merged[up] = _merged_param(merged[up], a[...], b[...][..., 1, :], scaling)
    if "down" in adapters:
        a, b, scaling = adapters["down"]
        merged[down] = _merged_param(merged[down], a[...], b[...], scaling)
    for name, variable in merged.items():
        setattr(experts, name, variable)
    return experts


def _merged_gpt_oss_experts(
    layer: LoraGptOssExperts, model_config: ModelConfig
) -> gpt_oss.GptOssExperts:
    """PEFT's `ParamWrapper.merge` on GPT-OSS's experts: `W_e += scaling * A_e B_e`."""
    experts = nnx.eval_shape(lambda: gpt_oss.GptOssExperts(model_config, nnx.Rngs(0)))
    experts.dtype, experts.alpha, experts.limit = layer.dtype, layer.alpha, layer.limit
    experts.mesh, experts.rules = layer.mesh, layer.rules
    merged = {name: getattr(layer, name) for name in GPT_OSS_EXPERT_PARAMS}
    for kind, (a, b, scaling) in layer.adapters().items():
        name = EXPERT_PARAMETERS[kind]
        variable = merged[name]
        b_flat = b[...].reshape(*b.shape[:-2], -1) if kind == "gate_up" else b[...]
        delta = jnp.matmul(a[...], b_flat, precision=jax.lax.Precision.HIGHEST)
        value = param_value(variable, jnp.float32) + scaling * delta.reshape(variable.shape)
        merged[name] = nnx.Param(
            value.astype(variable.get_value().dtype), **variable.get_metadata()
        )
    for name, variable in merged.items():
        setattr(experts, name, variable)
    return experts


def merge_lora(model: nnx.Module) -> nnx.Module:
    """A plain model with `W + scaling * A B` folded into every adapted kernel, MoE router and
    expert (PEFT's `merge_and_unload`); `save_pretrained` writes it as a full HF directory. A
    quantized kernel is dequantized to its original dtype first. `model` itself is left
    unchanged."""
    model_config: ModelConfig = model.config
    out = nnx.merge(*nnx.split(model))  # new module objects sharing the arrays
    for path, layer in _lora_layers(out):
        # A 1x1 Dense whose fields are replaced: gives a genuine `Dense` without initialising
        # a full-size kernel.
        dense = Dense(
            (1,), (1,), (None,), (None,), model_config, None, use_bias=layer.bias is not None
        )
        dense.n_in, dense.dtype, dense.bias = layer.n_in, layer.dtype, layer.bias
        dense.kernel = nnx.Param(_merged_kernel(layer), **layer.kernel.get_metadata())
        set_node(out, path, dense)
    for path, layer in _moe_layers(out):
        set_node(out, path, _merged_moe(layer, model_config))
    _retype_params(out, nnx.Param)
    out.lora_config = None
    return out


# ---------------------------------------------------------------- quantized base


# ---------------------------------------------------------------- quantized base


def quantize_base(model: nnx.Module, scheme: str = "nf4") -> nnx.Module:
    """Store the frozen linear kernels of `model` quantized, in place (`load_in_8bit`: "int8",
    per-output-channel absmax; `load_in_4bit`: "nf4", QLoRA's NF4 in blocks of 64). As
    bitsandbytes does through transformers, the output head, embeddings and norms stay in full
    precision, and so do adapters and modules_to_save params. Kernels are dequantized at their
    point of use (one layer at a time inside a scanned stack)."""
    for path, module in named_modules(model):
        if not isinstance(module, Dense) or path == ("lm_head",):
            continue
        if type(module) not in (Dense, LoraDense) or type(module.kernel) is not nnx.Param:
            continue  # classification / value heads, saved modules
        if isinstance(module.kernel.get_value(), quant.QuantizedArray):
            continue
        module.kernel = quant.quantize_params({"kernel": module.kernel}, scheme=scheme)["kernel"]
    return model


def base_quantization(model_config: Any) -> str | None:
    """The `quantize_base` scheme TRL `ModelConfig` fields ask for: "int8" (`load_in_8bit`),
    "nf4" (`load_in_4bit` with `bnb_4bit_quant_type="nf4"`) or None."""
    if model_config.load_in_8bit and model_config.load_in_4bit:
        raise ValueError("Set at most one of load_in_8bit and load_in_4bit.")
    if model_config.load_in_8bit:
        return "int8"
    if not model_config.load_in_4bit:
        return None
    if model_config.bnb_4bit_quant_type != "nf4":
        raise ValueError(
            f"bnb_4bit_quant_type={model_config.bnb_4bit_quant_type!r} is not supported; jaxrl's "
            "4-bit base is NF4 (QLoRA's default), set bnb_4bit_quant_type='nf4'."
        )
    if model_config.use_bnb_nested_quant:
        raise ValueError(
            "use_bnb_nested_quant (double quantization of the absmax) is not implemented; the "
            "NF4 base keeps f32 block absmax (4.5 bits per weight). Drop the option."
        )
    return "nf4"
