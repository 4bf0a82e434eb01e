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
every layer. This file holds no training loop and no config parsing.

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
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxrl import parallel
from jaxrl.core import quant
from jaxrl.models import hf, moe
from jaxrl.models.config import ModelConfig
from jaxrl.models.layers import Dense, param_value
from jaxrl.models.weights_io import SafetensorsFile, write_safetensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# PEFT's default targets when `target_modules` is None
# (peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
DEFAULT_TARGETS = {
    "llama": ("q_proj", "v_proj"),
    "mistral": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"),
    "qwen3": ("q_proj", "v_proj"),
    "gemma": ("q_proj", "v_proj"),
    "gemma3_text": ("q_proj", "v_proj"),
    "mixtral": ("q_proj", "v_proj"),
    "gpt2": ("c_attn",),
}
ALL_LINEAR = "all-linear"
# PEFT adds these to modules_to_save for task_type="SEQ_CLS" (the classification head).
SEQ_CLS_HEADS = ("classifier", "score")
TASK_TYPES = (None, "CAUSAL_LM", "SEQ_CLS")
INIT_CHOICES = (True, False, "gaussian")
# adapter_config.json keys that describe the file rather than the adapter.
_PEFT_METADATA = {
    "peft_type",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "auto_mapping",
    "peft_version",
    "megatron_core",
    "qalora_group_size",
    "fan_in_fan_out",
}


class SavedParam(nnx.Param):
    """A `modules_to_save` parameter: trained in full, exported with the adapter."""


class LoraDropoutId(nnx.Variable):
    """A per-layer integer folded into the dropout key, so every adapted layer (also each layer
    of a scanned stack) draws its own mask."""


# Trainable variables: what `split_lora` puts in the adapter state.
ADAPTER = nnx.Any(nnx.LoRAParam, SavedParam)

_DROPOUT_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "lora_dropout_key", default=None
)
_DISABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("lora_disabled", default=False)


