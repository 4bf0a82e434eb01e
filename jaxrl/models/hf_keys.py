"""The HF <-> jaxrl parameter-key mapping: which checkpoint key(s) and tensor layout each of our
params has. Shared by checkpoint loading and saving (`hf.py`) and PEFT adapter files
(`jaxrl.lora`).

Our module tree mirrors HF's names, so the key mapping is mechanical: `kernel`/`scale`/`embedding`
-> `weight`, layer index inserted for scanned stacks, torch `nn.Linear` weights transposed
([out, in] -> [in, out]), GPT-2 `Conv1D` weights only reshaped. This file reads and writes no
files and places no arrays on devices (that is `hf.py`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flax import nnx

from jaxrl.models import gpt_oss
from jaxrl.models.config import ModelConfig
from jaxrl.models.families import FAMILIES, family
from jaxrl.models.weights_io import CheckpointReader

# Top-level modules of an image-text model outside its language model: transformers v5 names
# them under `model.` (`model.vision_tower...`), checkpoints keep them at the top.
VISION_MODULES = ("vision_tower", "multi_modal_projector")
# The decoder-layer stacks' names (`layers`; GPT-2's `h`).
LAYER_STACK_NAMES = tuple(dict.fromkeys(f.layer_stack_name for f in FAMILIES.values()))


def base_prefix(config: ModelConfig) -> str:
    """HF `base_model_prefix` of the backbone's keys (image-text: where its language model
    lives)."""
    return config.language_model_prefix or family(config.model_type).base_prefix


def checkpoint_model_type(config: ModelConfig) -> str:
    """The checkpoint's own model_type: the language model's, or that of the image-text model
    around it (Gemma 3's "gemma3")."""
    return getattr(config.hf_config, "model_type", None) or config.model_type


def is_layer_stack(name: Any) -> bool:
    return name in LAYER_STACK_NAMES


def hf_key_template(path: tuple, config: ModelConfig, per_expert: bool = False) -> tuple[str, int]:
    """HF key for a flat-state path, and how many leading axes of the param are split into
    separate HF keys: each "{}" stands for one, the layer index of a stacked (scanned) param,
    then the expert index of an MoE expert weight (`experts.{e}.gate_proj.weight`)."""
    parts: list[str] = []
    split = 0
    if path[0] == "pretrained_model":  # value-head wrapper: the LM keeps its own HF keys
        path = path[1:]
    for i, name in enumerate(path):
        if i == 0 and (name == "backbone" or (name == "model" and config.language_model_prefix)):
            name = base_prefix(config)
        if i == 0 and name in VISION_MODULES:  # module-named as transformers v5 (`disk_key`)
            name = f"model.{name}"
        parts.append(str(name))
        stacked = i + 1 < len(path) and not isinstance(path[i + 1], int)
        if is_layer_stack(name) and config.scan_layers and stacked:
            parts.append("{}")
            split += 1
    if per_expert:  # [..., "experts", "gate_proj"] -> "experts.{}.gate_proj.weight"
        return ".".join([*parts[:-1], "{}", parts[-1], "weight"]), split + 1
    leaf = {"kernel": "weight", "scale": "weight", "embedding": "weight"}.get(parts[-1], parts[-1])
    return ".".join([*parts[:-1], leaf]), split


def is_conv1d(path: tuple, config: ModelConfig) -> bool:
    return path[-1] == "kernel" and path[-2] in family(config.model_type).conv1d_modules


def is_linear(path: tuple, config: ModelConfig) -> bool:
    """A torch `nn.Linear`-layout weight ([out, in]): our kernels [in..., out...] and the MoE
    expert weights [in, out] per expert (a param with an `hf_layout` is never asked)."""
    return (path[-1] == "kernel" and not is_conv1d(path, config)) or (
        len(path) > 1 and path[-2] == "experts"
    )


def hf_shape(
    path: tuple,
    shape: tuple[int, ...],
    n_in: int | None,
    config: ModelConfig,
    layout: str | None = None,
) -> tuple:
    """Shape of the HF tensor for one (unstacked) param of ours."""
    if layout is not None:
        return gpt_oss.hf_shape(layout, shape)
    if path[-1] == "kernel" or is_linear(path, config):
        fan_in, fan_out = math.prod(shape[:n_in]), math.prod(shape[n_in:])
        return (fan_in, fan_out) if is_conv1d(path, config) else (fan_out, fan_in)
    if path[-1] == "bias":
        return (math.prod(shape),)
    return shape


def hf_to_ours(
    x: np.ndarray,
    path: tuple,
    shape: tuple[int, ...],
    config: ModelConfig,
    layout: str | None = None,
) -> np.ndarray:
    if layout is not None:
        return gpt_oss.from_hf(layout, x, shape)
    if is_linear(path, config):
        x = x.T  # torch nn.Linear stores [out, in]
    return x.reshape(shape)


def ours_to_hf(
    x: np.ndarray, path: tuple, hf_shape: tuple, config: ModelConfig, layout: str | None = None
) -> np.ndarray:
    if layout is not None:
        return gpt_oss.to_hf(layout, x, hf_shape)
    if is_linear(path, config):
        return x.reshape(hf_shape[::-1]).T
    return x.reshape(hf_shape)


class ParamEntry:
    """One param of ours and the HF key(s) it maps to: one key per index of its `split` leading
    axes (layers of a scanned stack, then experts), in row-major order."""

    def __init__(self, path: tuple, variable: nnx.Variable, config: ModelConfig):
        self.path = path
        self.variable = variable
        metadata = variable.get_metadata()
        self.template, self.split = hf_key_template(path, config, bool(metadata.get("per_expert")))
        shape = tuple(variable.shape)
        self.split_shape = shape[: self.split]
        self.layer_shape = shape[self.split :]
        self.n_in = metadata.get("n_in")
        # How the HF tensor's layout differs from ours when not the usual mapping (GPT-OSS's
        # interleaved gate/up experts: `gpt_oss.INTERLEAVED`, `gpt_oss.AS_IS`).
        self.layout = metadata.get("hf_layout")
        self.hf_shape = hf_shape(path, self.layer_shape, self.n_in, config, self.layout)

    def indices(self) -> list[tuple[int, ...]]:
        return list(np.ndindex(*self.split_shape))

    def keys(self) -> list[str]:
        return [self.template.format(*index) for index in self.indices()]


def entries(state: Any, config: ModelConfig) -> list[ParamEntry]:
    return [ParamEntry(tuple(p), v, config) for p, v in nnx.to_flat_state(state)]


def disk_key(key: str, config: ModelConfig) -> str:
    """The checkpoint key of a module-named key. transformers keeps image-text checkpoints in
    their original layout (its conversion mapping renames `language_model.model.*` to
    `model.language_model.*` and `language_model.lm_head` to `lm_head` on load, and back on
    save); jaxrl writes that layout too and reads either."""
    prefix = config.language_model_prefix
    if prefix and key.startswith(prefix + "."):
        return "language_model.model." + key[len(prefix) + 1 :]
    if prefix and key.startswith(tuple(f"model.{m}." for m in VISION_MODULES)):
        return key[len("model.") :]
    if prefix and key.startswith("lm_head."):
        return "language_model." + key
    return key


def lookup_key(key: str, reader: CheckpointReader, config: ModelConfig) -> str | None:
    if key in reader:
        return key
    if disk_key(key, config) in reader:
        return disk_key(key, config)
    prefix = base_prefix(config) + "."
    if key.startswith(prefix) and key[len(prefix) :] in reader:  # base-model checkpoints
        return key[len(prefix) :]
    tower = "vision_tower."
    disk = disk_key(key, config)
    if disk.startswith(tower):  # transformers v4's SigLIP layout (the released Gemma 3 files)
        old = tower + "vision_model." + disk[len(tower) :]
        return old if old in reader else None
    return None
