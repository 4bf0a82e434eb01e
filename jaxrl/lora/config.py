"""`LoraConfig`: the PEFT LoRA options jaxrl implements, with PEFT's names and defaults, built
from a `peft.LoraConfig`, an `adapter_config.json` dict or TRL's `ModelConfig` fields.

Plain data: this file knows no model and touches no arrays (which modules a config selects is
`targets.py`, adding the adapters `apply.py`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.models.families import FAMILIES

# PEFT's default targets when `target_modules` is None, per model_type (the family table's
# `default_lora_targets`).
DEFAULT_TARGETS = {
    t: f.default_lora_targets for t, f in FAMILIES.items() if f.default_lora_targets is not None
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