@contextlib.contextmanager
def dropout_rng(key: jax.Array | None) -> Iterator[None]:
    """Apply `lora_dropout` with `key` to model calls traced inside the block (training). Without
    it (or with `key=None`) adapters are deterministic, as PEFT in eval mode. Enter it inside the
    jitted function: the key is read when the model is traced."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


@contextlib.contextmanager
def disable_adapter() -> Iterator[None]:
    """Model calls traced inside the block skip every LoRA branch (PEFT's `disable_adapter()`):
    the frozen base alone, e.g. the implicit DPO reference, with no second copy of the weights.
    `modules_to_save` params keep the values they are given; for PEFT's "original module"
    semantics merge the adapter state captured before training."""
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


class _WithoutAdapter:
    """Proxy returned by `without_adapter`."""

    def __init__(self, model: nnx.Module):
        self._model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with disable_adapter():
            return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._model, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with disable_adapter():
                return attr(*args, **kwargs)

        return call


def without_adapter(model: nnx.Module) -> Any:
    """`model` seen through `disable_adapter()`: each of its method calls (`hidden_states`,
    `unembed_weight`, ...) runs the frozen base alone. For code that receives a model object and
    calls it later, e.g. a reference model handed to a shared forward function."""
    return _WithoutAdapter(model)


# ---------------------------------------------------------------- config


def _as_tuple(value: str | Sequence[str] | None) -> str | tuple[str, ...] | None:
    if value is None or isinstance(value, str):
        return value
    return tuple(sorted(value))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """PEFT `LoraConfig` fields jaxrl implements, with PEFT's names and defaults.

    `target_modules`: HF module names matched as PEFT does (a string is a regex that must match
    the full name, a list matches a name equal to or ending in `.entry`), `"all-linear"` for
    every linear layer except the output head, None for PEFT's per-family default.
    `init_lora_weights`: True (A kaiming-uniform(a=sqrt(5)), B zero), "gaussian" (A normal with
    std 1/r, B zero) or False (B random too: the adapter starts non-zero; for tests).
    """

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: str | tuple[str, ...] | None = None
    modules_to_save: tuple[str, ...] | None = None
    use_rslora: bool = False
    bias: str = "none"
    init_lora_weights: bool | str = True
    task_type: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", _as_tuple(self.target_modules))
        saved = self.modules_to_save
        object.__setattr__(self, "modules_to_save", None if saved is None else tuple(saved))
        if not (isinstance(self.r, int) and self.r > 0):
            raise ValueError(f"LoRA rank r must be a positive integer, got {self.r!r}.")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}.")
        if self.bias != "none":
            raise ValueError(
                f"LoRA bias={self.bias!r} is not supported: jaxrl trains adapters with frozen "
                "biases only (PEFT's default bias='none'); drop the option."
            )
        if self.init_lora_weights not in INIT_CHOICES:
            raise ValueError(
                f"init_lora_weights={self.init_lora_weights!r} is not supported; use True "
                "(PEFT default), 'gaussian' or False."
            )
        if self.task_type not in TASK_TYPES:
            raise ValueError(f"task_type={self.task_type!r} is not supported; use {TASK_TYPES}.")

    @property
    def scaling(self) -> float:
        """lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_peft(cls, peft_config: Any) -> LoraConfig:
        """From a `peft.LoraConfig` (or its `adapter_config.json` dict). Options jaxrl does not
        implement (DoRA, rank/alpha patterns, layers_to_transform, ...) are rejected unless they
        are at their off value."""
        if not isinstance(peft_config, Mapping):
            peft_config = peft_config.to_dict()
        fields = {f.name for f in dataclasses.fields(cls)}
        peft_type = str(peft_config.get("peft_type", "LORA")).split(".")[-1]
        if peft_type != "LORA":
            raise ValueError(f"Only LoRA adapters are supported, got peft_type={peft_type!r}.")
        unsupported = {
            k: v
            for k, v in peft_config.items()
            if k not in fields and k not in _PEFT_METADATA and v not in (None, False, {}, [], ())
        }
        if unsupported:
            raise ValueError(
                f"PEFT options {unsupported} are not supported by jaxrl.lora; supported: "
                f"{sorted(fields)}."
            )
        kwargs = {k: v for k, v in peft_config.items() if k in fields}
        if isinstance(kwargs.get("target_modules"), set | frozenset | list):
            kwargs["target_modules"] = tuple(sorted(kwargs["target_modules"]))
        task = kwargs.get("task_type")
        kwargs["task_type"] = None if task is None else str(task).split(".")[-1]
        return cls(**kwargs)

    @classmethod
    def from_trl(cls, model_config: Any) -> LoraConfig | None:
        """From TRL `ModelConfig` fields (as `trl.get_peft_config`); None unless `use_peft`."""
        if not model_config.use_peft:
            return None
        if getattr(model_config, "use_dora", False):
            raise ValueError("use_dora=True (DoRA) is not supported by jaxrl; use plain LoRA.")
        if getattr(model_config, "lora_target_parameters", None) is not None:
            raise ValueError(
                "lora_target_parameters is not supported by jaxrl (it targets MoE expert "
                "tensors); use lora_target_modules."
            )
        targets = model_config.lora_target_modules
        if isinstance(targets, list | tuple) and list(targets) == [ALL_LINEAR]:
            targets = ALL_LINEAR  # the CLI gives `--lora_target_modules all-linear` as a list
        return cls(
            r=model_config.lora_r,
            lora_alpha=model_config.lora_alpha,
            lora_dropout=model_config.lora_dropout,
            target_modules=targets,
            modules_to_save=model_config.lora_modules_to_save,
            use_rslora=model_config.use_rslora,
            task_type=getattr(model_config, "lora_task_type", None),
        )

    def to_peft_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["target_modules"] = _as_json(self.target_modules)
        out["modules_to_save"] = _as_json(self.modules_to_save)
        return out


def _as_json(value: str | tuple[str, ...] | None) -> str | list[str] | None:
    return list(value) if isinstance(value, tuple) else value


# ---------------------------------------------------------------- the adapted layer


class LoraDense(Dense):
    """`Dense` plus a low-rank update: `x W + b + scaling * dropout(x) A B`.

    Holds the base layer's own `kernel`/`bias` variables (frozen; possibly quantized) and the
    adapter `lora_a [layers?, in..., r]`, `lora_b [layers?, r, out...]`. The adapter branch runs
    in the layer's compute dtype.
    """

    def __init__(
        self,
        base: Dense,
        lora_a: nnx.LoRAParam,
        lora_b: nnx.LoRAParam,
        scaling: float,
        dropout: float,
        dropout_id: LoraDropoutId | None,
    ):
        # No Dense.__init__: the base layer's variables are reused, not re-initialised.
        self.n_in, self.dtype, self.kernel, self.bias = (
            base.n_in,
            base.dtype,
            base.kernel,
            base.bias,
        )
        self.lora_a, self.lora_b = lora_a, lora_b
        self.scaling, self.dropout = scaling, dropout
        self.dropout_id = dropout_id

    def __call__(self, x: jax.Array) -> jax.Array:
        y = super().__call__(x)
        if _DISABLED.get():
            return y
        h = x.astype(self.dtype)
        key = _DROPOUT_KEY.get()
        if self.dropout > 0 and key is not None:
            keep = jax.random.bernoulli(
                jax.random.fold_in(key, self.dropout_id[...]), 1.0 - self.dropout, h.shape
            )
            h = jnp.where(keep, h / (1.0 - self.dropout), 0).astype(self.dtype)
        n_batch = x.ndim - self.n_in
        u = jax.lax.dot_general(
            h,
            self.lora_a[...].astype(self.dtype),
            ((tuple(range(n_batch, x.ndim)), tuple(range(self.n_in))), ((), ())),
        )
        delta = jnp.tensordot(u, self.lora_b[...].astype(self.dtype), axes=1)
        return y + (delta * self.scaling).astype(y.dtype)


# ---------------------------------------------------------------- module names and traversal


def _stack_names(config: ModelConfig) -> tuple[str, ...]:
    return ("h",) if config.model_type == "gpt2" else ("layers",)


def hf_module_names(path: tuple, config: ModelConfig) -> list[str]:
    """HF module name(s) of our module at `path`: one per layer for a scanned (stacked) module."""
    parts: list[str] = []
    stacked = False
    for i, name in enumerate(path):
        if i == 0 and name == "backbone":  # SequenceClassificationModel's HF base prefix
            name = hf.BASE_PREFIX.get(config.model_type, "model")
        parts.append(str(name))
        if config.scan_layers and name in _stack_names(config) and i + 1 < len(path):
            if not isinstance(path[i + 1], int):
                parts.append("{}")
                stacked = True
    template = ".".join(parts)
    return [template.format(i) for i in range(config.num_layers)] if stacked else [template]


def _matches(name: str, targets: str | tuple[str, ...]) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def _all_or_none(path: tuple, names: list[str], targets: Any, what: str) -> bool:
    hits = [_matches(n, targets) for n in names]
    if any(hits) and not all(hits):
        raise ValueError(
            f"{what} {targets!r} selects only some layers of the scanned stack at {path}; "
            "per-layer selection needs scan_layers=False."
        )
    return all(hits)


def _node(root: nnx.Module, path: tuple) -> Any:
    for key in path:
        root = root[key] if isinstance(key, int) else getattr(root, key)
    return root


def _set_node(root: nnx.Module, path: tuple, value: Any) -> None:
    parent = _node(root, path[:-1])
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


def _modules(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    return [(tuple(p), m) for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)]


def _lead(variable: nnx.Variable) -> int:
    """Number of leading stacked-layer axes of a param."""
    axes = variable.get_metadata().get("out_sharding") or ()
    return sum(1 for a in axes if a == "layers")


def _value_shape(value: Any) -> tuple[int, ...]:
    if isinstance(value, quant.NF4Array):
        return value.shape
    if isinstance(value, quant.QuantizedArray):
        return tuple(value.values.shape)
    return tuple(value.shape)


# ---------------------------------------------------------------- apply


def _resolve_targets(config: LoraConfig, model_type: str) -> str | tuple[str, ...]:
    if config.target_modules is None:
        if model_type not in DEFAULT_TARGETS:
            raise ValueError(f"No default LoRA targets for {model_type!r}; set target_modules.")
        return DEFAULT_TARGETS[model_type]
    return config.target_modules


def _modules_to_save(config: LoraConfig) -> tuple[str, ...]:
    saved = tuple(config.modules_to_save or ())
    return saved + SEQ_CLS_HEADS if config.task_type == "SEQ_CLS" else saved


def _lora_init(
    config: LoraConfig, key: jax.Array, a_shape: tuple, b_shape: tuple, fan_in: int
) -> tuple[jax.Array, jax.Array]:
    key_a, key_b = jax.random.split(key)
    if config.init_lora_weights == "gaussian":
        a = jax.random.normal(key_a, a_shape, jnp.float32) / config.r
    else:
        # torch kaiming_uniform_(a=sqrt(5)) on A [r, in]: bound = sqrt(6 / ((1 + 5) fan_in)).
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(key_a, a_shape, jnp.float32, -bound, bound)
    if config.init_lora_weights is False:
        # nn.Linear's own init of B [out, r]: the same kaiming bound with fan_in = r.
        bound = 1.0 / math.sqrt(config.r)
        return a, jax.random.uniform(key_b, b_shape, jnp.float32, -bound, bound)
    return a, jnp.zeros(b_shape, jnp.float32)


def _place(value: jax.Array, axes: tuple, model_config: ModelConfig) -> jax.Array:
    if model_config.mesh is None:
        return value
    spec = parallel.logical_to_spec(axes, model_config.rules, value.shape, model_config.mesh)
    return jax.device_put(value, NamedSharding(model_config.mesh, spec))


def _make_lora_layer(
    layer: Dense, config: LoraConfig, key: jax.Array, first_id: int, model_config: ModelConfig
) -> LoraDense:
    kernel = layer.kernel
    lead = _lead(kernel)
    shape = _value_shape(kernel.get_value())
    axes = tuple(kernel.get_metadata().get("out_sharding") or (None,) * len(shape))
    in_shape, out_shape = shape[lead : lead + layer.n_in], shape[lead + layer.n_in :]
    lead_shape, lead_axes = shape[:lead], axes[:lead]
    a_axes = (*lead_axes, *axes[lead : lead + layer.n_in], None)
    b_axes = (*lead_axes, None, *axes[lead + layer.n_in :])
    a, b = _lora_init(
        config,
        key,
        (*lead_shape, *in_shape, config.r),
        (*lead_shape, config.r, *out_shape),
        math.prod(in_shape),
    )

    def param(value: jax.Array, value_axes: tuple) -> nnx.LoRAParam:
        value = _place(value, value_axes, model_config)
        return nnx.LoRAParam(value, out_sharding=value_axes, eager_sharding=False)

    dropout_id = None
    if config.lora_dropout > 0:
        ids = first_id + jnp.arange(math.prod(lead_shape), dtype=jnp.int32).reshape(lead_shape)
        dropout_id = LoraDropoutId(ids, out_sharding=lead_axes, eager_sharding=False)
    return LoraDense(
        layer, param(a, a_axes), param(b, b_axes), config.scaling, config.lora_dropout, dropout_id
    )


def apply_lora(model: nnx.Module, config: LoraConfig, rngs: nnx.Rngs) -> nnx.Module:
    """Add LoRA adapters to `model` in place (as PEFT's `get_peft_model`) and return it.

    Adapters are created in the sharding their logical axes give on `model.config.mesh`. The base
    may already be quantized (`quantize_base`); the adapters are f32 either way.
    """
    model_config: ModelConfig = model.config
    if getattr(model, "lora_config", None) is not None:
        raise ValueError("The model already has LoRA adapters; merge_lora() it first.")
    targets = _resolve_targets(config, model_config.model_type)
    saved = _modules_to_save(config)
    chosen: list[tuple[tuple, Dense]] = []
    saved_modules: list[tuple[tuple, nnx.Module]] = []
    found_saved: set[str] = set()
    for path, module in _modules(model):
        if not path:
            continue
        names = hf_module_names(path, model_config)
        if saved and _all_or_none(path, names, saved, "modules_to_save"):
            saved_modules.append((path, module))
            found_saved.update(t for t in saved if any(_matches(n, (t,)) for n in names))
            continue
        if isinstance(module, (moe.Router, moe.Experts)):
            _refuse_moe_target(module, names, targets)
            continue
        is_linear = isinstance(module, Dense)
        if targets == ALL_LINEAR:
            if type(module) is Dense and path != ("lm_head",):
                chosen.append((path, module))
            continue
        if not _all_or_none(path, names, targets, "target_modules"):
            continue
        if type(module) is not Dense or path == ("lm_head",):
            kind = "an output head" if is_linear else f"a {type(module).__name__}"
            raise ValueError(
                f"target_modules {targets!r} selects {names[0]!r}, which is {kind}; LoRA applies "
                "to the decoder's linear layers. Put heads and embeddings in modules_to_save."
            )
        chosen.append((path, module))
    if not chosen:
        raise ValueError(
            f"target_modules {targets!r} matched no linear layer of this {model_config.model_type}"
            " model (names as in the HF checkpoint, e.g. 'q_proj' or 'model.layers.0.mlp.up_proj')."
        )
    # PEFT writes its automatic SEQ_CLS head names into saved configs; only one of them exists.
    missing = [
        t for t in (config.modules_to_save or ()) if t not in found_saved and t not in SEQ_CLS_HEADS
    ]
    if missing:
        raise ValueError(f"modules_to_save {missing} matched no module of this model.")
    next_id = 0
    for path, layer in chosen:
        lora_layer = _make_lora_layer(layer, config, rngs.params(), next_id, model_config)
        next_id += math.prod(_value_shape(layer.kernel.get_value())[: _lead(layer.kernel)])
        _set_node(model, path, lora_layer)
    for _, module in saved_modules:
        _retype_params(module, SavedParam)
    model.lora_config = config
    return model


def _refuse_moe_target(module: nnx.Module, names: list[str], targets: Any) -> None:
    """PEFT (with transformers v5) puts LoRA on an MoE model's router and stacked expert
    weights (`target_parameters`) when the targets name them by their per-expert names
    (`gate_proj`, Mixtral's `w1`, the router `gate`) or are "all-linear"; jaxrl has no adapters
    on those, so such targets are an error rather than a different set of adapted layers."""
    if isinstance(module, moe.Router):
        candidates = names
    else:
        experts = getattr(module, module.names[0]).shape[-3]
        candidates = [f"{n}.{e}.{p}" for n in names for e in range(experts) for p in module.names]
    if targets == ALL_LINEAR or any(_matches(c, targets) for c in candidates):
        raise ValueError(
            f"target_modules {targets!r} selects the MoE {'router' if isinstance(module, moe.Router) else 'experts'} "
            f"at {names[0]!r}; LoRA on a mixture-of-experts model's router and expert weights "
            "(PEFT's target_parameters) is not implemented in jaxrl. Target the attention "
            "projections (and shared experts / dense MLP layers) by name, e.g. "
            "['q_proj', 'k_proj', 'v_proj', 'o_proj']."
        )


def _retype_params(module: nnx.Module, cls: type[nnx.Param]) -> None:
    """Re-declare the plain (or saved) params under `module` as `cls`, keeping value and metadata."""
    for path, var in list(nnx.iter_graph(module)):
        if isinstance(var, nnx.Param) and not isinstance(var, nnx.LoRAParam):
            if type(var) is not cls:
                _set_node(module, tuple(path), cls(var.get_value(), **var.get_metadata()))


def _lora_layers(model: nnx.Module) -> list[tuple[tuple, LoraDense]]:
    return [(p, m) for p, m in _modules(model) if isinstance(m, LoraDense)]


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
            math.prod(_value_shape(v.get_value())) for v in variables if isinstance(v, nnx.Param)
        )

    trainable = count(adapter)
    return trainable, trainable + count(base)


