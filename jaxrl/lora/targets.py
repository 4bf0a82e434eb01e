"""Which modules and parameters LoRA adapts: the HF module names of our modules (as transformers
v5 names them, which PEFT's `target_modules`, `target_parameters` and `modules_to_save` match),
PEFT 0.21's rewrite of MoE targets under transformers v5 (`peft_v5_config`), and the module-tree
walking that `apply.py` and `peft_io.py` share. This file creates no adapters and reads no files.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from flax import nnx

from jaxrl.core import quant
from jaxrl.lora.config import ALL_LINEAR, LoraConfig
from jaxrl.lora.layers import EXPERT_PARAMETERS
from jaxrl.models import hf_keys, moe
from jaxrl.models.config import ModelConfig
from jaxrl.models.families import family
from jaxrl.models.layers import Dense

# ---------------------------------------------------------------- module names and traversal


def hf_module_names(path: tuple, config: ModelConfig) -> list[str]:
    """HF module name(s) of our module at `path` (as transformers v5 names its modules, which
    PEFT's adapter files use): one per layer for a scanned (stacked) module."""
    parts: list[str] = []
    stacked = False
    stack = family(config.model_type).layer_stack_name  # "layers"; GPT-2's "h"
    for i, name in enumerate(path):
        if i == 0 and (name == "backbone" or (name == "model" and config.language_model_prefix)):
            name = hf_keys.base_prefix(config)  # HF base prefix (image-text: its language model)
        if i == 0 and name in hf_keys.VISION_MODULES:
            name = f"model.{name}"  # transformers v5: `model.vision_tower...`
        if name == moe.moe_traits(config).attribute:
            name = "mlp"  # Mixtral's `block_sparse_moe` is `mlp` in transformers v5
        parts.append(str(name))
        if config.scan_layers and name == stack and i + 1 < len(path):
            if not isinstance(path[i + 1], int):
                parts.append("{}")
                stacked = True
    template = ".".join(parts)
    return [template.format(i) for i in range(config.num_layers)] if stacked else [template]


def matches(name: str, targets: str | tuple[str, ...]) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def all_or_none(path: tuple, names: list[str], targets: Any, what: str) -> bool:
    hits = [matches(n, targets) for n in names]
    if any(hits) and not all(hits):
        raise ValueError(
            f"{what} {targets!r} selects only some layers of the scanned stack at {path}; "
            "per-layer selection needs scan_layers=False."
        )
    return all(hits)


def get_node(root: nnx.Module, path: tuple) -> Any:
    for key in path:
        root = root[key] if isinstance(key, int) else getattr(root, key)
    return root


def set_node(root: nnx.Module, path: tuple, value: Any) -> None:
    parent = get_node(root, path[:-1])
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


def named_modules(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    return [(tuple(p), m) for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)]


def num_layer_axes(variable: nnx.Variable) -> int:
    """Number of leading stacked-layer axes of a param."""
    axes = variable.get_metadata().get("out_sharding") or ()
    return sum(1 for a in axes if a == "layers")


def value_shape(value: Any) -> tuple[int, ...]:
    if isinstance(value, quant.NF4Array):
        return value.shape
    if isinstance(value, quant.QuantizedArray):
        return tuple(value.values.shape)
    return tuple(value.shape)


# ---------------------------------------------------------------- PEFT's MoE targets

# PEFT 0.21 under transformers v5 (peft/utils/transformers_weight_conversion.py,
# `_convert_peft_config_moe`): on model types whose experts transformers v5 fuses, the router and
# expert names in `target_modules` become `target_parameters`. A type qualifies when it is a key
# of PEFT's copy of transformers' `_MODEL_TO_CONVERSION_PATTERN` (Mixtral added): the family
# table's `MoeTraits.peft_v5_conversion` names its pattern. Qwen2-MoE is only a value there, so
# its targets stay as given (its router and experts take `target_parameters` only).
# `_MOE_TARGET_MODULE_MAPPING`: pattern -> transformers v4 module name -> v5 parameter name, in
# its order.
_V5_MOE_TARGETS = {
    "mixtral": {
        "gate": "gate.weight",
        "w1": "gate_up_proj",
        "w3": "gate_up_proj",
        "w2": "down_proj",
    },
    "qwen2_moe": {
        "gate": "gate.weight",
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
        "down_proj": "down_proj",
    },
}
_FUSED = "gate_up_proj"
MOE_PARAMETER_EXAMPLE = "['mlp.gate.weight', 'mlp.experts.gate_up_proj', 'mlp.experts.down_proj']"


def is_all_linear(path: tuple, module: nnx.Module) -> bool:
    """PEFT's "all-linear": every linear layer but the output head (MoE routers and experts are
    not `nn.Linear` in transformers v5)."""
    return type(module) is Dense and path != ("lm_head",)


def parameter_names(module: nnx.Module, names: list[str]) -> dict[str, list[str]]:
    """transformers v5 names (per layer) of the parameters LoRA can adapt on an MoE router
    (`gate.weight [E, D]`) or experts (`gate_up_proj [E, 2F, D]`, `down_proj [E, D, F]`)."""
    if isinstance(module, moe.Router):
        return {"gate": [f"{n}.weight" for n in names]}
    return {kind: [f"{n}.{p}" for n in names] for kind, p in EXPERT_PARAMETERS.items()}


def _string_targets(targets: str, model: nnx.Module, mapping: Mapping[str, str]) -> set[str]:
    """PEFT's `_resolve_string_target_modules`: the leaf names a string `target_modules` selects.
    "all-linear": the linear layers' names plus every router/expert name of `mapping`; a regex:
    the leaf names of the module and parameter names it fully matches, plus each expert name
    whose v4 module name (`....experts.gate_proj`) it would have matched."""
    model_config: ModelConfig = model.config
    modules = [(p, m) for p, m in named_modules(model) if p]
    if targets.lower() == ALL_LINEAR:
        linear = {
            name.rsplit(".", 1)[-1]
            for path, module in modules
            if is_all_linear(path, module)
            for name in hf_module_names(path, model_config)
        }
        return linear | set(mapping)
    module_keys: list[str] = []
    param_keys: list[str] = []
    for path, module in modules:
        names = hf_module_names(path, model_config)
        module_keys += names
        if isinstance(module, Dense):
            leaves = ("weight",) if module.bias is None else ("weight", "bias")
            param_keys += [f"{n}.{leaf}" for n in names for leaf in leaves]
        elif isinstance(module, (moe.Router, moe.Experts)):
            param_keys += [k for keys in parameter_names(module, names).values() for k in keys]
    matched = {k.rsplit(".", 1)[-1] for k in module_keys + param_keys if re.fullmatch(targets, k)}
    containers: dict[str, list[str]] = {}
    for key in param_keys:
        container, _, leaf = key.rpartition(".")
        containers.setdefault(leaf, []).append(container)
    for old, new in mapping.items():
        if old not in matched and any(
            re.fullmatch(targets, f"{c}.{old}") for c in containers.get(new, ())
        ):
            matched.add(old)
    return matched


def peft_v5_config(config: LoraConfig, model: nnx.Module) -> LoraConfig:
    """`config` as PEFT 0.21 rewrites it for `model` under transformers v5.

    On Qwen3-MoE, OLMoE and Mixtral, `target_modules` entries naming the router (`gate`) or an
    expert projection (`gate_proj`/`up_proj`/`down_proj`; Mixtral `w1`/`w3`/`w2`) move to
    `target_parameters` (`gate.weight`, `gate_up_proj`, `down_proj`). A string is first resolved
    to the leaf names it selects, so "all-linear" adapts the routers and all experts too, and a
    regex loses any layer selection. transformers v5 fuses gate and up: naming one without the
    other is an error, naming both gives the fused adapter rank 2r and alpha 2*lora_alpha
    (`rank_pattern` / `alpha_pattern` `.*\\.gate_up_proj`). With no `target_modules` these models
    get none (PEFT's default table is bypassed). Other model types are returned unchanged.
    """
    model_type = model.config.model_type
    pattern = moe.moe_traits(model.config).peft_v5_conversion
    if pattern is None:
        return config
    if config.target_modules is None and not config.target_parameters:
        raise ValueError(
            f"PEFT 0.21 has no default LoRA targets for {model_type} under transformers v5; set "
            "target_modules, e.g. 'all-linear' or ['q_proj', 'v_proj']."
        )
    mapping = _V5_MOE_TARGETS[pattern]
    targets = config.target_modules
    if isinstance(targets, str):
        targets = _string_targets(targets, model, mapping)
        if not targets:
            return config  # nothing matched: apply_lora reports it
    parameters = set(config.target_parameters or ())
    modules: set[str] = set()
    fused: set[str] = set()
    for target in targets or ():
        old = next((o for o in mapping if target == o or target.endswith(f".{o}")), None)
        if old is None:
            modules.add(target)
            continue
        parameters.add(mapping[old])
        if mapping[old] == _FUSED:
            fused.add(old)
    halves = [old for old, new in mapping.items() if new == _FUSED]
    if fused and len(fused) < len(halves):
        raise ValueError(
            f"target_modules names {sorted(fused)} without {sorted(set(halves) - fused)}: "
            f"transformers v5 fuses them into one `{_FUSED}` parameter per layer, which takes one "
            "adapter (PEFT refuses this too). Target both or neither."
        )
    rank, alpha = dict(config.rank_pattern), dict(config.alpha_pattern)
    if fused:
        key = rf".*\.{re.escape(_FUSED)}"
        rank[key] = config.r * len(halves)
        alpha[key] = config.lora_alpha * len(halves)
    return dataclasses.replace(
        config,
        target_modules=tuple(sorted(modules)),
        target_parameters=tuple(sorted(parameters)) or None,
        rank_pattern=rank,
        alpha_pattern=alpha,
    )
