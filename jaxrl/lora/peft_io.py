"""PEFT adapter files: `save_peft_adapter` writes `adapter_config.json` +
`adapter_model.safetensors` that `peft.PeftModel.from_pretrained` loads with the same logits, and
`load_peft_adapter` reads them back (transformers v5's layout, and v4's per-expert MoE adapters
fused as PEFT 0.21 fuses them). The conversion of our factors to PEFT's `lora_A` / `lora_B` is
here; the keys and layouts of base params (`modules_to_save`) are `jaxrl.models.hf_keys`. No
training, merging or target selection here.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from jaxrl import parallel
from jaxrl.lora.apply import apply_lora
from jaxrl.lora.config import LoraConfig
from jaxrl.lora.layers import (
    EXPERT_PARAMETERS,
    LORA_EXPERT_CLASSES,
    LoraDense,
    LoraGptOssExperts,
    LoraRouter,
    SavedParam,
)
from jaxrl.lora.targets import (
    get_node,
    hf_module_names,
    named_modules,
    num_layer_axes,
    parameter_names,
)
from jaxrl.models import hf_keys, hf_objects, moe
from jaxrl.models.config import ModelConfig
from jaxrl.models.families import family
from jaxrl.models.hf import from_state
from jaxrl.models.weights_io import SafetensorsFile, write_safetensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class _Adapter(NamedTuple):
    """One adapter as PEFT's file holds it, per layer of a (possibly stacked) target."""

    prefixes: list[str]  # key prefix of `lora_A.weight` / `lora_B.weight`
    targets: list[str]  # its target_modules (module) or target_parameters (parameter) name
    parameter: bool
    lora_a: nnx.Variable
    lora_b: nnx.Variable
    lead: int  # stacked-layer axes
    # Experts only (a leading experts axis after the layers): the per-expert module names a
    # transformers v4 file uses, `{v4_prefix}.{e}.{name}.lora_A.weight` (gate and up for the
    # fused gate_up), as PEFT still loads them.
    v4_prefixes: list[str] = []
    halves: tuple[str, ...] = ()
    # GPT-OSS's gate_up: B's output columns interleave gate and up in PEFT's file.
    interleaved: bool = False


def _v4_name(name: str, model_config: ModelConfig) -> str:
    """An MoE module's transformers v4 name (Mixtral's block was `block_sparse_moe`)."""
    attribute = moe.moe_traits(model_config).attribute
    return name if attribute == "mlp" else name.replace(".mlp.", f".{attribute}.")


def _adapters(model: nnx.Module) -> list[_Adapter]:
    model_config: ModelConfig = model.config
    out = []
    for path, layer in named_modules(model):
        if not isinstance(layer, (LoraDense, LoraRouter, *LORA_EXPERT_CLASSES)):
            continue
        names = hf_module_names(path, model_config)
        if isinstance(layer, LoraDense):
            lead = num_layer_axes(layer.kernel)
            out.append(_Adapter(names, names, False, layer.lora_a, layer.lora_b, lead))
        elif isinstance(layer, LoraRouter):
            targets = parameter_names(layer, names)["gate"]
            v4 = [_v4_name(n, model_config) for n in names]
            lead = num_layer_axes(layer.kernel)
            out.append(_Adapter(names, targets, True, layer.lora_a, layer.lora_b, lead, v4))
        else:
            keys = parameter_names(layer, names)
            adapters = layer.adapters()
            is_gpt_oss = isinstance(layer, LoraGptOssExperts)
            lead = num_layer_axes(
                layer.gate_up_proj if is_gpt_oss else getattr(layer, layer.names[0])
            )
            v4 = [_v4_name(n, model_config) for n in names]
            for i, (kind, (a, b, _)) in enumerate(adapters.items()):
                # PEFT nests one ParamWrapper per parameter, the first parameter innermost:
                # `experts.base_layer.lora_A` (gate_up) inside `experts.lora_A` (down).
                nest = ".base_layer" * (len(adapters) - 1 - i)
                if is_gpt_oss:  # no per-expert (v4) layout: the parameter's own name
                    halves = (EXPERT_PARAMETERS[kind],)
                else:
                    halves = layer.names[:2] if kind == "gate_up" else layer.names[2:]
                prefixes = [n + nest for n in names]
                interleaved = is_gpt_oss and kind == "gate_up"
                out.append(
                    _Adapter(prefixes, keys[kind], True, a, b, lead, v4, halves, interleaved)
                )
    return out


# ---------------------------------------------------------------- factors and files


def _layer_slices(x: np.ndarray, lead: int) -> list[np.ndarray]:
    return [x] if lead == 0 else list(x.reshape(-1, *x.shape[lead:]))


