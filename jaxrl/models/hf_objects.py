"""transformers model objects -> jaxrl models, in memory: TRL's most common pattern passes
`model=AutoModelForCausalLM.from_pretrained(...)` to a trainer. The object's config and state dict
are read as a checkpoint directory would be (`hf.from_state`: the same key mapping, the same
sharded placement); training then happens in JAX on our copy, and the torch module is never
touched again.

torch is an optional extra: it is imported only here, inside the functions that read a torch
state dict (a caller holding a torch model has it). `peft.PeftModel` objects (base + adapter) are
`jaxrl.lora.peft_io.from_peft_model`, which uses `state_dict_reader` below. No file I/O here.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxrl.models.hf import Model, from_state

TORCH_EXTRA = 'pip install "jaxrl[torch]"'


def is_transformers_model(obj: Any) -> bool:
    """A transformers `PreTrainedModel` (PyTorch). Imports nothing: an object of that class
    exists only once transformers' modeling code is loaded."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    try:
        return isinstance(obj, transformers.PreTrainedModel)
    except (AttributeError, ImportError):  # transformers without torch has no PreTrainedModel
        return False


def source_path(obj: Any) -> str | None:
    """The directory or Hub id a transformers model was loaded from (its `name_or_path`, where
    TRL finds the tokenizer), or None for one built from a config."""
    return getattr(obj, "name_or_path", None) or None


def _torch() -> Any:
    try:
        import torch
    except ImportError as err:  # only reachable with a torch-like object and no torch
        raise ImportError(
            f"Reading a PyTorch model's weights needs torch; install it ({TORCH_EXTRA}) or save "
            "the model with save_pretrained and pass its directory."
        ) from err
    return torch


class StateDictReader:
    """A torch state dict (HF key -> tensor) behind `CheckpointReader`'s lookup (`keys`, `in`,
    `get`, `spec`): each tensor is copied to a host numpy array only when read (bf16 as
    `ml_dtypes.bfloat16`, which numpy alone cannot represent)."""

    def __init__(self, tensors: Mapping[str, Any]):
        self._torch = _torch()
        self.tensors = dict(tensors)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def get(self, key: str) -> np.ndarray:
        t = self.tensors[key].detach().to("cpu").contiguous()
        if t.dtype == self._torch.bfloat16:
            return t.view(self._torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy().copy()  # our copy: the torch module may go on changing its own

    def spec(self, key: str) -> tuple[tuple[int, ...], np.dtype]:
        x = self.get(key)
        return tuple(x.shape), x.dtype


def hf_config_of(obj: Any) -> Any:
    """The model's config as its saved `config.json` would read: `architectures` names its
    class (as `save_pretrained` writes it), which tells a sequence classifier from a causal LM."""
    config = copy.deepcopy(obj.config)
    config.architectures = [type(obj).__name__]
    return config


def from_transformers(obj: Any, **load_kwargs: Any) -> Model:
    """A jaxrl model with the weights of the transformers model `obj`, read from its state dict
    in memory with `from_pretrained`'s mapping and `load_kwargs` (dtype, mesh, rules, task, ...).
    `source_path(obj)` is where its vision weights are copied from when an image-text model
    loaded without `vision=True` is saved."""
    if not is_transformers_model(obj):
        raise TypeError(f"Expected a transformers PreTrainedModel, got {type(obj).__name__}.")
    return from_state(
        hf_config_of(obj),
        StateDictReader(obj.state_dict()),
        source=f"The given {type(obj).__name__}",
        passthrough_dir=local_dir(source_path(obj)),
        **load_kwargs,
    )


def local_dir(path: str | None) -> Path | None:
    return Path(path) if path and Path(path).is_dir() else None
