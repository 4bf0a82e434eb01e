"""DDPO reward functions: JPEG (in)compressibility and the LAION aesthetic predictor.

Rewards take images as TRL's DDPO pipeline produces them (float [B, 3, H, W] in [0, 1]) and follow
TRL's `reward_fn(images, prompts, metadata) -> (rewards, reward_metadata)` signature. JPEG sizes
are host work (PIL); the aesthetic score is a jittable CLIP image tower + MLP after host-side CLIP
preprocessing (transformers' CLIPImageProcessor: bicubic resize, center crop, normalise).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.diffusion.hf import load_clip_vision
from jaxrl.models.diffusion.nn import Dtypes, Linear
from jaxrl.models.weights_io import TorchBinFile


def to_uint8(images_BCHW: Any) -> np.ndarray:
    """(x * 255).round().clamp(0, 255) as uint8, as TRL and ddpo-pytorch quantise images."""
    x = np.asarray(jax.device_get(images_BCHW), dtype=np.float32)
    return np.clip(np.round(x * 255.0), 0, 255).astype(np.uint8)


def jpeg_size_kb(images_BCHW: Any, quality: int = 95) -> np.ndarray:
    """[B] size in kB (1000 bytes) of each image saved as a JPEG at `quality` (PIL)."""
    from PIL import Image

    sizes = []
    for image_CHW in to_uint8(images_BCHW):
        buffer = io.BytesIO()
        Image.fromarray(image_CHW.transpose(1, 2, 0)).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return np.asarray(sizes, np.float32)


def jpeg_incompressibility(
    images: Any, prompts: Sequence[str] = (), metadata: Sequence[Any] = ()
) -> tuple[np.ndarray, dict]:
    """Reward = JPEG size in kB (ddpo-pytorch `jpeg_incompressibility`)."""
    return jpeg_size_kb(images), {}


def jpeg_compressibility(
    images: Any, prompts: Sequence[str] = (), metadata: Sequence[Any] = ()
) -> tuple[np.ndarray, dict]:
    """Reward = -JPEG size in kB (ddpo-pytorch `jpeg_compressibility`)."""
    return -jpeg_size_kb(images), {}


# torch `nn.Sequential` indices of the predictor's Linear layers (1, 3, 5 are Dropout, inactive
# at inference; there are no activations).
AESTHETIC_LAYERS = ("0", "2", "4", "6", "7")


class AestheticMLP(nnx.Module):
    """LAION improved-aesthetic-predictor head: five Linear layers, no activations."""

    def __init__(self, dims: Sequence[int], rngs: nnx.Rngs | None = None, dtype: Any = jnp.float32):
        if len(dims) != len(AESTHETIC_LAYERS) + 1:
            raise ValueError(f"AestheticMLP needs {len(AESTHETIC_LAYERS) + 1} dims, got {dims}.")
        dt = Dtypes(dtype, jnp.float32)
        self.layers = nnx.Dict(
            {
                name: Linear(n_in, n_out, dt, rngs, axes=(None, None))
                for name, n_in, n_out in zip(AESTHETIC_LAYERS, dims[:-1], dims[1:], strict=True)
            }
        )

    def __call__(self, embeds_BD: jax.Array) -> jax.Array:
        x = embeds_BD
        for name in AESTHETIC_LAYERS:
            x = self.layers[name](x)
        return x[:, 0]


def load_aesthetic_mlp(path: str | Path) -> AestheticMLP:
    """The predictor from its published PyTorch state dict (`layers.{0,2,4,6,7}.{weight,bias}`,
    e.g. sac+logos+ava1-l14-linearMSE.pth or TRL's trl-lib/ddpo-aesthetic-predictor)."""
    tensors = TorchBinFile(Path(path))
    expected = {f"layers.{n}.{w}" for n in AESTHETIC_LAYERS for w in ("weight", "bias")}
    if not expected <= set(tensors.keys()):
        raise KeyError(
            f"{path} is not an aesthetic-predictor state dict: missing "
            f"{sorted(expected - set(tensors.keys()))}."
        )
    weights = [tensors.get(f"layers.{n}.weight") for n in AESTHETIC_LAYERS]
    dims = [weights[0].shape[1], *(w.shape[0] for w in weights)]
    mlp = AestheticMLP(dims, nnx.Rngs(0))
    for name, w in zip(AESTHETIC_LAYERS, weights, strict=True):
        mlp.layers[name].kernel[...] = jnp.asarray(w.T, jnp.float32)
        mlp.layers[name].bias[...] = jnp.asarray(tensors.get(f"layers.{name}.bias"), jnp.float32)
    return mlp


def aesthetic_score(
    clip_vision: nnx.Module, mlp: AestheticMLP, pixel_values_BCHW: jax.Array
) -> jax.Array:
    """[B] scores: MLP(CLIP image features / ||features||) (TRL `AestheticScorer.__call__`)."""
    embeds = clip_vision(pixel_values_BCHW).astype(jnp.float32)
    embeds = embeds / jnp.linalg.norm(embeds, axis=-1, keepdims=True)
    return mlp(embeds)


class AestheticScorer:
    """TRL's `aesthetic_scorer` reward: `scorer(images, prompts, metadata) -> (scores, {})`.

    `clip_path` is a CLIP model directory (openai/clip-vit-large-patch14 in TRL) with its
    preprocessor config; `mlp_path` the predictor's .pth state dict.
    """

    def __init__(self, clip_path: str | Path, mlp_path: str | Path):
        import transformers

        self.processor = transformers.CLIPImageProcessor.from_pretrained(clip_path)
        clip = load_clip_vision(clip_path)
        mlp = load_aesthetic_mlp(mlp_path)
        self._score = nnx.jit(aesthetic_score)
        self.clip, self.mlp = clip, mlp

    def pixel_values(self, images_BCHW: Any) -> np.ndarray:
        return self.processor(images=list(to_uint8(images_BCHW)), return_tensors="np")[
            "pixel_values"
        ]

    def __call__(
        self, images: Any, prompts: Sequence[str] = (), metadata: Sequence[Any] = ()
    ) -> tuple[np.ndarray, dict]:
        scores = self._score(self.clip, self.mlp, jnp.asarray(self.pixel_values(images)))
        return np.asarray(scores), {}