def _merged_kernel(layer: LoraDense) -> jax.Array:
    kernel = layer.kernel.get_value()
    dtype = (
        kernel.dtype if not isinstance(kernel, quant.QuantizedArray) else jnp.dtype(kernel.dtype)
    )
    w = param_value(layer.kernel, jnp.float32)
    lead = _lead(layer.kernel)
    a, b = layer.lora_a.get_value(), layer.lora_b.get_value()
    lead_shape = w.shape[:lead]
    r = a.shape[-1]
    a_flat = a.reshape(*lead_shape, -1, r)
    b_flat = b.reshape(*lead_shape, r, -1)
    delta = jnp.matmul(a_flat, b_flat, precision=jax.lax.Precision.HIGHEST).reshape(w.shape)
    return (w + layer.scaling * delta).astype(dtype)


def merge_lora(model: nnx.Module) -> nnx.Module:
    """A plain model with `W + scaling * A B` folded into every adapted kernel (PEFT's
    `merge_and_unload`); `save_pretrained` writes it as a full HF directory. A quantized kernel
    is dequantized to its original dtype first. `model` itself is left unchanged."""
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
        _set_node(out, path, dense)
    _retype_params(out, nnx.Param)
    out.lora_config = None
    return out


# ---------------------------------------------------------------- quantized base


