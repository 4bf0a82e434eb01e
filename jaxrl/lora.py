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
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import parallel
from jaxrl.core import quant
from jaxrl.models import dropout as model_dropout
from jaxrl.models import gpt_oss, hf, moe
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
    "gemma2": ("q_proj", "v_proj"),
    "gemma3_text": ("q_proj", "v_proj"),
    # PEFT's table also lists mixtral, but under transformers v5 its MoE conversion replaces the
    # missing target_modules with none (`peft_v5_config`).
    "gpt2": ("c_attn",),
}
ALL_LINEAR = "all-linear"
# LoraExperts' adapters, in the order PEFT nests its ParamWrappers (the experts module's
# parameter order: `gate_up_proj` innermost), with their transformers v5 parameter names.
EXPERT_ADAPTERS = ("gate_up", "down")
EXPERT_PARAMETERS = {"gate_up": "gate_up_proj", "down": "down_proj"}
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


def _as_pairs(value: Mapping[str, Any] | Sequence[tuple[str, Any]] | None) -> tuple:
    """A pattern dict as `((key, value), ...)` in its order (the first matching key wins, as in
    PEFT's `get_pattern_key`): hashable, so the config can live in an nnx graphdef."""
    items = value.items() if isinstance(value, Mapping) else (value or ())
    return tuple((str(k), v) for k, v in items)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """PEFT `LoraConfig` fields jaxrl implements, with PEFT's names and defaults.

    `target_modules`: HF module names matched as PEFT does (a string is a regex that must match
    the full name, a list matches a name equal to or ending in `.entry`), `"all-linear"` for
    every linear layer except the output head, None for PEFT's per-family default.
    `init_lora_weights`: True (A kaiming-uniform(a=sqrt(5)), B zero), "gaussian" (A normal with
    std 1/r, B zero) or False (B random too: the adapter starts non-zero; for tests).
    `target_parameters`: parameter names (equal to or ending in `.entry`) of an MoE model's router
    and fused experts, as transformers v5 names them: `mlp.gate.weight`,
    `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`; on Qwen3-MoE, OLMoE and Mixtral PEFT
    also moves the router and expert names of `target_modules` here (see `peft_v5_config`).
    `rank_pattern` / `alpha_pattern`: `{regex: r}` / `{regex: alpha}` for the module or parameter
    names the regex matches at their end (PEFT's `get_pattern_key`); stored as ordered pairs.
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
    target_parameters: tuple[str, ...] | None = None
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", _as_tuple(self.target_modules))
        saved = self.modules_to_save
        object.__setattr__(self, "modules_to_save", None if saved is None else tuple(saved))
        if isinstance(self.target_parameters, str):
            raise TypeError("target_parameters must be a list of parameter names, not a string.")
        object.__setattr__(self, "target_parameters", _as_tuple(self.target_parameters))
        object.__setattr__(self, "rank_pattern", _as_pairs(self.rank_pattern))
        object.__setattr__(self, "alpha_pattern", _as_pairs(self.alpha_pattern))
        if not (isinstance(self.r, int) and self.r > 0):
            raise ValueError(f"LoRA rank r must be a positive integer, got {self.r!r}.")
        for key, rank in self.rank_pattern:
            if not (isinstance(rank, int) and rank > 0):
                raise ValueError(f"rank_pattern[{key!r}] must be a positive integer, got {rank!r}.")
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
        return self.scaling_for(self.r, self.lora_alpha)

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
        kwargs = {k: v for k, v in peft_config.items() if k in fields and v is not None}
        for key in ("target_modules", "target_parameters"):
            if isinstance(kwargs.get(key), set | frozenset | list):
                kwargs[key] = tuple(sorted(kwargs[key]))
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
            target_parameters=getattr(model_config, "lora_target_parameters", None),
        )

    def to_peft_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["target_modules"] = _as_json(self.target_modules)
        out["modules_to_save"] = _as_json(self.modules_to_save)
        out["target_parameters"] = _as_json(self.target_parameters)
        out["rank_pattern"] = dict(self.rank_pattern)
        out["alpha_pattern"] = dict(self.alpha_pattern)
        return out

    def rank_and_alpha(self, name: str) -> tuple[int, float]:
        """`(r, lora_alpha)` of the module or parameter `name`: the first `rank_pattern` /
        `alpha_pattern` key matching the end of the name (PEFT's `get_pattern_key`)."""

        def pick(pattern: tuple, default: Any) -> Any:
            for key, value in pattern:
                if re.match(rf"(.*\.)?({key})$", name):
                    return value
            return default

        return pick(self.rank_pattern, self.r), pick(self.alpha_pattern, self.lora_alpha)

    def scaling_for(self, r: int, alpha: float) -> float:
        return alpha / (math.sqrt(r) if self.use_rslora else r)


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
            key = jax.random.fold_in(key, self.dropout_id[...])
            if x.ndim - self.n_in == 2:  # [B, T, in...]: per position, the same at any T
                flat = (*h.shape[:2], math.prod(h.shape[2:]))
                keep = model_dropout.keep_mask(key, self.dropout, flat).reshape(h.shape)
            else:
                keep = jax.random.bernoulli(key, 1.0 - self.dropout, h.shape)
            h = jnp.where(keep, h / (1.0 - self.dropout), 0).astype(self.dtype)
        n_batch = x.ndim - self.n_in
        u = jax.lax.dot_general(
            h,
            self.lora_a[...].astype(self.dtype),
            ((tuple(range(n_batch, x.ndim)), tuple(range(self.n_in))), ((), ())),
        )
        delta = jnp.tensordot(u, self.lora_b[...].astype(self.dtype), axes=1)
        return y + (delta * self.scaling).astype(y.dtype)


class LoraRouter(moe.Router):
    """An MoE router with PEFT's `target_parameters` LoRA on its `gate.weight`: the logits use
    `W + scaling * A B` (`lora_a [layers?, D, r]`, `lora_b [layers?, r, E]`), folded as PEFT's
    `ParamWrapper` folds a 2-D parameter (the update is `D x E`, the size of the router)."""

    def __init__(
        self, base: moe.Router, lora_a: nnx.LoRAParam, lora_b: nnx.LoRAParam, scaling: float
    ):
        # No Router.__init__: the base router's kernel is reused.
        self.dtype, self.kernel = base.dtype, base.kernel
        self.lora_a, self.lora_b, self.scaling = lora_a, lora_b, scaling

    def weight(self) -> jax.Array:
        if _DISABLED.get():
            return super().weight()
        folded = _folded(self.kernel, self.lora_a[...], self.lora_b[...], self.scaling)
        return folded.astype(self.dtype)


class LoraExperts(moe.Experts):
    """Stacked experts with PEFT's `target_parameters` LoRA on the fused `gate_up_proj` and/or
    `down_proj` (transformers v5's `[E, out, in]` expert tensors): every expert `e` has its own
    `A_e`, `B_e` and its rows get `scaling * (x A_e) B_e`, computed with grouped matmuls on the
    factors inside the dispatch (`moe._dispatch`), so no full-size delta is ever formed.

    `gate_up`: `lora_a [layers?, E, D, r]`, `lora_b [layers?, E, r, 2, F]` (one adapter on the
    fused gate|up projection: both halves share A, as in PEFT). `down`: `lora_a [layers?, E, F,
    r]`, `lora_b [layers?, E, r, D]`. An adapter that is absent is None.
    """

    def __init__(
        self,
        base: moe.Experts,
        adapters: Mapping[str, tuple[nnx.LoRAParam, nnx.LoRAParam, float]],
    ):
        # No Experts.__init__: the base experts' variables are reused.
        self.dtype, self.mesh, self.rules = base.dtype, base.mesh, base.rules
        self.act, self.names = base.act, base.names
        for name in base.names:
            setattr(self, name, getattr(base, name))
        self._set_adapters(adapters)

    def _set_adapters(
        self, adapters: Mapping[str, tuple[nnx.LoRAParam, nnx.LoRAParam, float]]
    ) -> None:
        for kind in EXPERT_ADAPTERS:
            a, b, scaling = adapters.get(kind, (None, None, None))
            setattr(self, f"{kind}_lora_a", a)
            setattr(self, f"{kind}_lora_b", b)
            setattr(self, f"{kind}_scaling", scaling)

    def adapters(self) -> dict[str, tuple[nnx.LoRAParam, nnx.LoRAParam, float]]:
        return {
            kind: (
                getattr(self, f"{kind}_lora_a"),
                getattr(self, f"{kind}_lora_b"),
                getattr(self, f"{kind}_scaling"),
            )
            for kind in EXPERT_ADAPTERS
            if getattr(self, f"{kind}_lora_a") is not None
        }

    def low_rank(self) -> dict[str, tuple[jax.Array, jax.Array, float]]:
        if _DISABLED.get():
            return {}
        return {kind: (a[...], b[...], s) for kind, (a, b, s) in self.adapters().items()}


class LoraGptOssExperts(gpt_oss.GptOssExperts):
    """GPT-OSS's experts with PEFT's `target_parameters` LoRA on `gate_up_proj` (`[E, D, 2F]`,
    gate/up interleaved; one rank-r adapter whose `B` columns follow that interleaving in PEFT's
    file, `[E, r, 2, F]` here) and/or `down_proj` (`[E, F, D]`), applied inside the dispatch as
    `LoraExperts` does. Same adapter layout as `LoraExperts` otherwise."""

    def __init__(
        self,
        base: gpt_oss.GptOssExperts,
        adapters: Mapping[str, tuple[nnx.LoRAParam, nnx.LoRAParam, float]],
    ):
        # No GptOssExperts.__init__: the base experts' variables are reused.
        self.dtype, self.alpha, self.limit = base.dtype, base.alpha, base.limit
        self.mesh, self.rules = base.mesh, base.rules
        for name in GPT_OSS_EXPERT_PARAMS:
            setattr(self, name, getattr(base, name))
        self._set_adapters(adapters)

    _set_adapters = LoraExperts._set_adapters
    adapters = LoraExperts.adapters
    low_rank = LoraExperts.low_rank


GPT_OSS_EXPERT_PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
EXPERT_CLASSES = (moe.Experts, gpt_oss.GptOssExperts)
LORA_EXPERT_CLASSES = (LoraExperts, LoraGptOssExperts)


def _folded(kernel: nnx.Variable, a: jax.Array, b: jax.Array, scaling: float) -> jax.Array:
    """`W + scaling * A B` in f32 (batched over any leading axes: layers, experts)."""
    delta = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
    return param_value(kernel, jnp.float32) + scaling * delta


# ---------------------------------------------------------------- module names and traversal


def _stack_names(config: ModelConfig) -> tuple[str, ...]:
    return ("h",) if config.model_type == "gpt2" else ("layers",)


def hf_module_names(path: tuple, config: ModelConfig) -> list[str]:
    """HF module name(s) of our module at `path` (as transformers v5 names its modules, which
    PEFT's adapter files use): one per layer for a scanned (stacked) module."""
    parts: list[str] = []
    stacked = False
    for i, name in enumerate(path):
        if i == 0 and (name == "backbone" or (name == "model" and config.language_model_prefix)):
            name = hf._base_prefix(config)  # the HF base prefix (image-text: its language model)
        if i == 0 and name in hf.VISION_MODULES:
            name = f"model.{name}"  # transformers v5: `model.vision_tower...`
        if name == moe.MOE_ATTRIBUTE.get(config.model_type):
            name = "mlp"  # Mixtral's `block_sparse_moe` is `mlp` in transformers v5
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


# ---------------------------------------------------------------- PEFT's MoE targets

# PEFT 0.21 under transformers v5 (peft/utils/transformers_weight_conversion.py,
# `_convert_peft_config_moe`): on model types whose experts transformers v5 fuses, the router and
# expert names in `target_modules` become `target_parameters`. A type qualifies when it is a key
# of PEFT's copy of transformers' `_MODEL_TO_CONVERSION_PATTERN` (Mixtral added); Qwen2-MoE is
# only a value there, so its targets stay as given (its router and experts take
# `target_parameters` only).
_V5_MOE_CONVERSION = {"qwen3_moe": "qwen2_moe", "olmoe": "qwen2_moe", "mixtral": "mixtral"}
# `_MOE_TARGET_MODULE_MAPPING`: transformers v4 module name -> v5 parameter name, in its order.
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
_MOE_PARAMETER_EXAMPLE = "['mlp.gate.weight', 'mlp.experts.gate_up_proj', 'mlp.experts.down_proj']"


def _is_all_linear(path: tuple, module: nnx.Module) -> bool:
    """PEFT's "all-linear": every linear layer but the output head (MoE routers and experts are
    not `nn.Linear` in transformers v5)."""
    return type(module) is Dense and path != ("lm_head",)


def _parameter_names(module: nnx.Module, names: list[str]) -> dict[str, list[str]]:
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
    modules = [(p, m) for p, m in _modules(model) if p]
    if targets.lower() == ALL_LINEAR:
        linear = {
            name.rsplit(".", 1)[-1]
            for path, module in modules
            if _is_all_linear(path, module)
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
            param_keys += [k for keys in _parameter_names(module, names).values() for k in keys]
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
    pattern = _V5_MOE_CONVERSION.get(model_type)
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


# ---------------------------------------------------------------- apply


def _resolve_targets(config: LoraConfig, model_type: str) -> str | tuple[str, ...]:
    if config.target_modules is None:
        if model_type in DEFAULT_TARGETS:
            return DEFAULT_TARGETS[model_type]
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
    shape = _value_shape(variable.get_value())
    axes = tuple(variable.get_metadata().get("out_sharding") or (None,) * len(shape))
    return _lead(variable), shape, axes


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
    targets = _resolve_targets(config, hf.checkpoint_model_type(model_config))
    parameters = config.target_parameters or ()
    router_targets = [t for t in parameters if "router." in t or t.startswith("router")]
    if router_targets and model_config.model_type == "gpt_oss":
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
    for path, module in _modules(model):
        if not path:
            continue
        names = hf_module_names(path, model_config)
        if saved and _all_or_none(path, names, saved, "modules_to_save"):
            saved_modules.append((path, module))
            found_saved.update(t for t in saved if any(_matches(n, (t,)) for n in names))
            continue
        if isinstance(module, (moe.Router, *EXPERT_CLASSES)):
            if targets != ALL_LINEAR and _all_or_none(path, names, targets, "target_modules"):
                what = "router" if isinstance(module, moe.Router) else "experts"
                raise ValueError(
                    f"target_modules {targets!r} selects the MoE {what} module {names[0]!r}, "
                    "which is not a linear layer (PEFT refuses it too). LoRA reaches MoE routers "
                    f"and experts through target_parameters, e.g. {_MOE_PARAMETER_EXAMPLE}."
                )
            kinds = []
            for kind, keys in _parameter_names(module, names).items():
                if parameters and _all_or_none(path, keys, parameters, "target_parameters"):
                    kinds.append(kind)
                    found_parameters.update(
                        t for t in parameters if any(_matches(k, (t,)) for k in keys)
                    )
            if kinds:
                chosen_moe.append((path, module, tuple(kinds)))
            continue
        is_linear = isinstance(module, Dense)
        if parameters and is_linear:
            hits = [t for t in parameters if any(_matches(f"{n}.weight", (t,)) for n in names)]
            if hits:
                raise ValueError(
                    f"target_parameters {hits} select the weight of the linear layer "
                    f"{names[0]!r}; jaxrl's target_parameters adapt MoE routers and experts "
                    "only. Adapt a linear layer through target_modules (PEFT's file is the same)."
                )
        if targets == ALL_LINEAR:
            if _is_all_linear(path, module):
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
    unmatched = sorted(set(parameters) - found_parameters)
    if unmatched:
        raise ValueError(
            f"target_parameters {unmatched} matched no parameter of this "
            f"{model_config.model_type} model; they name MoE router and expert parameters as "
            f"transformers v5 does, e.g. {_MOE_PARAMETER_EXAMPLE}."
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
        next_id += math.prod(_value_shape(layer.kernel.get_value())[: _lead(layer.kernel)])
        _set_node(model, path, lora_layer)
    for path, module, kinds in chosen_moe:
        keys = _parameter_names(module, hf_module_names(path, model_config))
        ranks = {kind: _rank_alpha(config, path, keys[kind]) for kind in kinds}
        if isinstance(module, moe.Router):
            adapted = _make_lora_router(module, config, *ranks["gate"], rngs.params(), model_config)
        else:
            adapted = _make_lora_experts(module, config, ranks, rngs.params(), model_config)
        _set_node(model, path, adapted)
    for _, module in saved_modules:
        _retype_params(module, SavedParam)
    model.lora_config = config
    return model


def _retype_params(module: nnx.Module, cls: type[nnx.Param]) -> None:
    """Re-declare the plain (or saved) params under `module` as `cls`, keeping value and metadata."""
    for path, var in list(nnx.iter_graph(module)):
        if isinstance(var, nnx.Param) and not isinstance(var, nnx.LoRAParam):
            if type(var) is not cls:
                _set_node(module, tuple(path), cls(var.get_value(), **var.get_metadata()))


def _lora_layers(model: nnx.Module) -> list[tuple[tuple, LoraDense]]:
    return [(p, m) for p, m in _modules(model) if isinstance(m, LoraDense)]


def _moe_layers(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    return [(p, m) for p, m in _modules(model) if isinstance(m, (LoraRouter, *LORA_EXPERT_CLASSES))]


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
    attribute = moe.MOE_ATTRIBUTE.get(model_config.model_type)
    return name if attribute is None else name.replace(".mlp.", f".{attribute}.")


def _adapters(model: nnx.Module) -> list[_Adapter]:
    model_config: ModelConfig = model.config
    out = []
    for path, layer in _modules(model):
        if not isinstance(layer, (LoraDense, LoraRouter, *LORA_EXPERT_CLASSES)):
            continue
        names = hf_module_names(path, model_config)
        if isinstance(layer, LoraDense):
            lead = _lead(layer.kernel)
            out.append(_Adapter(names, names, False, layer.lora_a, layer.lora_b, lead))
        elif isinstance(layer, LoraRouter):
            targets = _parameter_names(layer, names)["gate"]
            v4 = [_v4_name(n, model_config) for n in names]
            lead = _lead(layer.kernel)
            out.append(_Adapter(names, targets, True, layer.lora_a, layer.lora_b, lead, v4))
        else:
            keys = _parameter_names(layer, names)
            adapters = layer.adapters()
            is_gpt_oss = isinstance(layer, LoraGptOssExperts)
            lead = _lead(layer.gate_up_proj if is_gpt_oss else getattr(layer, layer.names[0]))
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


def _merged_param(variable: nnx.Variable, a: jax.Array, b: jax.Array, scaling: float) -> nnx.Param:
    value = _folded(variable, a, b, scaling).astype(variable.get_value().dtype)
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
        _set_node(out, path, dense)
    for path, layer in _moe_layers(out):
        _set_node(out, path, _merged_moe(layer, model_config))
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
    for entry in hf._entries(saved_state, model_config):
        value = parallel.to_host(entry.variable.get_value())
        for key, x in zip(entry.keys(), _layer_slices(value, entry.split), strict=True):
            tensors[PEFT_PREFIX + key] = hf._ours_to_hf(
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
        "fan_in_fan_out": model_config.model_type == "gpt2",
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
    for entry in hf._entries(nnx.state(model, SavedParam), model_config):
        layers = [
            hf._hf_to_ours(
                read(PEFT_PREFIX + k, entry.hf_shape),
                entry.path,
                entry.layer_shape,
                model_config,
                entry.layout,
            )
            for k in entry.keys()
        ]
        saved_var = _node(model, entry.path)
        assign(saved_var, layers)
    unused -= _inert_vision_adapters(reader, unused, model_config, path)
    if unused:
        raise ValueError(
            f"{path / ADAPTER_WEIGHTS} has tensors this model does not use: {sorted(unused)[:10]}"
        )
    return model


def _inert_vision_adapters(
    reader: SafetensorsFile, keys: set[str], config: ModelConfig, path: Path
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
            f"{path / ADAPTER_WEIGHTS} has trained adapters outside the language model (e.g. "
            f"{trained[0]}): jaxrl trains {hf.checkpoint_model_type(config)}'s language model on "
            "text only and does not run its vision tower. Merge that adapter with PEFT first "
            "(merge_and_unload) and train a new one on the merged model."
        )
    return outside