def _peft_factors(a: np.ndarray, b: np.ndarray, experts: bool) -> tuple[np.ndarray, np.ndarray]:
    """Ours -> PEFT's `(lora_A.weight, lora_B.weight)` of one layer. Linear layers and routers:
    A `[in..., r]` -> `[r, in]`, B `[r, out...]` -> `[out, r]`. Experts (ParamWrapper on a 3-D
    parameter, `get_delta_weight`): A `[E, in, r]` -> `[E * r, in]` (row `e * r + k`), B
    `[E, r, out...]` -> `[out, r * E]` (column `k * E + e`)."""
    r = a.shape[-1]
    if not experts:
        return a.reshape(-1, r).T, b.reshape(r, -1).T
    e = a.shape[0]
    lora_a = a.reshape(e, -1, r).transpose(0, 2, 1).reshape(e * r, -1)
    return lora_a, b.reshape(e, r, -1).transpose(2, 1, 0).reshape(-1, r * e)


def _our_factors(
    lora_a: np.ndarray, lora_b: np.ndarray, a_shape: tuple, b_shape: tuple, experts: bool
) -> tuple[np.ndarray, np.ndarray]:
    """`_peft_factors` inverted, into one layer's `a_shape` / `b_shape`."""
    r = a_shape[-1]
    if not experts:
        return lora_a.T.reshape(a_shape), lora_b.T.reshape(b_shape)
    e = a_shape[0]
    a = lora_a.reshape(e, r, -1).transpose(0, 2, 1)
    return a.reshape(a_shape), lora_b.reshape(-1, r, e).transpose(2, 1, 0).reshape(b_shape)


def _v4_expert_factors(
    read: Callable[[str, tuple], np.ndarray],
    module: str,
    halves: tuple[str, ...],
    a_shape: tuple,
    b_shape: tuple,
) -> tuple[np.ndarray, np.ndarray]:
    """One layer's expert adapter from a transformers v4 file's per-expert adapters, as PEFT's
    `PeftConcatenate` fuses them: for gate and up, A stacked on the rank (`[A_gate; A_up]`) and B
    block-diagonal, so the fused adapter has rank `2 r` and each half keeps its own update."""
    e, n_in, r = a_shape[0], a_shape[1], a_shape[-1]
    out = math.prod(b_shape[2:])
    r_half, out_half = r // len(halves), out // len(halves)
    a = np.zeros((e, n_in, r), np.float32)
    b = np.zeros((e, r, out), np.float32)
    for expert in range(e):
        for i, name in enumerate(halves):
            key = f"{PEFT_PREFIX}{module}.{expert}.{name}"
            rows, cols = (
                slice(i * r_half, (i + 1) * r_half),
                slice(i * out_half, (i + 1) * out_half),
            )
            a[expert, :, rows] = read(f"{key}.lora_A.weight", (r_half, n_in)).T
            b[expert, rows, cols] = read(f"{key}.lora_B.weight", (out_half, r_half)).T
    return a, b.reshape(b_shape)


def save_peft_adapter(
    model: nnx.Module, path: str | Path, base_model_name_or_path: str | None = None
) -> None:
    """Write `adapter_config.json` + `adapter_model.safetensors` that
    `peft.PeftModel.from_pretrained(transformers_model, path)` loads with the same logits.
    Only process 0 writes (every process must call this, for the gathers)."""
    config: LoraConfig | None = getattr(model, "lora_config", None)
    if config is None:
        raise ValueError("The model has no LoRA adapters; apply_lora() or load_peft_adapter().")
    model_config: ModelConfig = model.config
    tensors: dict[str, np.ndarray] = {}
    names: list[str] = []
    parameters: list[str] = []
    for adapter in _adapters(model):
        (parameters if adapter.parameter else names).extend(adapter.targets)
        a_layers = _layer_slices(parallel.to_host(adapter.lora_a.get_value()), adapter.lead)
        b_layers = _layer_slices(parallel.to_host(adapter.lora_b.get_value()), adapter.lead)
        for prefix, a, b in zip(adapter.prefixes, a_layers, b_layers, strict=True):
            if adapter.interleaved:  # [E, r, 2, F] -> [E, r, F, 2]: gate/up alternate
                b = np.swapaxes(b, -1, -2)
            lora_a, lora_b = _peft_factors(a, b, bool(adapter.halves))
            tensors[f"{PEFT_PREFIX}{prefix}.lora_A.weight"] = lora_a
            tensors[f"{PEFT_PREFIX}{prefix}.lora_B.weight"] = lora_b
    saved_state = nnx.state(model, SavedParam)
    for entry in hf_keys.entries(saved_state, model_config):
        value = parallel.to_host(entry.variable.get_value())
        for key, x in zip(entry.keys(), _layer_slices(value, entry.split), strict=True):
            tensors[PEFT_PREFIX + key] = hf_keys.ours_to_hf(
                x, entry.path, entry.hf_shape, model_config, entry.layout
            )
    if jax.process_index() != 0:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    peft_config = {
        **config.to_peft_dict(),
        "peft_type": "LORA",
        "target_modules": sorted(names),
        "target_parameters": sorted(parameters) or None,
        # PEFT's flag for GPT-2's Conv1D ([in, out]) base weights.
        "fan_in_fan_out": bool(family(model_config.model_type).conv1d_modules),
        "base_model_name_or_path": base_model_name_or_path,
        "inference_mode": True,
    }
    (path / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2))
    specs = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    write_safetensors(path / ADAPTER_WEIGHTS, specs, tensors.__getitem__, {"format": "pt"})