def quantize_base(model: nnx.Module, scheme: str = "nf4") -> nnx.Module:
    """Store the frozen linear kernels of `model` quantized, in place (`load_in_8bit`: "int8",
    per-output-channel absmax; `load_in_4bit`: "nf4", QLoRA's NF4 in blocks of 64). As
    bitsandbytes does through transformers, the output head, embeddings and norms stay in full
    precision, and so do adapters and modules_to_save params. Kernels are dequantized at their
    point of use (one layer at a time inside a scanned stack)."""
    for path, module in _modules(model):
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


# ---------------------------------------------------------------- PEFT files


def _layer_slices(x: np.ndarray, lead: int) -> list[np.ndarray]:
    return [x] if lead == 0 else list(x.reshape(-1, *x.shape[lead:]))


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
    for layer_path, layer in _lora_layers(model):
        layer_names = hf_module_names(layer_path, model_config)
        names += layer_names
        lead = _lead(layer.kernel)
        a_layers = _layer_slices(parallel.to_host(layer.lora_a.get_value()), lead)
        b_layers = _layer_slices(parallel.to_host(layer.lora_b.get_value()), lead)
        for name, a, b in zip(layer_names, a_layers, b_layers, strict=True):
            # ours: A [in..., r], B [r, out...]; PEFT: lora_A.weight [r, in], lora_B.weight [out, r]
            tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.reshape(-1, config.r).T
            tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.reshape(config.r, -1).T
    saved_state = nnx.state(model, SavedParam)
    for entry in hf._entries(saved_state, model_config):
        value = parallel.to_host(entry.variable.get_value())
        for key, x in zip(entry.keys(), _layer_slices(value, entry.split), strict=True):
            tensors[PEFT_PREFIX + key] = hf._ours_to_hf(x, entry.path, entry.hf_shape, model_config)
    if jax.process_index() != 0:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    peft_config = {
        **config.to_peft_dict(),
        "peft_type": "LORA",
        "target_modules": sorted(names),
        # PEFT's flag for GPT-2's Conv1D ([in, out]) base weights.
        "fan_in_fan_out": model_config.model_type == "gpt2",
        "base_model_name_or_path": base_model_name_or_path,
        "inference_mode": True,
    }
    (path / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2))
    specs = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    write_safetensors(path / ADAPTER_WEIGHTS, specs, tensors.__getitem__, {"format": "pt"})


