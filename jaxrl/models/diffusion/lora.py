"""LoRA on the UNet's attention projections, as TRL v0.7.2's DDPO trains it, and its export in
diffusers' LoRA format.

TRL (`DefaultDDPOStableDiffusionPipeline`, use_lora=True) puts diffusers' `LoRAAttnProcessor` on
every attention of the UNet: rank 4 adapters on to_q, to_k, to_v and to_out.0, down-projection
initialised N(0, 1/rank), up-projection zeros, no network alpha (scale 1). Adapter params are
`LoRAParam`s (an `nnx.Param` subclass), so a trainer splits them from the frozen UNet with
`nnx.split(unet, LoRAParam, ...)`. This file is self-contained (the LLM LoRA lives elsewhere).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.diffusion.nn import Linear
from jaxrl.models.diffusion.unet import Attention, UNet2DConditionModel
from jaxrl.models.weights_io import SafetensorsFile, TorchBinFile, write_safetensors

TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
LORA_FILE = "pytorch_lora_weights.safetensors"
# diffusers' pre-PEFT attention-processor names (what TRL 0.7.2's `save_attn_procs` writes).
LEGACY_NAMES = {
    "to_q": "to_q_lora",
    "to_k": "to_k_lora",
    "to_v": "to_v_lora",
    "to_out.0": "to_out_lora",
}


class LoRAParam(nnx.Param):
    """A trainable adapter weight."""


class LoRA(nnx.Module):
    """x -> (x @ down) @ up * scale; down [in, rank], up [rank, out]."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        rank: int,
        key: jax.Array,
        *,
        axes: tuple[str | None, str | None] = ("embed", "heads"),
        scale: float = 1.0,
        param_dtype: Any = jnp.float32,
    ):
        # diffusers LoRALinearLayer: nn.init.normal_(down, std=1/rank), zeros_(up).
        down = jax.random.normal(key, (n_in, rank), param_dtype) / rank
        self.down = LoRAParam(down, out_sharding=(axes[0], None), eager_sharding=False)
        self.up = LoRAParam(
            jnp.zeros((rank, n_out), param_dtype),
            out_sharding=(None, axes[1]),
            eager_sharding=False,
        )
        self.scale = scale

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        return (x @ self.down[...].astype(dtype)) @ self.up[...].astype(dtype) * self.scale


def _target(attn: Attention, name: str) -> Linear:
    return attn.to_out[0] if name == "to_out.0" else getattr(attn, name)


def attention_modules(unet: UNet2DConditionModel) -> list[tuple[str, Attention]]:
    """(dotted path, module) of every attention in the UNet, in module order."""
    return [
        (".".join(str(p) for p in path), module)
        for path, module in nnx.iter_modules(unet)
        if isinstance(module, Attention)
    ]


def add_lora(
    unet: UNet2DConditionModel, *, rank: int = 4, seed: int = 0, scale: float = 1.0
) -> UNet2DConditionModel:
    """Attach rank-`rank` adapters to to_q/to_k/to_v/to_out.0 of every UNet attention (in place;
    returns `unet`). Starts as the identity (up = 0), as TRL's."""
    key = jax.random.key(seed)
    for _, attn in attention_modules(unet):
        for name in TARGETS:
            layer = _target(attn, name)
            if layer.lora is not None:
                raise ValueError("add_lora: this UNet already has LoRA adapters.")
            n_in, n_out = layer.kernel.shape
            key, sub = jax.random.split(key)
            axes = tuple(layer.kernel.get_metadata().get("out_sharding") or (None, None))
            layer.lora = LoRA(n_in, n_out, rank, sub, axes=axes, scale=scale)
    return unet


def _adapters(unet: UNet2DConditionModel) -> list[tuple[str, LoRA]]:
    out = []
    for path, attn in attention_modules(unet):
        for name in TARGETS:
            lora = _target(attn, name).lora
            if lora is not None:
                out.append((f"{path}.{name}", lora))
    if not out:
        raise ValueError("The UNet has no LoRA adapters; call add_lora first.")
    return out


def lora_state_dict(unet: UNet2DConditionModel) -> dict[str, np.ndarray]:
    """diffusers (PEFT) LoRA keys: `unet.<module>.lora_A.weight` [rank, in] (down) and
    `unet.<module>.lora_B.weight` [out, rank] (up, times the adapter scale)."""
    state = {}
    for module, lora in _adapters(unet):
        state[f"unet.{module}.lora_A.weight"] = np.asarray(jax.device_get(lora.down[...])).T
        up = np.asarray(jax.device_get(lora.up[...])) * lora.scale
        state[f"unet.{module}.lora_B.weight"] = up.T
    return state


def save_lora_weights(unet: UNet2DConditionModel, directory: str | Path) -> Path:
    """Write `pytorch_lora_weights.safetensors` that `StableDiffusionPipeline.load_lora_weights`
    loads (process 0 writes)."""
    directory = Path(directory)
    state = lora_state_dict(unet)
    path = directory / LORA_FILE
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        specs = {k: (v.shape, v.dtype) for k, v in state.items()}
        write_safetensors(path, specs, state.__getitem__, metadata={"format": "pt"})
    return path


def load_lora_weights(
    unet: UNet2DConditionModel, path: str | Path, *, seed: int = 0
) -> UNet2DConditionModel:
    """Attach and fill adapters from a LoRA file: diffusers/PEFT keys (`lora_A`/`lora_B`, with
    or without the `unet.` prefix) or the attention-processor keys TRL 0.7.2 saves
    (`<attn>.processor.to_q_lora.down.weight`). Network alphas are not supported."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / LORA_FILE, path / "pytorch_lora_weights.bin"]
        path = next((p for p in candidates if p.exists()), candidates[0])
    reader = SafetensorsFile(path) if path.suffix == ".safetensors" else TorchBinFile(path)
    keys = set(reader.keys())
    if any(k.endswith(".alpha") for k in keys):
        raise ValueError(f"{path} has network alphas; LoRA with alpha != rank is not supported.")

    def find(module: str, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        for prefix in ("unet.", ""):
            a, b = (
                f"{prefix}{module}.{name}.lora_A.weight",
                f"{prefix}{module}.{name}.lora_B.weight",
            )
            if a in keys and b in keys:
                return reader.get(a).T, reader.get(b).T
        legacy = f"{module}.processor.{LEGACY_NAMES[name]}"
        if f"{legacy}.down.weight" in keys:
            return reader.get(f"{legacy}.down.weight").T, reader.get(f"{legacy}.up.weight").T
        return None

    found = {}
    for module, attn in attention_modules(unet):
        for name in TARGETS:
            weights = find(module, name)
            if weights is None:
                raise KeyError(f"{path} has no LoRA weights for {module}.{name}.")
            found[(module, name)] = (attn, weights)
    rank = next(iter(found.values()))[1][0].shape[1]
    add_lora(unet, rank=rank, seed=seed)
    for (_, name), (attn, (down, up)) in found.items():
        lora = _target(attn, name).lora
        lora.down[...] = jnp.asarray(down, lora.down[...].dtype)
        lora.up[...] = jnp.asarray(up, lora.up[...].dtype)
    return unet