def load_peft_adapter(model: nnx.Module, path: str | Path) -> nnx.Module:
    """Add the PEFT adapter in `path` to `model` (in place) and return it, e.g. to continue
    training it or to export it merged. Every tensor of the file must map onto the model. MoE
    expert adapters saved under transformers v4 (one per expert and projection) load as PEFT 0.21
    loads them, fused into the v5 layout."""
    path = Path(path)
    if not (path / ADAPTER_CONFIG).exists() or not (path / ADAPTER_WEIGHTS).exists():
        raise FileNotFoundError(
            f"{path} is not a PEFT adapter directory: expected {ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS} (PeftModel.save_pretrained output)."
        )
    peft_config = json.loads((path / ADAPTER_CONFIG).read_text())
    reader = SafetensorsFile(path / ADAPTER_WEIGHTS)
    return _load_adapter(model, peft_config, reader, str(path / ADAPTER_WEIGHTS))


def _load_adapter(model: nnx.Module, peft_config: dict, reader: Any, source: str) -> nnx.Module:
    """`load_peft_adapter` from an `adapter_config.json` dict and a reader of the adapter file's
    tensors (`keys`, `get`; PEFT's saved key names), which `source` names in messages."""
    model_config: ModelConfig = model.config
    if peft_config.get("fan_in_fan_out") and not family(model_config.model_type).conv1d_modules:
        raise ValueError(
            f"{source} sets fan_in_fan_out=True, which only fits GPT-2's Conv1D layers; this is a "
            f"{model_config.model_type} model."
        )
    apply_lora(model, LoraConfig.from_peft(peft_config), nnx.Rngs(0))
    unused = set(reader.keys())

    def read(key: str, shape: tuple) -> np.ndarray:
        if key not in unused:
            raise KeyError(f"{source} has no tensor {key!r} the adapter needs.")
        unused.discard(key)
        x = reader.get(key)
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{key} in {source} has shape {x.shape}, the model needs {shape}.")
        return x

    def assign(variable: nnx.Variable, layers: list[np.ndarray]) -> None:
        old = variable.get_value()
        host = np.stack(layers) if num_layer_axes(variable) else layers[0]
        host = host.reshape(old.shape).astype(old.dtype)
        sharding = getattr(old, "sharding", None)
        variable.set_value(jax.device_put(host, sharding) if sharding is not None else host)

    for adapter in _adapters(model):
        a_shape = adapter.lora_a.get_value().shape[adapter.lead :]
        b_shape = adapter.lora_b.get_value().shape[adapter.lead :]
        experts = bool(adapter.halves)
        r, num_experts = a_shape[-1], (a_shape[0] if experts else 1)
        in_size = math.prod(a_shape[int(experts) : -1])
        out_size = math.prod(b_shape[1 + int(experts) :])
        a_layers, b_layers = [], []
        v4_prefixes = adapter.v4_prefixes or adapter.prefixes
        for prefix, v4 in zip(adapter.prefixes, v4_prefixes, strict=True):
            v5 = f"{PEFT_PREFIX}{prefix}.lora_A.weight" in unused
            if experts and not v5:  # a transformers v4 file: an adapter per expert and projection
                a, b = _v4_expert_factors(read, v4, adapter.halves, a_shape, b_shape)
            else:
                key = f"{PEFT_PREFIX}{prefix if v5 else v4}"
                lora_a = read(f"{key}.lora_A.weight", (num_experts * r, in_size))
                lora_b = read(f"{key}.lora_B.weight", (out_size, r * num_experts))
                if adapter.interleaved:  # PEFT's [.., F, 2] (gate/up alternating) -> [.., 2, F]
                    swapped = (*b_shape[:-2], b_shape[-1], b_shape[-2])
                    a, b = _our_factors(lora_a, lora_b, a_shape, swapped, experts)
                    b = np.swapaxes(b, -1, -2)
                else:
                    a, b = _our_factors(lora_a, lora_b, a_shape, b_shape, experts)
            a_layers.append(a)
            b_layers.append(b)
        assign(adapter.lora_a, a_layers)
        assign(adapter.lora_b, b_layers)
    for entry in hf_keys.entries(nnx.state(model, SavedParam), model_config):
        layers = [
            hf_keys.hf_to_ours(
                read(PEFT_PREFIX + k, entry.hf_shape),
                entry.path,
                entry.layer_shape,
                model_config,
                entry.layout,
            )
            for k in entry.keys()
        ]
        saved_var = get_node(model, entry.path)
        assign(saved_var, layers)
    unused -= _inert_vision_adapters(reader, unused, model_config, source)
    if unused:
        raise ValueError(f"{source} has tensors this model does not use: {sorted(unused)[:10]}")
    return model