def load_peft_adapter(model: nnx.Module, path: str | Path) -> nnx.Module:
    """Add the PEFT adapter in `path` to `model` (in place) and return it, e.g. to continue
    training it or to export it merged. Every tensor of the file must map onto the model."""
    path = Path(path)
    if not (path / ADAPTER_CONFIG).exists() or not (path / ADAPTER_WEIGHTS).exists():
        raise FileNotFoundError(
            f"{path} is not a PEFT adapter directory: expected {ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS} (PeftModel.save_pretrained output)."
        )
    model_config: ModelConfig = model.config
    peft_config = json.loads((path / ADAPTER_CONFIG).read_text())
    if peft_config.get("fan_in_fan_out") and model_config.model_type != "gpt2":
        raise ValueError(
            f"{path} sets fan_in_fan_out=True, which only fits GPT-2's Conv1D layers; this is a "
            f"{model_config.model_type} model."
        )
    apply_lora(model, LoraConfig.from_peft(peft_config), nnx.Rngs(0))
    reader = SafetensorsFile(path / ADAPTER_WEIGHTS)
    unused = set(reader.keys())

    def read(key: str, shape: tuple) -> np.ndarray:
        if key not in unused:
            raise KeyError(f"{path / ADAPTER_WEIGHTS} has no tensor {key!r} the adapter needs.")
        unused.discard(key)
        x = reader.get(key)
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{key} in {path} has shape {x.shape}, the model needs {shape}.")
        return x

    def assign(variable: nnx.Variable, layers: list[np.ndarray]) -> None:
        old = variable.get_value()
        host = np.stack(layers) if _lead(variable) else layers[0]
        host = host.reshape(old.shape).astype(old.dtype)
        sharding = getattr(old, "sharding", None)
        variable.set_value(jax.device_put(host, sharding) if sharding is not None else host)

    r = model.lora_config.r
    for layer_path, layer in _lora_layers(model):
        names = hf_module_names(layer_path, model_config)
        lead = _lead(layer.kernel)
        in_size = math.prod(layer.lora_a.get_value().shape[lead:-1])
        out_size = math.prod(layer.lora_b.get_value().shape[lead + 1 :])
        a = [read(f"{PEFT_PREFIX}{n}.lora_A.weight", (r, in_size)).T for n in names]
        b = [read(f"{PEFT_PREFIX}{n}.lora_B.weight", (out_size, r)).T for n in names]
        assign(layer.lora_a, a)
        assign(layer.lora_b, b)
    for entry in hf._entries(nnx.state(model, SavedParam), model_config):
        layers = [
            hf._hf_to_ours(
                read(PEFT_PREFIX + k, entry.hf_shape), entry.path, entry.layer_shape, model_config
            )
            for k in entry.keys()
        ]
        saved_var = _node(model, entry.path)
        assign(saved_var, layers)
    if unused:
        raise ValueError(
            f"{path / ADAPTER_WEIGHTS} has tensors this model does not use: {sorted(unused)[:10]}"
        )
    return model