def is_peft_model(obj: Any) -> bool:
    """A `peft.PeftModel` (imports nothing: such an object exists only once peft is loaded)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(obj, peft.PeftModel)


# A PeftModel's state-dict names of its base weights: PEFT's wrapper modules insert
# `base_layer` (LoRA layers) and `original_module` (`modules_to_save`) into the path.
_WRAPPER_PARTS = (".base_layer.", ".original_module.")


def _base_state_dict(peft_model: Any) -> dict[str, Any]:
    """The base model's weights under their transformers names: the wrapped base layers, not
    the adapters (`lora_*`) nor the trained copies of `modules_to_save` (both the adapter's)."""
    out = {}
    for key, tensor in peft_model.get_base_model().state_dict().items():
        if ".lora_" in key or ".modules_to_save." in key:
            continue
        for part in _WRAPPER_PARTS:
            while part in key:
                key = key.replace(part, ".")
        out[key] = tensor
    return out


def from_peft_model(peft_model: Any, **load_kwargs: Any) -> nnx.Module:
    """A jaxrl model with LoRA from a `peft.PeftModel` in memory, as loading its base directory
    and then `load_peft_adapter` on its saved adapter would give: the base weights and the
    active adapter (PEFT's saved key names, `get_peft_model_state_dict`) read from the objects,
    `load_kwargs` as `from_pretrained`'s."""
    from peft import get_peft_model_state_dict  # optional dependency (the object needs it)

    name = peft_model.active_adapter
    if not isinstance(name, str):
        raise ValueError(
            f"The PeftModel has several active adapters ({name}); jaxrl trains one. Activate "
            "one (set_adapter) or merge them first."
        )
    base = peft_model.get_base_model()
    model = from_state(
        hf_objects.hf_config_of(base),
        hf_objects.StateDictReader(_base_state_dict(peft_model)),
        source=f"The given PeftModel's base {type(base).__name__}",
        passthrough_dir=hf_objects.local_dir(hf_objects.source_path(base)),
        **load_kwargs,
    )
    adapter = get_peft_model_state_dict(peft_model, adapter_name=name)
    config = peft_model.peft_config[name].to_dict()
    source = f"The given PeftModel's adapter {name!r}"
    return _load_adapter(model, config, hf_objects.StateDictReader(adapter), source)


def _inert_vision_adapters(
    reader: Any, keys: set[str], config: ModelConfig, source: str
) -> set[str]:
    """An image-text model's adapter tensors outside its language model (PEFT's `all-linear`
    or `q_proj` also adapt the vision tower's layers): jaxrl trains the language model on text and
    never runs the vision tower, so such adapters may only be PEFT's untrained ones (lora_B
    zero), which change nothing; they are not written back."""
    if not config.language_model_prefix or config.vision is not None:
        return set()
    own = PEFT_PREFIX + config.language_model_prefix + "."
    outside = {k for k in keys if not k.startswith(own) and ".lora_" in k}
    trained = sorted(
        k for k in outside if ".lora_B." in k and np.any(np.asarray(reader.get(k), np.float32))
    )
    if trained:
        raise ValueError(
            f"{source} has trained adapters outside the language model (e.g. "
            f"{trained[0]}): jaxrl trains {hf_keys.checkpoint_model_type(config)}'s language model "
            "on text only and does not run its vision tower. Merge that adapter with PEFT first "
            "(merge_and_unload) and train a new one on the merged model."
        )
    return outside
